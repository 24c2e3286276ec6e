"""The ``remote`` engine: a rollout server that is already running, reached over HTTP (``engine.url``).

The engine is the same for every server: the journal of answers received, the concurrency and
retries (``engines/http_client.py``), the checks of the spec against what the server says it runs,
the served model's check, the per-request seeds and the weight-sync sequence. What differs by server
is its dialect (``engine.api``; ``dialect.py``, one module per dialect, listed in
``config/remote_dialects.py``), which this module never names.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines.base import (
    Completion,
    EngineCapabilities,
    GenerationRequest,
    ScoreRequest,
    SyncSupport,
    batch_seed,
)
from mismatch_probe.engines.base import check_sync as check_sync_by
from mismatch_probe.engines.http_client import AUTH_HINT, Client, Journal, RequestFailed, api_key_from, redact_url
from mismatch_probe.engines.remote.dialect import (
    SERVER_NCCL_GROUP,
    TOKENIZER_PROBE,
    Dialect,
    RouteFailed,
    Session,
    dialect_class,
    dtype_name,
)
from mismatch_probe.errors import ConfigError, EngineError, ProbeError
from mismatch_probe.modeling.logprobs import LogprobSemantics

# what a server answers when it cannot read the checkpoint the probe wrote (a path it does not have
# is then taken for a Hugging Face repo id)
PATH_NOT_READ = re.compile(
    r"no such file|not found|does not exist|repo.?id|name or service not known|huggingface|hf_?hub|offline",
    re.IGNORECASE,
)


def check_spec(spec: EngineSpec) -> None:
    """What a remote engine needs before anything starts (``EngineEntry.check``)."""
    if not spec.url:
        raise ConfigError(
            "engine 'remote' needs the server's address",
            hint="pass --engine-url http://HOST:PORT (engine.url in the spec)",
        )
    parts = urlsplit(spec.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"engine.url {redact_url(spec.url)!r} is not an http(s) address",
            hint="give the server's base address, e.g. http://10.0.0.5:8000 (no /v1 path)",
        )
    if parts.path.rstrip("/").endswith("/v1"):
        raise ConfigError(
            f"engine.url {redact_url(spec.url)!r} ends in /v1",
            hint="give the server's base address without /v1; mismatch-probe adds each endpoint's path",
        )
    if spec.ca_bundle is not None and not Path(spec.ca_bundle).is_file():
        raise ConfigError(
            f"engine.ca_bundle {spec.ca_bundle!r} is not a file",
            hint="give the PEM file of the CA that signed the server's certificate",
        )


def check_sync(sync: SyncSpec, api: str) -> None:
    """What a remote server of dialect ``api`` cannot do of a [sync] table whatever it runs; raises
    :class:`ConfigError` before any request (what depends on the server is checked once it is read)."""
    dialect = dialect_class(api)
    check_sync_by(sync, dialect.capabilities(api), engine=dialect.sync_server, on_cpu=None)


class RemoteEngine:
    name = "remote"
    # what any server may offer (engines/base.py: EngineCapabilities): the worker gives it a directory for
    # the journal of answers received and a [sync] table; each instance narrows it to its dialect's
    capabilities = EngineCapabilities(
        keeps_state=True,
        sync=SyncSupport(transfers=("tensor", "disk"), nccl="its weight-transfer routes", nccl_group=SERVER_NCCL_GROUP),
    )

    def __init__(
        self,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        trust_remote_code: bool = False,
        state_dir: str | Path | None = None,
        sync: SyncSpec | None = None,
    ):
        check_spec(spec)
        self.sync = sync if sync is not None and sync.enabled else None
        if self.sync is not None:
            check_sync(self.sync, spec.api)
        self.sync_epoch = 0  # weight syncs so far: the journal's answers are per epoch
        self.spec = spec
        self.model_path = Path(model_path)
        self.trust_remote_code = trust_remote_code
        self.dialect: Dialect = dialect_class(spec.api)(self.model_path)
        self.capabilities = self.dialect.capabilities(spec.api)
        self.client = Client(
            url=spec.url,
            api_key=api_key_from(spec.api_key_env),
            timeout_s=spec.request_timeout_s,
            max_concurrency=spec.max_concurrency,
            max_retries=spec.max_retries,
            backoff_s=spec.retry_backoff_s,
            verify=spec.ca_bundle if spec.ca_bundle else spec.tls_verify,
            log=lambda msg: print(f"[remote] {msg}", file=sys.stderr, flush=True),
        )
        self.session = Session(self.client, routes_hint=self.dialect.routes_hint)
        self.journal = Journal(state_dir)
        if len(self.journal):
            self.client.log(f"{len(self.journal)} answers received before are reused ({self.journal.path})")
        self.server = self.dialect.read_server(self.session, spec.served_model)
        self.served_model = self.server.model
        self.model_check = check_served_model(self, spec.check_model)
        self.logprobs_source = self._check_declared()
        self.seeds_off_because = self.dialect.seeds_off_because(self.server)
        # what the server offers for the sync, read (GET only) before anything is changed
        self.sync_server = self.dialect.sync_check(self.session, self.server, self.sync) if self.sync else {}
        self.routing_unavailable = self._routing(spec) if spec.record_routing else None

    def _routing(self, spec: EngineSpec) -> str | None:
        """Ask the server for the routed experts of an MoE checkpoint when it returns them (the
        dialect then reads them with every answer); otherwise why not."""
        from mismatch_probe.engines.routed_experts import checkpoint_config, moe_layout

        layout = moe_layout(checkpoint_config(self.model_path, trust_remote_code=self.trust_remote_code))
        if layout is None:
            return None  # a dense model: nothing to record
        why = self.dialect.routing_unavailable(self.server, self.session)
        if why is None:
            self.dialect.routing = layout
        return why

    # ---- settings ------------------------------------------------------------------------
    def _check_declared(self) -> str:
        """The spec's dtype and logprobs_mode say what the server runs with: where the server
        tells, they must agree (the reference would otherwise match the wrong distribution)."""
        settings = self.server.settings
        dtype = dtype_name(settings.get("dtype"))
        if self.spec.dtype != "auto" and dtype not in (None, "auto") and dtype != self.spec.dtype:
            raise ConfigError(
                f"the server at {self.client.where('')} runs in {dtype}, but engine.dtype says {self.spec.dtype}",
                hint=f"set engine.dtype = {dtype!r} (or auto), or restart the server with the dtype you meant",
            )
        served_mode = settings.get("logprobs_mode")
        if served_mode is None:
            return "declared (engine.logprobs_mode; the server does not say what its log-probs are)"
        mode = {"raw_logprobs": "raw", "processed_logprobs": "processed"}.get(str(served_mode))
        if mode is None:
            raise ConfigError(
                f"the server returns {served_mode} (vLLM --logprobs-mode), which are not log-probabilities",
                hint="restart it with --logprobs-mode raw_logprobs or processed_logprobs",
            )
        if mode != self.spec.logprobs_mode:
            raise ConfigError(
                f"the server returns {served_mode}, but engine.logprobs_mode is {self.spec.logprobs_mode}",
                hint=f"pass --logprobs-mode {mode} (engine.logprobs_mode = {mode!r})",
            )
        return "read from the server"

    # ---- Engine protocol -----------------------------------------------------------------
    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        return self.capabilities.semantics(self.spec.logprobs_mode, sampling)

    def info(self) -> dict:
        s = self.server
        return {
            "engine": self.name,
            "api": self.spec.api,
            "url": redact_url(self.spec.url or ""),
            "served_model": self.served_model,
            "platform": s.settings.get("device") or "unknown",
            **{k: v for k, v in s.settings.items() if k not in ("model", "served_model_name")},
            "server": s.raw,
            "unknown": s.unknown,
            "model_check": self.model_check,
            "logprobs_mode": self.spec.logprobs_mode,
            "logprobs_mode_source": self.logprobs_source,
            "per_request_seeds": self._seeded() and self.dialect.honors_seeds(s),
            **({"per_request_seeds_off_because": self.seeds_off_because} if self.seeds_off_because else {}),
            "client": {
                "max_concurrency": self.client.max_concurrency,
                "request_timeout_s": self.client.timeout_s,
                "max_retries": self.client.max_retries,
                "retry_backoff_s": self.client.backoff_s,
                "tls_verify": bool(self.client.verify),
                "ca_bundle": self.spec.ca_bundle,
                "api_key": "from $" + self.spec.api_key_env if self.spec.api_key_env else None,
            },
            "routing": self.dialect.routing.describe() if self.dialect.routing is not None else None,
            **({"routing_unavailable": self.routing_unavailable} if self.routing_unavailable else {}),
            "versions": {s.software: s.version} if s.software and s.version else {},
            "workarounds": self.dialect.workarounds(),
            **({"renders_prompts": self.dialect.renders_prompts} if self.dialect.renders_prompts else {}),
        }

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        seeds = [batch_seed(seed, i) % (2**31) if self._seeded() else None for i in range(len(requests))]
        bodies = [
            self.dialect.generate_body(self.served_model, r, sampling, stop_token_ids, s)
            for r, s in zip(requests, seeds)
        ]
        completions: list[Completion | None] = [None] * len(requests)

        def parse(i: int, answer: dict) -> None:
            completions[i] = self.dialect.completion(
                answer, requests[i], self._where(f"sampling request {i + 1} of {len(requests)}")
            )
            if on_progress is not None:
                on_progress(1)

        self._post(self.dialect.generate_path, bodies, "sampling request", parse)
        return completions  # type: ignore[return-value]

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        limit = self.server.max_model_len or 0
        # a sequence the server cannot prefill (as long as its context) stays NaN, as in process
        result = [np.full(len(r.token_ids) - r.start, np.nan, np.float32) for r in requests]
        todo = [i for i, r in enumerate(requests) if not limit or len(r.token_ids) < limit]
        if on_progress is not None and len(todo) < len(requests):
            on_progress(len(requests) - len(todo))
        bodies = [self.dialect.prefill_body(self.served_model, requests[i]) for i in todo]

        def parse(k: int, answer: dict) -> None:
            i = todo[k]
            result[i] = self.dialect.prefill(
                answer, requests[i], self._where(f"prefill request {i + 1} of {len(requests)}")
            )
            if on_progress is not None:
                on_progress(1)

        self._post(self.dialect.generate_path, bodies, "prefill request", parse)
        return result

    def close(self) -> None:
        self.journal.close()

    # ---- weight sync (ARCHITECTURE.md, Weight sync) ---------------------------------------
    def sync_weights(self, weights_dir: str, work_dir: str, fault: str | None = None) -> dict:
        """Push the checkpoint in ``weights_dir`` into the running server through its own HTTP
        routes, as an RL trainer that drives a rollout server does after an optimizer step: the
        colocate cycle when set, then the weights (disk: a checkpoint written to ``work_dir``, which
        the server reads; tensor: buckets over HTTP, SGLang only), then the prefix cache's reset
        when set. The server's answers are in ``engine_report``. No ``weight_digest``: a server's
        parameters cannot be read from outside it."""
        from mismatch_probe.engines import weight_sync as ws

        sync = self._sync_table()
        if fault == "untie_lm_head":
            raise ConfigError(
                "the untie_lm_head fault acts inside the engine (the probe's own loader unties the LM head), "
                "which a remote server does not run",
                hint="test it with the in-process engines; through a server: "
                + ", ".join(f for f in ws.FAULTS if f != "untie_lm_head"),
            )
        # from here on the server's weights are not those the journal's answers were given with
        self.sync_epoch += 1
        report: dict = {"transfer": sync.transfer, "dtype_sent": sync.dtype, "fault": fault}
        t0 = time.perf_counter()
        if sync.sleep_level:
            report["sleep"] = self.dialect.sleep_cycle(self.session, sync.sleep_level)
        named = ws.trainer_tensors(weights_dir, sync.dtype, fault)
        if sync.transfer == "disk":
            written = ws.write_checkpoint(named, work_dir, weights_dir)
            try:
                pushed = self.dialect.load_from_disk(self.session, str(work_dir), sync)
            except RouteFailed as exc:
                raise self._unread_path(exc, str(work_dir)) from None
            report.update(buckets=1, **written, **pushed)
        else:  # tensor (check_sync refused it where the dialect cannot take it)
            report.update(self.dialect.load_tensors(self.session, named, sync, self.sync_server))
        if "reset_prefix_cache" not in report:  # not done by the server itself
            report["reset_prefix_cache"] = self.reset_prefix_cache() if sync.reset_prefix_cache else None
        report["seconds"] = round(time.perf_counter() - t0, 3)
        return report

    def reset_prefix_cache(self) -> dict:
        """The server's prefix cache reset through its route (SGLang ``/flush_cache``, vLLM
        ``/reset_prefix_cache``); its answer."""
        return self.dialect.reset_prefix_cache(self.session)

    def _sync_table(self) -> SyncSpec:
        if self.sync is None:
            raise ConfigError("this engine was started without a [sync] table", hint="set sync.start_from")
        return self.sync

    def _unread_path(self, exc: RouteFailed, work_dir: str) -> ProbeError:
        """A refused disk update, named for what it most often is: a path the server cannot read."""
        import socket

        where = f"{work_dir} (written on {socket.gethostname()})"
        if PATH_NOT_READ.search(exc.message):
            return ConfigError(
                f"the server cannot read the checkpoint the probe wrote at {where}; {exc.message}",
                hint="the server must reach that path: run the probe on the server's machine, or put the run "
                "directory on a file system the server mounts at the same path (or use --sync-transfer tensor "
                "with SGLang, whose bytes travel over HTTP)",
            )
        return EngineError(f"{exc.message} (the checkpoint it was given: {where})", hint="see the server's log")

    # ---- plumbing ------------------------------------------------------------------------
    def _seeded(self) -> bool:
        return self.spec.seed_requests and self.seeds_off_because is None

    def _where(self, what: str) -> str:
        return f"{what} to {self.client.where(self.dialect.generate_path)}"

    def _post(self, path: str, bodies: list[dict], what: str, parse: Callable[[int, dict], None]) -> None:
        journal = self.journal if self.sync_epoch == 0 else _EpochJournal(self.journal, self.sync_epoch)
        try:
            self.client.post_all(
                path, bodies, what=lambda i: f"{what} {i + 1} of {len(bodies)}", journal=journal, on_answer=parse
            )
        except RequestFailed as exc:
            kept = f"; the {len(self.journal)} answers received are kept" if self.journal.path else ""
            message = f"the server at {self.client.where(path)}: {exc}{kept}"
            if exc.status in (401, 403):
                raise ConfigError(message, hint=AUTH_HINT) from None
            raise EngineError(
                message,
                hint="re-run the same command once the server is back: it resumes, sending only what is missing",
            ) from None


class _EpochJournal:
    """The journal as seen after the ``epoch``-th weight sync: the same request asks again (an
    answer given with other weights is not an answer now), and a re-run that syncs the same way
    finds the answers of each epoch again."""

    def __init__(self, journal: Journal, epoch: int):
        self.journal = journal
        self.epoch = epoch

    def _key(self, key: str) -> str:
        return hashlib.sha256(f"sync-epoch-{self.epoch}:{key}".encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.journal.get(self._key(key))

    def put(self, key: str, answer: dict) -> None:
        self.journal.put(self._key(key), answer)


# settings of a server that change what it samples, as info() records them
SAMPLING_SETTINGS = (
    "dtype",
    "world_size",
    "engine_type",
    "logprobs_mode",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enforce_eager",
    "compilation_mode",
    "cudagraph_mode",
    "chunked_prefill",
    "prefix_caching",
    "kv_cache_dtype",
    "quantization",
    "attention_backend",
    "sampling_backend",
    "batch_invariant",
    "rl_on_policy_target",
    "logits_fp32",
    "device",
)


def server_changes(before: dict, after: dict) -> list[str]:
    """What a remote server runs differently now (``after``, an ``info()``) than when ``before``
    was recorded: its software, version or a setting both records know. Not a remote engine on
    both sides: nothing to compare (an in-process engine is built from the spec, which resumes only
    unchanged)."""
    if before.get("engine") != "remote" or after.get("engine") != "remote":
        return []
    changes = [
        f"{name} {(after.get('versions') or {}).get(name, 'absent')} (was {version})"
        for name, version in (before.get("versions") or {}).items()
        if (after.get("versions") or {}).get(name) != version
    ]
    for key in SAMPLING_SETTINGS:
        if key in before and key in after and before[key] != after[key]:
            changes.append(f"{key}={after[key]!r} (was {before[key]!r})")
    return changes


# ---- the served model -----------------------------------------------------------------------
def check_served_model(engine: RemoteEngine, enforce: bool) -> dict:
    """Is the server's model the checkpoint the reference loads? Compared where both sides say:
    names (the checkpoint directory's, its config's ``_name_or_path``; the server's model ids and
    paths, by their last path component), architectures, and the server's tokenizer on
    :data:`TOKENIZER_PROBE`. A difference is refused unless ``enforce`` is off (then recorded)."""
    from mismatch_probe.modeling.loading import read_config

    server, local = engine.server, engine.model_path
    config = read_config(local)
    ours = {local.resolve().name, _basename(config.get("_name_or_path") or "")} - {""}
    theirs = {_basename(n) for n in server.names} - {""}
    checks: dict = {"checkpoint_names": sorted(ours), "server_names": sorted(theirs)}
    differences = []
    if theirs:
        checks["names"] = bool(ours & theirs)
        if not checks["names"]:
            differences.append(f"it serves {', '.join(sorted(theirs))}")
    if server.architectures and config.get("architectures"):
        checks["architectures"] = list(server.architectures) == list(config["architectures"])
        if not checks["architectures"]:
            differences.append(f"architectures {server.architectures} vs the checkpoint's {config['architectures']}")
    if server.tokenizer_probe is not None:
        from mismatch_probe.modeling.loading import load_tokenizer

        tokenizer = load_tokenizer(local, trust_remote_code=engine.trust_remote_code)
        mine = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        checks["tokenizer"] = list(mine) == server.tokenizer_probe
        if not checks["tokenizer"]:
            differences.append("its tokenizer splits a probe text into other ids")
    checks["matched"] = not differences
    if differences and enforce:
        raise ConfigError(
            f"the server at {engine.client.where('')} does not serve the checkpoint the reference loads "
            f"({local.name}): {'; '.join(differences)}",
            hint="point --model at the checkpoint the server loaded; if it is the same weights under another "
            "name, pass --no-check-model (engine.check_model = false)",
        )
    if differences:
        checks["overridden"] = "engine.check_model = false"
    return checks


def _basename(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]
