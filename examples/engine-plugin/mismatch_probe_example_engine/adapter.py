"""A minimal engine adapter: what an in-house engine implements to be probed.

It samples one request at a time with a full forward over the sequence so far for every token (no
KV cache: slow, and simple), and returns, for each sampled token, its log-prob under the
distribution ``semantics`` names (raw: log_softmax of the logits; processed: after temperature,
top-k and top-p). Its ``capabilities`` declare what it can do beyond that: nothing optional, so it
leaves out ``prefill_logprobs`` (decode vs its own prefill is then reported as not measured); MoE
routing (``Completion.experts``) it leaves out too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from mismatch_probe.config.spec import EngineSpec, SamplingSpec
from mismatch_probe.engines.base import Completion, EngineCapabilities, GenerationRequest, batch_seed
from mismatch_probe.modeling.logprobs import LogprobSemantics, engine_semantics, logprobs_under


class ExampleEngine:
    name = "example-hf"
    # what it can do beyond sampling: nothing optional (no prefill_logprobs, no weight sync); its
    # log-probs are raw unless engine.logprobs_mode says otherwise
    capabilities = EngineCapabilities()

    def __init__(self, model_path: str | Path, spec: EngineSpec, *, trust_remote_code: bool = False):
        self.spec = spec
        self.device = (
            "cuda" if spec.device == "auto" and torch.cuda.is_available() else spec.device.replace("auto", "cpu")
        )
        dtype = "auto" if spec.dtype == "auto" else getattr(torch, spec.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, trust_remote_code=trust_remote_code
        ).to(self.device)
        self.model.eval()

    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        return engine_semantics(self.spec.logprobs_mode or "raw", sampling.temperature, sampling.top_k, sampling.top_p)

    def info(self) -> dict:
        import transformers

        return {
            "engine": self.name,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": self.device,
            "logprobs_mode": self.spec.logprobs_mode or "raw",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        sample_from = engine_semantics("processed", sampling.temperature, sampling.top_k, sampling.top_p)
        returned = self.semantics(sampling)
        out = []
        for i, request in enumerate(requests):
            generator = torch.Generator(self.device).manual_seed(batch_seed(seed, i))  # repeatable per request
            ids = torch.as_tensor(request.prompt_token_ids, dtype=torch.long, device=self.device)[None]
            tokens, logprobs, reason = [], [], "length"
            for _ in range(request.max_tokens):
                logits = self.model(ids).logits[0, -1].float()
                if sampling.temperature > 0:
                    token = torch.multinomial(logprobs_under(logits, sample_from).exp(), 1, generator=generator)
                else:
                    token = logits.argmax()[None]
                tokens.append(int(token))
                logprobs.append(float(logprobs_under(logits, returned)[token]))
                ids = torch.cat([ids, token[None]], dim=1)
                if tokens[-1] in stop_token_ids:
                    reason = "stop"
                    break
            out.append(
                Completion(np.array(tokens, np.int32), np.array(logprobs, np.float32), reason, request.prompt_token_ids)
            )
            if on_progress:
                on_progress(1)
        return out

    def close(self) -> None:
        self.model = None
