"""The ``openai`` dialect: ``vllm serve`` (and any OpenAI-compatible server that returns token ids
and log-probs), ``POST /v1/completions``.

The prompt goes out as a list of token ids; the sampled ids come back in ``token_ids``
(``return_token_ids``) and as ``token_id:N`` in the log-prob entries (``return_tokens_as_token_ids``),
which must agree; the log-prob of each sampled token is ``token_logprobs``. The prefill re-score asks
for ``prompt_logprobs`` over prompt + response, each entry looked up by the token's id. The
server's settings are read back from ``/version``, ``/v1/models``, ``/metrics``'
``vllm:cache_config_info`` and, when started with ``VLLM_SERVER_DEV_MODE=1``, ``/server_info``.

Weight sync (ARCHITECTURE.md, Weight sync) through its development routes
(``VLLM_SERVER_DEV_MODE=1``): ``/collective_rpc`` with the worker's ``reload_weights(weights_path=...)``
(disk only: no route of vLLM 0.32 carries the tensors' bytes), ``/reset_prefix_cache``, ``/sleep`` +
``/wake_up``.
"""

from __future__ import annotations

import re

import numpy as np

from mismatch_probe.config.spec import SyncSpec
from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest, SyncSupport
from mismatch_probe.engines.http_client import server_message
from mismatch_probe.engines.remote.dialect import (
    SERVER_NCCL_GROUP,
    TOKENIZER_PROBE,
    Dialect,
    ServerInfo,
    Session,
    dtype_name,
    finish,
    first_choice,
    recognize_server,
    routed_rows,
)
from mismatch_probe.engines.vllm_args import CONFIG_SECTIONS, config_field
from mismatch_probe.errors import ConfigError, EngineError

# settings the in-process engines record under these names (the report's engine label reads them)
VLLM_SERVER_INFO = {
    # where the in-process engine reads each setting back (engines/vllm_args.py: config_field, from the
    # vLLM argument its declaration names), less the multi-node rendezvous a server does not report
    **{name: config_field(name) for name in CONFIG_SECTIONS if name not in ("nnodes", "node_rank")},
    # what only a server's config says
    "logprobs_mode": ("model_config", "logprobs_mode"),
    "served_model_name": ("model_config", "served_model_name"),
    "model": ("model_config", "model"),
    "async_scheduling": ("scheduler_config", "async_scheduling"),
    "compilation_mode": ("compilation_config", "mode"),
    "cudagraph_mode": ("compilation_config", "cudagraph_mode"),
    "attention_backend": ("attention_config", "backend"),
    "device": ("device_config", "device"),
    "return_routed_experts": ("aux_output_config", "enable_return_routed_experts"),
}
# what vLLM's /metrics exposes without dev mode (vllm:cache_config_info's labels)
VLLM_CACHE_LABELS = {
    "prefix_caching": "enable_prefix_caching",
    "kv_cache_dtype": "cache_dtype",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "block_size": "block_size",
}
# of vllm:cache_config_info's labels (one per CacheConfig field), those recorded as the server gives them
CACHE_LABELS_RECORDED = (
    *VLLM_CACHE_LABELS.values(),
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "sliding_window",
    "prefix_caching_hash_algo",
)
VLLM_ENV_RECORDED = ("VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND", "VLLM_USE_V2_MODEL_RUNNER")

LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

VLLM_TENSOR_REFUSAL = (
    "vllm serve has no route that takes the tensors' bytes: /update_weights "
    "(vllm/entrypoints/rl/online/api_router.py) drives a weight-transfer engine chosen at the server's start "
    "(--weight-transfer-config: nccl, ipc = CUDA IPC handles, sparse_nccl, nccl_m2n, sharded_rdt, modelexpress), "
    "each moving the bytes outside HTTP, and /collective_rpc (vllm/entrypoints/serve/dev/rpc/api_router.py) "
    "passes JSON arguments to a worker method, whose reload_weights takes tensors only as an in-process iterator"
)
VLLM_DEV_MODE_HINT = "restart vllm serve with VLLM_SERVER_DEV_MODE=1 in its environment (its development routes)"


class OpenAIDialect(Dialect):
    """``/v1/completions`` with vLLM's token-id extensions."""

    generate_path = "/v1/completions"
    routes_hint = VLLM_DEV_MODE_HINT
    routing_settings_hint = (
        "vllm serve tells only at /server_info, with VLLM_SERVER_DEV_MODE=1; restart it so, with "
        "--enable-return-routed-experts"
    )
    sync_server = "vllm serve"
    sync = SyncSupport(
        transfers=("disk",),
        nccl="/init_weight_transfer_engine + /update_weights with --weight-transfer-config",
        nccl_group=SERVER_NCCL_GROUP,
        refused={"tensor": VLLM_TENSOR_REFUSAL},
    )

    def seeds_off_because(self, server: ServerInfo) -> str | None:
        if server.software == "vllm" and server.settings.get("device") == "cpu":
            # as in process (engines/vllm.py): a seeded request split by chunked prefill kills the engine
            return (
                "the server is vLLM's CPU build, whose runner cannot rewind a seeded generator after a "
                "chunked-prefill discard ('CPU Generator does not use offset'); sampling uses the server's seed"
            )
        return None

    def sync_check(self, session: Session, server: ServerInfo, sync: SyncSpec) -> dict:
        if server.software != "vllm":
            raise ConfigError(
                f"the server at {session.where('')} is not vLLM (it has no /version), and mismatch-probe knows the "
                "weight-update routes of vllm serve and SGLang only",
                hint="sync through vllm serve (VLLM_SERVER_DEV_MODE=1) or an SGLang server (--engine-api sglang)",
            )
        # a development route that changes nothing: present exactly when the others are
        status = session.get("/is_sleeping")[0]
        if status != 200:
            raise ConfigError(
                f"vllm serve at {session.where('')} has no development routes (GET /is_sleeping: HTTP {status}), and a "
                "[sync] probe updates its weights through them (/collective_rpc reload_weights, /reset_prefix_cache)",
                hint=VLLM_DEV_MODE_HINT,
            )
        if sync.sleep_level:
            if server.settings.get("device") == "cpu":
                raise ConfigError(
                    "the server is vLLM's CPU build, whose worker has no sleep mode (vllm/v1/worker/cpu_worker.py: "
                    "CPUWorker.sleep logs 'sleep mode is not supported on CPU, ignore it.'), so the colocate cycle "
                    "(sync.sleep_level) cannot run there",
                    hint="drop --sync-sleep-level with a CPU server",
                )
            status, info = session.get("/server_info", params={"config_format": "json"})
            config = info.get("vllm_config") if status == 200 and isinstance(info, dict) else None
            model_config = (config.get("model_config") or {}) if isinstance(config, dict) else {}
            if not model_config.get("enable_sleep_mode"):
                raise ConfigError(
                    f"vllm serve at {session.where('')} runs without sleep mode, so /sleep cannot free its memory "
                    "(sync.sleep_level)",
                    hint="restart it with --enable-sleep-mode, or drop --sync-sleep-level",
                )
        return {"routes": "vLLM development routes (VLLM_SERVER_DEV_MODE=1)"}

    def sleep_cycle(self, session: Session, level: int) -> dict:
        slept = session.update("/sleep", None, "the sleep call (/sleep)", params={"level": level})
        woke = session.update("/wake_up", None, "the wake-up call (/wake_up)")
        return {
            "level": level,
            "calls": "POST /sleep?level=N, POST /wake_up (vllm/entrypoints/serve/dev/sleep/api_router.py)",
            "answers": [slept, woke],
        }

    def load_from_disk(self, session: Session, work_dir: str, sync: SyncSpec) -> dict:
        body = {"method": "reload_weights", "kwargs": {"weights_path": work_dir, "is_checkpoint_format": True}}
        answer = session.update("/collective_rpc", body, "the weight reload (/collective_rpc reload_weights)")
        return {
            "call": "POST /collective_rpc {method: reload_weights, kwargs: {weights_path, is_checkpoint_format: "
            "true}} (vllm/entrypoints/serve/dev/rpc/api_router.py: collective_rpc -> Worker.reload_weights, "
            "vLLM's in-place reload)",
            "engine_report": {
                "reloaded_from": "disk",
                "results": answer.get("results") if isinstance(answer, dict) else answer,
            },
        }

    def reset_prefix_cache(self, session: Session) -> dict:
        ok, answer = session.try_update("/reset_prefix_cache", None, "the prefix cache reset (/reset_prefix_cache)")
        return {
            "call": "POST /reset_prefix_cache (vllm/entrypoints/serve/dev/cache/api_router.py)",
            "result": bool(ok and isinstance(answer, dict) and answer.get("success")),
            **({} if ok else {"message": server_message(answer)}),
        }

    def read_server(self, session: Session, served_model: str | None) -> ServerInfo:
        status, models = session.get("/v1/models")
        if status != 200 or not isinstance(models, dict) or not isinstance(models.get("data"), list):
            if status == 404:
                recognize_server(session)  # another kind of rollout server: name the dialect it speaks
            raise ConfigError(
                f"{session.where('/v1/models')} answered HTTP {status}: not an OpenAI-compatible server",
                hint="check --engine-url; for SGLang's native API pass --engine-api sglang",
            )
        cards = {c.get("id"): c for c in models["data"] if isinstance(c, dict)}
        model = _choose_model(cards, served_model, session)
        card = cards[model]
        status, version = session.get("/version")
        is_vllm = status == 200 and isinstance(version, dict) and "version" in version
        info = ServerInfo(
            model=model,
            names={n for n in (model, card.get("root")) if n},
            software="vllm" if is_vllm else None,
            version=version.get("version") if is_vllm else None,
        )
        info.raw["model_card"] = {k: card.get(k) for k in ("id", "root", "parent", "owned_by", "max_model_len")}
        info.max_model_len = card.get("max_model_len")
        info.settings["max_model_len"] = info.max_model_len
        if is_vllm:
            self._vllm_settings(session, info)
        else:
            info.unknown["everything"] = "the server has no /version: not vLLM, so only its model card is read"
        status, tokens = session.post(
            "/tokenize", {"model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        )
        if status == 200 and isinstance(tokens, dict) and isinstance(tokens.get("tokens"), list):
            info.tokenizer_probe = [int(t) for t in tokens["tokens"]]
        else:
            info.unknown["tokenizer"] = "the server has no working /tokenize (started with --skip-tokenizer-init?)"
        return info

    def _vllm_settings(self, session: Session, info: ServerInfo) -> None:
        status, server_info = session.get("/server_info", params={"config_format": "json"})
        config = server_info.get("vllm_config") if status == 200 and isinstance(server_info, dict) else None
        if isinstance(config, dict):
            for name, (section, key) in VLLM_SERVER_INFO.items():
                value = (config.get(section) or {}).get(key)
                if value is not None:
                    info.settings[name] = value
            info.settings["dtype"] = dtype_name(info.settings.get("dtype"))
            env = server_info.get("vllm_env") or {}
            info.settings["batch_invariant"] = bool(env.get("VLLM_BATCH_INVARIANT", False))
            info.raw["vllm_env"] = {k: env[k] for k in VLLM_ENV_RECORDED if k in env}
            hf = (config.get("model_config") or {}).get("hf_config") or {}
            if isinstance(hf, dict) and hf.get("architectures"):
                info.architectures = list(hf["architectures"])
            for name in ("model", "served_model_name"):
                value = info.settings.get(name)
                info.names.update(value if isinstance(value, list) else [value] if value else [])
        else:
            why = "vLLM exposes it at /server_info only when started with VLLM_SERVER_DEV_MODE=1"
            for name in VLLM_SERVER_INFO:
                if name not in VLLM_CACHE_LABELS and name not in ("max_model_len", "model", "served_model_name"):
                    info.unknown[name] = why
            info.unknown["batch_invariant"] = why
        status, metrics = session.get("/metrics")
        labels = _prometheus_labels(metrics, "vllm:cache_config_info") if status == 200 else None
        if labels:
            info.raw["cache_config_info"] = {k: labels[k] for k in CACHE_LABELS_RECORDED if k in labels}
            for name, label in VLLM_CACHE_LABELS.items():
                if label in labels and name not in info.settings:
                    info.settings[name] = _label_value(labels[label])
        else:
            for name in VLLM_CACHE_LABELS:
                if name not in info.settings:
                    info.unknown[name] = (
                        "vLLM's /metrics has no vllm:cache_config_info (started with --disable-log-stats?)"
                    )

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        body = {
            "model": model,
            "prompt": [int(t) for t in r.prompt_token_ids],
            "max_tokens": int(r.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,  # the sampled token's own log-prob
            "stop_token_ids": [int(t) for t in stops],
            "skip_special_tokens": False,
            "add_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "n": 1,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        if self.routing is not None:  # from the last prompt position: the input behind the first sampled token
            body["routed_experts_prompt_start"] = len(r.prompt_token_ids) - 1
        return body

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        completion = self._completion(answer, request, where)
        if self.routing is not None:
            from mismatch_probe.engines.routed_experts import decode_vllm_npy_b64

            raw = first_choice(answer, where).get("routed_experts")
            completion.experts = routed_rows(self.routing, raw, decode_vllm_npy_b64, request, completion, where)
        return completion

    def _completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        choice = first_choice(answer, where)
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
            raise ConfigError(
                f"{where}: the answer has no log-probs (logprobs=0 was asked for)",
                hint="the server must return log-probs: vLLM does unless started with --max-logprobs 0",
            )
        ids_from_entries = [_token_id(t) for t in logprobs.get("tokens") or []]
        ids = choice.get("token_ids")
        if ids is None:
            if any(t is None for t in ids_from_entries):
                raise ConfigError(
                    f"{where}: the server returns sampled tokens as text, not ids; mismatch-probe never "
                    "re-tokenizes text (the ids would not be the ones sampled)",
                    hint="use a vLLM that honors return_token_ids (0.10.2 or later) or return_tokens_as_token_ids "
                    "(start it with --return-tokens-as-token-ids); other servers: use one that returns token ids",
                )
            ids = ids_from_entries
        tokens = np.asarray(ids, dtype=np.int32)
        values = logprobs["token_logprobs"]
        if len(values) != len(tokens):
            raise EngineError(f"{where}: {len(tokens)} sampled tokens but {len(values)} log-probs")
        # the entries name their tokens as ids only with return_tokens_as_token_ids; then they must agree
        if ids_from_entries and None not in ids_from_entries and ids_from_entries != [int(t) for t in tokens]:
            k = next(j for j, (a, b) in enumerate(zip(ids_from_entries, tokens)) if a != b)
            raise EngineError(f"{where}: log-prob entry {k} is for token {ids_from_entries[k]}, not {int(tokens[k])}")
        if any(v is None for v in values):
            raise EngineError(f"{where}: the server returned no log-prob for a sampled token")
        prompt = choice.get("prompt_token_ids")
        return Completion(
            token_ids=tokens,
            logprobs=np.asarray(values, dtype=np.float64).astype(np.float32),
            finish_reason=finish(choice.get("finish_reason"), where),
            prompt_token_ids=np.asarray(prompt, dtype=np.int32) if prompt is not None else None,
        )

    def prefill_body(self, model, r) -> dict:
        return {
            "model": model,
            "prompt": [int(t) for t in r.token_ids],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,  # the given token's own log-prob at each position, from the raw logits
            "add_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "n": 1,
            "stream": False,
        }

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        entries = first_choice(answer, where).get("prompt_logprobs")
        ids = request.token_ids
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = "none" if not isinstance(entries, list) else len(entries)
            raise EngineError(
                f"{where}: {got} prompt log-prob entries for {len(ids)} tokens",
                hint="the server must honor prompt_logprobs (vLLM does); or turn the re-score off with "
                "--no-prefill-check",
            )
        out = np.empty(len(ids) - request.start, np.float64)
        for k, p in enumerate(range(request.start, len(ids))):
            entry = entries[p] or {}
            hit = entry.get(str(int(ids[p])))
            if hit is None:
                raise EngineError(f"{where}: no prompt log-prob for token {int(ids[p])} at position {p}")
            out[k] = hit["logprob"] if isinstance(hit, dict) else hit
        return out.astype(np.float32)


def _choose_model(cards: dict, served_model: str | None, session: Session) -> str:
    if served_model is not None:
        if served_model not in cards:
            raise ConfigError(
                f"the server at {session.where('')} does not serve a model named {served_model!r}",
                hint=f"it serves: {', '.join(map(repr, sorted(cards)))} (engine.served_model)",
            )
        return served_model
    if len(cards) != 1:
        raise ConfigError(
            f"the server at {session.where('')} serves {len(cards)} models",
            hint=f"name one with --engine-model ({', '.join(map(repr, sorted(cards))) or 'none listed'})",
        )
    return next(iter(cards))


def _token_id(token: str) -> int | None:
    """``token_id:N`` (vLLM's return_tokens_as_token_ids) -> N; text -> None."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    return None


def _prometheus_labels(text, metric: str) -> dict[str, str] | None:
    """The labels of ``metric``'s first sample in Prometheus' text format."""
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body = line[len(metric) + 1 : line.rindex("}")]
            return {k: v.replace('\\"', '"') for k, v in LABEL.findall(body)}
    return None


def _label_value(value: str):
    """A Prometheus label's text as the value it stands for (``True``, ``0.92``, ``None``)."""
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
