"""The ``sglang`` dialect: SGLang's native ``POST /generate`` with ``input_ids``.

The answer's ``meta_info.output_token_logprobs`` carries ``(logprob, token_id, text)`` per sampled
token; the prefill re-score uses ``logprob_start_len`` and ``input_token_logprobs``. The server's
settings are read back from ``/server_info`` and ``/model_info``.

Weight sync (ARCHITECTURE.md, Weight sync): ``/update_weights_from_disk`` (a checkpoint the probe
writes to ``work_dir``, which the server must be able to read: same machine or a shared file
system), or ``/update_weights_from_tensor`` between ``/begin_weight_update`` and
``/end_weight_update`` with each bucket as a pickle of CPU tensors whose bytes travel inline
(base64), which SGLang's ``SafeUnpickler`` takes from any process on any machine; then
``/flush_cache``; the colocate cycle is ``/release_memory_occupation`` + ``/resume_memory_occupation``.
SGLang 0.5 (sglang/srt/...): every route is in entrypoints/http_server.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import SyncSpec
from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest
from mismatch_probe.engines.http_client import server_message
from mismatch_probe.engines.remote.dialect import (
    Dialect,
    RouteFailed,
    ServerInfo,
    Session,
    first_found,
    routed_rows,
)
from mismatch_probe.engines.sglang import SERVER_CAPABILITIES, SLEEP_FLUSH_BY
from mismatch_probe.engines.sglang_args import settings_by_argument
from mismatch_probe.errors import ConfigError, EngineError

# how long SGLang's /flush_cache may wait for the server to be idle, seconds
# (srt/managers/scheduler_components/flush_wrapper.py: SchedulerFlushWrapper.handle)
FLUSH_WAIT_S = 60.0

# SGLang server_info field -> the name the in-process engines record it under
SGLANG_SERVER_INFO = {
    # the ServerArgs fields the settings' declarations name (engines/sglang_args.py: settings_by_argument),
    # less the multi-node rendezvous a server does not report
    **{
        arg: name
        for arg, name in settings_by_argument().items()
        if name not in ("nnodes", "node_rank", "dist_init_addr")
    },
    # SGLang's negated switches, kept under their own names (enforce_eager and prefix_caching follow from them)
    "disable_cuda_graph": "disable_cuda_graph",
    "disable_radix_cache": "disable_radix_cache",
    # what only a server's arguments say
    "prefill_attention_backend": "prefill_attention_backend",
    "decode_attention_backend": "decode_attention_backend",
    "sampling_backend": "sampling_backend",
    "enable_torch_compile": "enable_torch_compile",
    "chunked_prefill_size": "chunked_prefill_size",
    "page_size": "page_size",
    "disable_overlap_schedule": "disable_overlap_schedule",
    "random_seed": "random_seed",
    "schedule_policy": "schedule_policy",
    "skip_tokenizer_init": "skip_tokenizer_init",
    "model_path": "model",
    "served_model_name": "served_model_name",
    "enable_return_routed_experts": "return_routed_experts",
}

SGLANG_DISK_FLUSH_BY = (
    "sglang/srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager."
    "update_weights_from_disk -> flush_cache_after_weight_update (UpdateWeightFromDiskReqInput.flush_cache, "
    "default true; over HTTP the body sets it: sync.reset_prefix_cache)"
)


class SGLangDialect(Dialect):
    """SGLang's native ``/generate`` (token ids in and out)."""

    generate_path = "/generate"
    routing_settings_hint = "its /server_info is not there (a router?): point --engine-url at one SGLang worker"
    routes_hint = (
        "every SGLang server (python -m sglang.launch_server) has the weight-update routes; a router in front of "
        "workers may not: point --engine-url at one worker"
    )
    sync_server = "an SGLang server"
    # what an SGLang server can take, as the in-process engine's facts say it (engines/sglang.py)
    sync = SERVER_CAPABILITIES.sync
    processed_by = SERVER_CAPABILITIES.processed_by

    def __init__(self, model_path: Path) -> None:
        from mismatch_probe.engines.sglang import PrefillLogprobs

        # of the checkpoint the server must serve (check_served_model)
        self.prefill_reader = PrefillLogprobs(model_path)

    def workarounds(self) -> dict:
        return self.prefill_reader.workarounds()

    def honors_seeds(self, server: ServerInfo) -> bool:
        # a request's sampling_seed only with --enable-deterministic-inference
        return bool(server.settings.get("batch_invariant"))

    def sync_check(self, session: Session, server: ServerInfo, sync: SyncSpec) -> dict:
        info = first_found(session, ("/server_info", "/get_server_info"))
        if not info:
            raise ConfigError(
                f"{session.where('')} has no /server_info (a router?), so its parallel layout, which a weight "
                "update must match, is unknown",
                hint="point --engine-url at one SGLang worker to sync its weights",
            )
        tp, dp = int(info.get("tp_size") or 1), int(info.get("dp_size") or 1)
        if sync.transfer == "tensor" and dp > 1:
            raise ConfigError(
                "SGLang updates weights from tensors only with one data-parallel replica "
                "(srt/managers/tokenizer_control_mixin.py: update_weights_from_tensor asserts dp_size == 1: "
                f"'data-parallel replicas are not supported for update weights from tensor'); the server has dp_size {dp}",
                hint="--sync-transfer disk (update_weights_from_disk reaches every replica)",
            )
        if sync.sleep_level:
            if info.get("device") == "cpu":
                raise ConfigError(
                    "the server is SGLang on CPU: its colocate cycle (/release_memory_occupation, "
                    "/resume_memory_occupation) frees and restores memory through torch_memory_saver "
                    "(srt/utils/torch_memory_saver_adapter.py: CUDA VMM and Intel XPU), which CPU memory has no "
                    "allocator for, so sync.sleep_level cannot run there",
                    hint="drop --sync-sleep-level with a CPU server",
                )
            if not info.get("enable_memory_saver"):
                raise ConfigError(
                    f"the SGLang server at {session.where('')} runs without its memory saver, so "
                    "/release_memory_occupation frees nothing (sync.sleep_level)",
                    hint="restart it with --enable-memory-saver, or drop --sync-sleep-level",
                )
            backup = bool(info.get("enable_weights_cpu_backup"))
            if backup != (sync.sleep_level == 1):
                raise ConfigError(
                    f"sync.sleep_level = {sync.sleep_level} {'keeps' if sync.sleep_level == 1 else 'discards'} the "
                    f"weights over the cycle (vLLM's levels), but the SGLang server runs "
                    f"{'with' if backup else 'without'} --enable-weights-cpu-backup, so it "
                    f"{'keeps' if backup else 'discards'} them",
                    hint=f"--sync-sleep-level {1 if backup else 2}, or restart the server "
                    f"{'without' if backup else 'with'} --enable-weights-cpu-backup",
                )
        return {"tp_size": tp, "dp_size": dp}

    def sleep_cycle(self, session: Session, level: int) -> dict:
        session.update("/release_memory_occupation", {}, "the memory release (/release_memory_occupation)")
        session.update("/resume_memory_occupation", {}, "the memory resumption (/resume_memory_occupation)")
        return {
            "level": level,
            "calls": "POST /release_memory_occupation, POST /resume_memory_occupation (all tags)",
            "weights_cpu_backup": level == 1,
            "engine_flushes_itself": True,
            "by": SLEEP_FLUSH_BY,
        }

    def load_from_disk(self, session: Session, work_dir: str, sync: SyncSpec) -> dict:
        body = {"model_path": work_dir, "flush_cache": bool(sync.reset_prefix_cache)}
        answer = session.update("/update_weights_from_disk", body, "the weight update (/update_weights_from_disk)")
        # SGLang now names the served model by the path it loaded (TokenizerManager._update_model_path_info)
        status, model_info = session.get("/model_info")
        after = {k: model_info.get(k) for k in ("model_path", "weight_version")} if status == 200 else None
        out = {
            "call": "POST /update_weights_from_disk {model_path, flush_cache} (srt/entrypoints/http_server.py: "
            "update_weights_from_disk, SGLang's in-place reload)",
            "engine_report": {**answer, "model_info_after": after} if isinstance(answer, dict) else answer,
        }
        if sync.reset_prefix_cache:
            out["reset_prefix_cache"] = {
                "call": "POST /update_weights_from_disk (flush_cache = true)",
                "engine_flushes_itself": True,
                "by": SGLANG_DISK_FLUSH_BY,
            }
        return out

    def load_tensors(self, session: Session, named, sync: SyncSpec, server: dict) -> dict:
        from mismatch_probe.engines import weight_sync as ws

        weight_update = "the weight-update session"
        begin = session.try_update("/begin_weight_update", {}, f"opening {weight_update} (/begin_weight_update)")
        if not begin[0]:
            raise RouteFailed(
                f"SGLang at {session.where('/begin_weight_update')} did not open {weight_update}: {server_message(begin[1])}",
                status=0,
                hint="if a sync was interrupted, its session is still open: POST /end_weight_update to the server "
                "closes it",
            )
        sent = ws.SentBuckets(named, sync.bucket_mb)
        messages: set[str] = set()
        failed: RouteFailed | None = None
        try:
            for bucket in sent:
                payload = _pickled_bucket(bucket)
                body = {"serialized_named_tensors": [payload] * server["tp_size"], "flush_cache": False}
                answer = session.update(
                    "/update_weights_from_tensor", body, f"bucket {sent.buckets} (/update_weights_from_tensor)"
                )
                messages.add(str(answer.get("message")) if isinstance(answer, dict) else str(answer))
        except RouteFailed as exc:
            failed = exc
        end = session.try_update("/end_weight_update", {}, f"closing {weight_update} (/end_weight_update)")
        if failed is not None:
            raise failed
        if not end[0]:
            raise RouteFailed(f"SGLang did not close {weight_update}: {server_message(end[1])}", status=0)
        return {
            "call": "POST /update_weights_from_tensor {serialized_named_tensors, flush_cache: false} per bucket, "
            "between POST /begin_weight_update and POST /end_weight_update (srt/entrypoints/http_server.py; "
            "-> model.load_weights); each bucket a pickle of CPU tensors, their bytes inline (base64), one copy "
            "per tensor-parallel rank",
            **sent.counts(),
            "engine_report": {
                "success": True,
                "messages": sorted(messages),
                "begin": server_message(begin[1]),
                "end": server_message(end[1]),
                "tp_size": server["tp_size"],
            },
        }

    def reset_prefix_cache(self, session: Session) -> dict:
        # with a timeout SGLang flushes once it is idle (a flush while requests run is refused)
        ok, answer = session.try_update(
            "/flush_cache", None, "the radix cache flush (/flush_cache)", params={"timeout": FLUSH_WAIT_S}
        )
        return {
            "call": "POST /flush_cache (srt/entrypoints/http_server.py: flush_cache)",
            "result": ok,
            "message": server_message(answer),
        }

    def read_server(self, session: Session, served_model: str | None) -> ServerInfo:
        server_info = first_found(session, ("/server_info", "/get_server_info"))
        model_info = first_found(session, ("/model_info", "/get_model_info")) or {}
        if server_info is None:
            if session.get("/health")[0] != 200:
                raise ConfigError(
                    f"{session.where('/server_info')} (and /get_server_info, /health) did not answer: "
                    "not an SGLang server",
                    hint="check --engine-url; for vllm serve pass --engine-api openai",
                )
            # a router in front of SGLang workers (slime's, sgl-model-gateway) serves /generate only
            server_info = {}
        names = {n for n in (model_info.get("model_path"), model_info.get("served_model_name")) if n}
        names |= {n for n in (server_info.get("model_path"), server_info.get("served_model_name")) if n}
        model = served_model or model_info.get("served_model_name") or server_info.get("served_model_name") or ""
        info = ServerInfo(model=model, names=names, software="sglang", version=server_info.get("version"))
        for key, name in SGLANG_SERVER_INFO.items():
            if key in server_info:
                info.settings[name] = server_info[key]
        # the in-process engines' names for SGLang's negated switches
        if "disable_cuda_graph" in info.settings:
            info.settings["enforce_eager"] = info.settings["disable_cuda_graph"]
        if "disable_radix_cache" in info.settings:
            info.settings["prefix_caching"] = not info.settings["disable_radix_cache"]
        info.raw["server_info"] = {k: server_info[k] for k in SGLANG_SERVER_INFO if k in server_info}
        info.raw["model_info"] = {
            k: model_info.get(k) for k in ("model_path", "served_model_name", "weight_version", "model_type")
        }
        info.architectures = model_info.get("architectures")
        info.max_model_len = server_info.get("context_length")
        info.unknown["logprobs_mode"] = (
            "SGLang does not expose SGLANG_RETURN_ORIGINAL_LOGPROB (set on the server: raw log-probs; "
            "unset: log_softmax(logits / T)); engine.logprobs_mode must say which"
        )
        info.unknown["tokenizer"] = "SGLang's native API has no tokenizer endpoint; names and architectures are checked"
        if not server_info:
            why = "the server (a router?) has no /server_info: point --engine-url at one SGLang worker to read it"
            info.unknown.update({name: why for name in SGLANG_SERVER_INFO.values() if name not in info.settings})
            info.unknown["version"] = why
        return info

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_new_tokens": int(r.max_tokens),
            "stop_token_ids": [int(t) for t in stops],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if seed is not None:
            params["sampling_seed"] = seed  # honored with --enable-deterministic-inference
        body = {"input_ids": [int(t) for t in r.prompt_token_ids], "sampling_params": params, "return_logprob": True}
        if self.routing is not None:  # from the last prompt position: the input behind the first sampled token
            body.update(return_routed_experts=True, routed_experts_start_len=len(r.prompt_token_ids) - 1)
        return body

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        from mismatch_probe.engines.sglang import finish_reason, sampled_logprobs

        if "output_ids" not in answer:
            raise ConfigError(
                f"{where}: the answer has no output_ids",
                hint="is it SGLang's /generate? For vllm serve or swift rollout pass --engine-api openai",
            )
        tokens = np.asarray(answer["output_ids"], dtype=np.int32)
        meta = answer.get("meta_info") or {}
        try:
            completion = Completion(
                token_ids=tokens,
                logprobs=sampled_logprobs(meta.get("output_token_logprobs"), tokens),
                finish_reason=finish_reason(meta, where),
            )
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None
        if (layout := self.routing) is not None:
            from mismatch_probe.engines.routed_experts import decode_sglang_int32_b64

            def decode(raw, what):
                return decode_sglang_int32_b64(raw, layout.num_hidden_layers, layout.top_k, what=what)

            completion.experts = routed_rows(layout, meta.get("routed_experts"), decode, request, completion, where)
        return completion

    def prefill_body(self, model, r) -> dict:
        return {
            "input_ids": [int(t) for t in r.token_ids],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            # SGLang's first returned position has no log-prob: start one before the first to score
            "logprob_start_len": int(r.start) - 1,
        }

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        from mismatch_probe.engines.sglang import finish_reason

        meta = answer.get("meta_info") or {}
        try:
            finish_reason(meta, where)
            entries = meta.get("input_token_logprobs")
            return self.prefill_reader.read(entries[1:] if entries else entries, request.token_ids[request.start :])
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None


def _pickled_bucket(bucket) -> str:
    """A bucket of named CPU tensors as SGLang's ``/update_weights_from_tensor`` takes one from
    another process: a plain pickle (each tensor's bytes inside it, through
    ``torch.storage._load_from_bytes``, which SGLang's ``SafeUnpickler`` maps to a
    ``weights_only`` load), base64-encoded. Not ``MultiprocessingSerializer``: it pickles shared
    memory handles, which a server on another machine (or without this process's authkey) cannot open."""
    import base64
    import pickle

    own = []
    for name, tensor in bucket:
        t = tensor.detach().contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view would carry its whole storage
        own.append((name, t))
    return base64.b64encode(pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
