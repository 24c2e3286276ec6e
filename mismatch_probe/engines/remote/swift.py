"""The ``swift`` dialect: ms-swift's ``swift rollout`` (``POST /infer/``), chat messages in.

It takes chat messages, as ms-swift's GRPO trainer sends them; the server renders them with its own
template and answers with the prompt ids it rendered, which are checked against ours
(``rollout/multiturn.py: ServerTemplateCheck``: a difference is a finding, and the probe scores what
the server saw), the sampled ids and their processed log-probs. No prefill re-score and no weight
sync (its updates travel by NCCL). ms-swift 4.5 / 4.6 (swift/pipelines/infer/rollout.py:
SwiftRolloutDeploy, WeightSyncWorkerExtension).
"""

from __future__ import annotations

import numpy as np

from mismatch_probe.engines.base import Completion, GenerationRequest
from mismatch_probe.engines.remote.dialect import Dialect, ServerInfo, Session, finish, first_choice
from mismatch_probe.errors import ConfigError, EngineError

SWIFT_SYNC_REFUSAL = (
    "its weight-update routes (/update_flattened_params/, /update_named_param/) only announce tensors that "
    "then arrive by an NCCL broadcast from a trainer rank in the server's process group (/init_communicator/ "
    "-> PyNcclCommunicator), which mismatch-probe does not drive (and which needs a GPU on both sides)"
)
SWIFT_SYNC_HINT = "probe the sync through vllm serve or an SGLang server started with the same settings"
SWIFT_MULTI_TURN_REFUSAL = (
    "it runs its own multi-turn scheduler (--multi_turn_scheduler / gym), whose environment turns come back as "
    "messages without their token ids (RolloutOutput.messages), so the sequence it sampled cannot be scored"
)


class SwiftDialect(Dialect):
    """ms-swift's rollout server (``swift rollout``, its external GRPO mode), as its GRPO trainer
    calls it (ms-swift 4.5 / 4.6: ``swift/rlhf_trainers/vllm_client.py: VLLMClient.infer``,
    ``swift/rlhf_trainers/rollout_mixin.py``): ``POST /infer/`` with ``{infer_requests:
    [RolloutInferRequest], request_config: RequestConfig}``, one ``RolloutOutput`` per request.
    The server renders the chat messages with its own template (``--template_backend``) and
    returns the prompt ids it fed vLLM (``response.prompt_token_ids``, with ``return_details``),
    the sampled ids (``choices[0].token_ids``) and their log-probs (``choices[0].logprobs.content
    [i].logprob``, vLLM's processed log-probs: the server forces ``logprobs_mode=processed_logprobs``).
    What it exposes of itself: ``/health/``, ``/get_world_size/`` (tensor x data parallel) and
    ``POST /get_engine_type/``; every other setting is in its log only."""

    generate_path = "/infer/"
    renders_prompts = "swift rollout"
    prefill_unavailable = (
        "swift rollout takes chat messages and renders them itself, so it cannot be asked to prefill exactly "
        "the sampled token ids (its prompt_logprobs would score its own rendering of the conversation)"
    )
    routes_hint = SWIFT_SYNC_HINT
    sync_server = "swift rollout"
    sync_unavailable = SWIFT_SYNC_REFUSAL
    sync_hint = SWIFT_SYNC_HINT

    @classmethod
    def recognize(cls, session: Session) -> ConfigError | None:
        # both ms-swift's `swift rollout` and an older TRL `trl vllm-serve` answer /get_world_size/;
        # only ms-swift's has POST /get_engine_type/ (swift/pipelines/infer/rollout.py)
        if session.get("/get_world_size/")[0] == 200 and session.post("/get_engine_type/", None)[0] == 200:
            return ConfigError(
                f"{session.where('')} is ms-swift's `swift rollout` server: it takes chat messages (it "
                "applies the chat template itself), not the OpenAI API",
                hint="pass --engine-api swift",
            )
        return None

    def routing_unavailable(self, server: ServerInfo, session: Session) -> str | None:
        return (
            "not read from swift rollout: its answers carry routed experts (choices[i].routed_experts) only when "
            "its vLLM was started with enable_return_routed_experts (--vllm_engine_kwargs), which it does not "
            "expose, and always from the first prompt position"
        )

    def read_server(self, session: Session, served_model: str | None) -> ServerInfo:
        status, world = session.get("/get_world_size/")
        if status != 200 or not isinstance(world, dict) or "world_size" not in world:
            raise ConfigError(
                f"{session.where('/get_world_size/')} answered HTTP {status}: not ms-swift's swift rollout server",
                hint="check --engine-url; for vllm serve pass --engine-api openai, for SGLang --engine-api sglang",
            )
        status, engine_type = session.post("/get_engine_type/", None)
        if status != 200 or not isinstance(engine_type, dict):
            raise ConfigError(
                f"{session.where('/get_engine_type/')} answered HTTP {status}; ms-swift 3.5 or later answers it",
                hint="upgrade ms-swift on the server (pip install -U ms-swift)",
            )
        if engine_type.get("enable_multi_turn") or engine_type.get("use_gym_env"):
            raise ConfigError(
                f"the swift rollout server at {session.where('')}: {SWIFT_MULTI_TURN_REFUSAL}",
                hint="restart swift rollout without --multi_turn_scheduler / --use_gym_env; mismatch-probe then "
                "drives the turns itself, one /infer/ call per turn, as ms-swift's trainer does with such a server",
            )
        info = ServerInfo(model=served_model or "", names=set(), software="ms-swift", version=None)
        info.raw["get_world_size"] = world
        info.raw["get_engine_type"] = engine_type
        info.settings["world_size"] = int(world["world_size"])
        info.settings["engine_type"] = engine_type.get("engine_type")
        info.settings["lora"] = bool(engine_type.get("enable_lora"))
        why = (
            "swift rollout exposes only its world size (tensor x data parallel) and engine type; its arguments "
            "(--vllm_*, --torch_dtype, --template, ...) are printed in its log ('args: ...')"
        )
        for name in (
            "dtype",
            "max_model_len",
            "tensor_parallel_size",
            "data_parallel_size",
            "enforce_eager",
            "prefix_caching",
            "version",
            "template",
        ):
            info.unknown[name] = why
        info.unknown["logprobs_mode"] = (
            "not exposed; ms-swift forces vLLM's processed_logprobs (swift/pipelines/infer/rollout.py: "
            "get_infer_engine, vLLM >= 0.10.2), which engine.logprobs_mode defaults to for swift"
        )
        info.unknown["model"] = (
            "swift rollout names no model before it answers (response.model); its prompt ids are checked"
        )
        return info

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        if r.messages is None:
            raise ConfigError(
                "swift rollout takes chat messages, but this request has token ids only",
                hint='give the prompts as "messages" in the prompts file',
            )
        # RolloutInferRequest and RequestConfig (swift/infer_engine/protocol.py) as the GRPO trainer
        # fills them (swift/rlhf_trainers/rollout_mixin.py: _prepare_request_config); unset fields
        # take their defaults
        return {
            "infer_requests": [{"messages": r.messages}],
            "request_config": {
                "max_tokens": int(r.max_tokens),
                "temperature": sampling.temperature,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "top_p": sampling.top_p,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "seed": seed,
                "stream": False,
                "logprobs": True,
                "n": 1,
                "return_details": True,  # the sampled ids and the prompt ids the server rendered
            },
        }

    def completion(self, answer, request: GenerationRequest, where: str) -> Completion:
        outputs = answer if isinstance(answer, list) else None
        if not outputs or len(outputs) != 1 or not isinstance(outputs[0], dict):
            raise EngineError(f"{where}: expected a list of one RolloutOutput, got {str(answer)[:200]}")
        output = outputs[0]
        if output.get("response_token_ids") or output.get("rollout_logprobs"):
            raise EngineError(f"{where}: the server ran several turns itself ({SWIFT_MULTI_TURN_REFUSAL})")
        response = output.get("response") if isinstance(output.get("response"), dict) else output
        choice = first_choice(response, where)
        ids, prompt = choice.get("token_ids"), response.get("prompt_token_ids")
        if ids is None or prompt is None:
            raise ConfigError(
                f"{where}: the answer has no token_ids / prompt_token_ids (request_config.return_details = true "
                "was sent)",
                hint="use ms-swift 3.5 or later on the server, whose rollout answers carry them",
            )
        entries = (choice.get("logprobs") or {}).get("content")
        if not isinstance(entries, list):
            raise EngineError(f"{where}: the answer has no log-probs (request_config.logprobs = true was sent)")
        if len(entries) != len(ids):
            raise EngineError(f"{where}: {len(ids)} sampled tokens but {len(entries)} log-probs")
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        if any(v is None for v in values):
            raise EngineError(f"{where}: the server returned no log-prob for a sampled token")
        return Completion(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(values, dtype=np.float64).astype(np.float32),
            finish_reason=finish(choice.get("finish_reason"), where),
            prompt_token_ids=np.asarray(prompt, dtype=np.int32),
        )
