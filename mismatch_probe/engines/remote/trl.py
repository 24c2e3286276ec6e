"""The ``trl`` dialect: TRL's ``trl vllm-serve``, as TRL's trainers call it (TRL 1.16).

``trl vllm-serve`` runs vLLM's own server with what TRL's trainers need of it
(trl/scripts/vllm_serve.py: build_command, main): ``VLLM_SERVER_DEV_MODE=1`` (the development
routes its weight updates use), ``--logprobs-mode processed_logprobs``, ``--max-logprobs -1``,
``--weight-transfer-config '{"backend": "nccl"}'`` and, with vLLM 0.30 or later,
``--enable-scale-out``. Its client (trl/generation/vllm_client.py: VLLMClient) samples through
``POST /v1/completions`` with the prompts' token ids, ``return_token_ids``,
``return_tokens_as_token_ids`` and ``logprobs: 0`` (``generate``), and re-scores given sequences with
``prompt_logprobs`` (``get_sequence_logprobs``): the openai dialect's codec, which this one keeps.

Its own: what it reads back (the settings TRL imposes, from ``/server_info``, which a server
without dev mode does not have, and ``/get_world_size``, as ``VLLMClient.get_world_size`` does),
processed log-probs when nobody says otherwise (``config/remote_dialects.py``), and no ``[sync]``:
TRL's trainers push weights over NCCL (``VLLMClient.init_communicator``, ``update_named_params``).
"""

from __future__ import annotations

from mismatch_probe.engines.remote.dialect import ServerInfo, Session
from mismatch_probe.engines.remote.openai import OpenAIDialect
from mismatch_probe.errors import ConfigError

TRL_SYNC_REFUSAL = (
    "TRL's trainers push weights through vLLM's NCCL weight-transfer engine (trl/generation/vllm_client.py: "
    "init_communicator -> /init_weight_transfer_engine, then /start_weight_update, /update_weights, "
    "/finish_weight_update): the tensors travel by an NCCL broadcast from a trainer rank on a CUDA device that "
    "joins the server's group, which mismatch-probe does not drive"
)
TRL_SYNC_HINT = (
    "to probe vLLM's own reload from disk on the same server instead (not the path TRL's trainers take), "
    "pass --engine-api openai --sync-transfer disk"
)
NOT_TRL = "start the server with trl vllm-serve, or pass --engine-api openai for a plain vllm serve"


class TRLDialect(OpenAIDialect):
    """``trl vllm-serve``: vllm serve's ``/v1/completions``, with TRL's settings read back and its
    weight sync declared unsupported."""

    sync_server = "trl vllm-serve"
    sync_unavailable = TRL_SYNC_REFUSAL
    sync_hint = TRL_SYNC_HINT

    @classmethod
    def recognize(cls, session: Session) -> ConfigError | None:
        # TRL's servers before it ran vllm serve had their own /generate/ and /get_world_size/ routes
        # (ms-swift's answers them too, and POST /get_engine_type/ besides: swift.py)
        if session.get("/get_world_size/")[0] == 200 and session.post("/get_engine_type/", None)[0] != 200:
            return ConfigError(
                f"{session.where('')} answers /get_world_size/ but has no /v1/models: an older version of TRL's `trl vllm-serve` "
                "(its own /generate/ route, not the OpenAI API), which mismatch-probe has no dialect for",
                hint="upgrade TRL on the server (TRL 1.16's trl vllm-serve runs vllm serve: pass --engine-api trl), "
                "or probe its engine as `vllm serve` started with the same flags (docs/frameworks/trl.md)",
            )
        return None

    def read_server(self, session: Session, served_model: str | None) -> ServerInfo:
        info = super().read_server(session, served_model)
        status, server_info = session.get("/server_info", params={"config_format": "json"})
        config = server_info.get("vllm_config") if status == 200 and isinstance(server_info, dict) else None
        if info.software != "vllm" or not isinstance(config, dict):
            raise ConfigError(
                f"the server at {session.where('')} is not vLLM in development mode (no /version or /server_info), "
                "which trl vllm-serve always runs (it sets VLLM_SERVER_DEV_MODE=1)",
                hint=NOT_TRL,
            )
        model_config = config.get("model_config") or {}
        transfer = config.get("weight_transfer_config")
        # the settings trl vllm-serve imposes (build_command), as the server runs them
        info.raw["trl"] = {
            "logprobs_mode": model_config.get("logprobs_mode"),
            "max_logprobs": model_config.get("max_logprobs"),
            "weight_transfer_config": transfer,
        }
        info.settings["weight_transfer_backend"] = transfer.get("backend") if isinstance(transfer, dict) else None
        status, world = session.get("/get_world_size")
        if status == 200 and isinstance(world, dict) and "world_size" in world:
            info.raw["get_world_size"] = world
            info.settings["world_size"] = int(world["world_size"])
        else:
            info.unknown["world_size"] = f"GET /get_world_size answered HTTP {status} (a vLLM development route)"
        info.unknown["trl_version"] = "trl vllm-serve runs vllm serve, which does not say which TRL started it"
        return info
