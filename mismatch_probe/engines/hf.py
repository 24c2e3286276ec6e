"""The ``hf`` engine: Hugging Face transformers sampling with a KV cache.

The decode loop is written out rather than delegated to ``model.generate`` so that the sampled
distribution and the log-prob returned for each token are exactly the ones documented in
:mod:`mismatch_probe.modeling.logprobs` (raw: log_softmax of the fp32-cast logits; processed: of the
temperature/top-k/top-p transformed logits), with O(batch x vocab) memory instead of
``output_scores``' O(steps x batch x vocab). Numerically it is the same path ``generate`` takes:
left-padded prefill with the model's own dtype and attention implementation, then one-token
decode steps against a ``DynamicCache``, logits cast to float32 before sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, default_logprobs_mode
from mismatch_probe.engines.base import Completion, EngineCapabilities, GenerationRequest, ScoreRequest, batch_seed
from mismatch_probe.environment import cuda_numerics
from mismatch_probe.modeling.loading import (
    choose_attention,
    free_accelerator_memory,
    load_causal_lm,
    resolve_device,
    resolve_dtype,
)
from mismatch_probe.modeling.logprobs import LogprobSemantics, processed_logits
from mismatch_probe.modeling.routing import RouterRecorder

DEFAULT_BATCH_SIZE = 32
# its prefill re-scores with the same forward; no weight-update path
CAPABILITIES = EngineCapabilities(prefill=True, logprobs_mode=default_logprobs_mode("hf"))


class HFEngine:
    name = "hf"
    capabilities = CAPABILITIES

    def __init__(self, model_path: str | Path, spec: EngineSpec, *, trust_remote_code: bool = False):
        from transformers import DynamicCache  # noqa: F401  (fail early if the API moved)

        self.model_path = Path(model_path)
        self.spec = (
            spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": CAPABILITIES.logprobs_mode})
        )
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.model_path)
        self.batch_size = spec.batch_size or DEFAULT_BATCH_SIZE
        self.attention = choose_attention(
            self.model_path, spec.attn_implementation, trust_remote_code=trust_remote_code
        )
        self.model = load_causal_lm(
            self.model_path,
            dtype=self.dtype,
            attn_implementation=self.attention.used,
            device=self.device,
            trust_remote_code=trust_remote_code,
        )
        self.pad_id = 0
        self.routing = RouterRecorder(self.model) if spec.record_routing else None
        if self.routing is not None and not self.routing.active:
            self.routing = None  # a dense model

    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        return self.capabilities.semantics(self.spec.logprobs_mode, sampling)

    def info(self) -> dict:
        import transformers

        return {
            "engine": self.name,
            "dtype": self.dtype,
            **self.attention.record(),
            "batch_size": self.batch_size,
            "device": self.device,
            "logprobs_mode": self.spec.logprobs_mode,
            "kv_cache": "transformers.DynamicCache",
            "routing": self.routing.describe(self.model) if self.routing is not None else None,
            **cuda_numerics(self.device),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
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
        out: list[Completion] = []
        bs = self.batch_size
        stops = torch.tensor(sorted(set(stop_token_ids)), device=self.device)
        for b, start in enumerate(range(0, len(requests), bs)):
            batch = requests[start : start + bs]
            gen = torch.Generator(device=self.device).manual_seed(batch_seed(seed, b))
            out.extend(self._generate_batch(batch, sampling, stops, gen))
            if on_progress:
                on_progress(len(batch))
        return out

    def _generate_batch(
        self, batch: Sequence[GenerationRequest], sampling: SamplingSpec, stops: torch.Tensor, gen: torch.Generator
    ) -> list[Completion]:
        if self.routing is None:
            return self._decode(batch, sampling, stops, gen, None)
        with self.routing:
            return self._decode(batch, sampling, stops, gen, self.routing)

    @torch.inference_mode()
    def _decode(
        self,
        batch: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        stops: torch.Tensor,
        gen: torch.Generator,
        routing: RouterRecorder | None,
    ) -> list[Completion]:
        from transformers import DynamicCache

        dev = self.device
        n = len(batch)
        lengths = [len(r.prompt_token_ids) for r in batch]
        width = max(lengths)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding, as generate() does for decoder-only models
            input_ids[i, width - lengths[i] :] = torch.from_numpy(r.prompt_token_ids.astype(np.int64))
            attention_mask[i, width - lengths[i] :] = 1
        input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        limits = torch.tensor([r.max_tokens for r in batch], device=dev)
        steps = int(limits.max())

        semantics = self.semantics(sampling)
        greedy = sampling.temperature == 0
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        next_pos = position_ids[:, -1] + 1
        experts = None
        if routing is not None:  # routing of the input that produced each step's logits
            first = routing.take().view(n, width, len(routing.layers), -1)[:, -1]
            experts = torch.zeros((n, steps, *first.shape[1:]), dtype=torch.int16, device=first.device)
            experts[:, 0] = first

        tokens = torch.full((n, steps), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((n, steps), dtype=torch.float32, device=dev)
        n_generated = torch.zeros(n, dtype=torch.long, device=dev)
        stopped = torch.zeros(n, dtype=torch.bool, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        for step in range(steps):
            logits32 = logits.float()
            if greedy:
                token = logits32.argmax(dim=-1)
                scored = logits32
            else:
                sampled_from = processed_logits(logits32, sampling.temperature, sampling.top_k, sampling.top_p)
                token = torch.multinomial(sampled_from.softmax(-1), 1, generator=gen).squeeze(1)
                scored = sampled_from if semantics.transforms_logits else logits32
            # The log-prob is looked up by the sampled id in the full distribution.
            logp = torch.log_softmax(scored, dim=-1).gather(-1, token[:, None]).squeeze(1)
            active = ~done
            tokens[:, step] = torch.where(active, token, self.pad_id)
            logps[:, step] = logp
            n_generated += active.long()
            hit_stop = active & torch.isin(token, stops)
            stopped |= hit_stop
            done |= hit_stop | (n_generated >= limits)
            if bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones((n, 1), dtype=attention_mask.dtype, device=dev)], 1)
            logits = self.model(
                input_ids=token[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
            if experts is not None:
                experts[:, step + 1] = routing.take()

        tokens_np, logps_np = tokens.cpu().numpy(), logps.cpu().numpy()
        counts, stopped_np = n_generated.cpu().numpy(), stopped.cpu().numpy()
        experts_np = experts.cpu().numpy() if experts is not None else None
        return [
            Completion(
                token_ids=tokens_np[i, : counts[i]].astype(np.int32),
                logprobs=logps_np[i, : counts[i]].astype(np.float32),
                finish_reason="stop" if stopped_np[i] else "length",
                experts=None if experts_np is None else experts_np[i, : counts[i]],
            )
            for i in range(n)
        ]

    @torch.inference_mode()
    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        """Raw log-probs of ``token_ids[start:]`` from one right-padded full-sequence forward per batch,
        with the engine's own dtype and attention: its prefill path, as opposed to its decode loop."""
        out: list[np.ndarray] = []
        bs = self.batch_size
        for start in range(0, len(requests), bs):
            batch = requests[start : start + bs]
            lengths = [len(r.token_ids) for r in batch]
            width = max(lengths)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                input_ids[i, : lengths[i]] = torch.from_numpy(r.token_ids.astype(np.int64))
                attention_mask[i, : lengths[i]] = 1
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            for i, r in enumerate(batch):
                rows = logits[i, r.start - 1 : lengths[i] - 1].float()
                targets = input_ids[i, r.start : lengths[i]]
                logp = torch.log_softmax(rows, dim=-1).gather(-1, targets[:, None]).squeeze(1)
                out.append(logp.cpu().numpy().astype(np.float32))
            if on_progress:
                on_progress(len(batch))
        return out

    def close(self) -> None:
        del self.model
        free_accelerator_memory()
