"""The training-style reference forward: one full-sequence pass over the exact token ids.

This is how a trainer computes ``old_log_prob``: no KV cache, every sequence in one prefill,
either padding-free (sequences concatenated into one row, position ids restarting at 0 for each
sequence so attention stays block-diagonal; what verl's ``use_remove_padding`` and most FSDP
stacks do) or as right-padded micro-batches. Only model tokens are scored: the hidden state at
position t-1 predicts token t, so the first token of a sequence never has a log-prob.

The LM head runs separately from the decoder, in chunks, so the [tokens x vocab] logits are
never materialized for a whole micro-batch, and optionally in float32 (``logits_fp32``). At load
time a small self-check confirms this split reproduces the model's own ``forward`` logits, so an
architecture that post-processes logits in a way this module does not know fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError, DataError
from .hf_models import free_accelerator_memory, load_causal_lm, resolve_device
from .routing import RouterRecorder
from .sampling import LogprobSemantics, entropy_from_logprobs, logprobs_under
from .spec import ReferenceSpec
from .table import Rollout
from .varlen_attention import register as register_varlen_sdpa

LM_HEAD_CHUNK_TOKENS = 2048


@dataclass
class Scores:
    """Per rollout, full sequence length (NaN where not scored): the reference's view of the tokens."""

    logp: list[np.ndarray]
    entropy: list[np.ndarray]
    experts: list[np.ndarray | None] | None = None  # int16 [model tokens, moe layers, k], MoE only


class ReferenceScorer:
    def __init__(self, model_path: str | Path, spec: ReferenceSpec, *, trust_remote_code: bool = False):
        self.model_path = Path(model_path)
        self.spec = spec
        self.device = resolve_device(spec.device)
        # Packed + sdpa would otherwise build a dense [T x T] block mask per micro-batch.
        self.varlen = spec.packing and spec.attn_implementation == "sdpa"
        self.model = load_causal_lm(
            self.model_path,
            dtype=spec.dtype,
            attn_implementation=register_varlen_sdpa() if self.varlen else spec.attn_implementation,
            device=self.device,
            trust_remote_code=trust_remote_code,
        )
        self.decoder = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        if self.decoder is self.model or self.lm_head is None:
            raise ConfigError(f"{type(self.model).__name__} does not expose a decoder and an LM head separately")
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._logit_scale = getattr(cfg, "logit_scale", None)  # Cohere multiplies
        self._logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite divides
        self._head_fp32: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.routing = RouterRecorder(self.model)
        self._self_check()

    def info(self) -> dict:
        import transformers

        return {
            "dtype": self.spec.dtype,
            "logits_fp32": self.spec.logits_fp32,
            "attn_implementation": self.spec.attn_implementation,
            "attention_kernel": (
                "sdpa per sequence (varlen)" if self.varlen else self.model.config._attn_implementation
            ),
            "packing": "padding-free" if self.spec.packing else "padded",
            "micro_batch_size": self.spec.micro_batch_size,
            "max_tokens_per_micro_batch": self.spec.max_tokens_per_micro_batch if self.spec.packing else None,
            "device": self.device,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }

    # ---- logits ----------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor, fp32: bool) -> torch.Tensor:
        if fp32:
            if self._head_fp32 is None:
                bias = getattr(self.lm_head, "bias", None)
                self._head_fp32 = (self.lm_head.weight.float(), None if bias is None else bias.float())
            weight, bias = self._head_fp32
            logits = torch.nn.functional.linear(hidden.float(), weight, bias)
        else:
            logits = self.lm_head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    @torch.inference_mode()
    def _self_check(self) -> None:
        vocab = self.lm_head.weight.shape[0]
        ids = torch.arange(1, 9, device=self.device)[None] % vocab
        extra = self._packed_kwargs([8]) if self.varlen else {}
        expected = self.model(input_ids=ids, use_cache=False, **extra).logits.float()
        hidden = self.decoder(input_ids=ids, use_cache=False, **extra).last_hidden_state
        got = self._logits(hidden, fp32=False)
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
            raise ConfigError(
                f"{type(self.model).__name__}: decoder + LM head does not reproduce the model's logits "
                f"(max diff {float((got - expected).abs().max()):.3g}); this architecture post-processes logits "
                "in a way the reference does not implement"
            )

    # ---- scoring ---------------------------------------------------------------------------

    def micro_batches(self, rollouts: Sequence[Rollout]) -> Iterator[list[int]]:
        """Indices of consecutive rollouts per forward: by count, and in packed mode also by tokens."""
        batch: list[int] = []
        tokens = 0
        for i, r in enumerate(rollouts):
            n = len(r.token_ids)
            over_budget = self.spec.packing and batch and tokens + n > self.spec.max_tokens_per_micro_batch
            if len(batch) == self.spec.micro_batch_size or over_budget:
                yield batch
                batch, tokens = [], 0
            batch.append(i)
            tokens += n
        if batch:
            yield batch

    def score(
        self,
        rollouts: Sequence[Rollout],
        semantics: LogprobSemantics,
        on_progress: Callable[[int], None] | None = None,
    ) -> Scores:
        """Score every model token of ``rollouts``; routing too when the engine recorded it."""
        record = self.routing.active and all(r.experts_infer is not None for r in rollouts) and bool(rollouts)
        if not record:
            return self._score(rollouts, semantics, on_progress, None)
        with self.routing:
            return self._score(rollouts, semantics, on_progress, self.routing)

    @torch.inference_mode()
    def _score(self, rollouts, semantics, on_progress, routing: RouterRecorder | None) -> Scores:
        logps = [np.full(len(r.token_ids), np.nan, dtype=np.float32) for r in rollouts]
        ents = [np.full(len(r.token_ids), np.nan, dtype=np.float32) for r in rollouts]
        experts: list[np.ndarray | None] = [None] * len(rollouts)
        for idx in self.micro_batches(rollouts):
            group = [rollouts[i] for i in idx]
            for r in group:
                if len(r.is_model_token) and r.is_model_token[0]:
                    raise DataError(f"sample {r.sample_id}: its first token is marked as a model token, "
                                    "but nothing precedes it to predict it")
            if self.spec.packing:
                hidden, src = self._forward_packed(group)
            else:
                hidden, src = self._forward_padded(group)
            # the routing of the scored rows: the inputs whose hidden states give each token's logits
            group_experts = routing.take().index_select(0, src.to(torch.long)).cpu().numpy() if routing else None
            targets = np.concatenate([r.token_ids[r.is_model_token] for r in group]).astype(np.int64)
            lp, ent = self._score_hidden(hidden, src, torch.from_numpy(targets).to(self.device), semantics)
            start = 0
            for i, r in zip(idx, group):
                k = int(r.is_model_token.sum())
                logps[i][r.is_model_token] = lp[start : start + k]
                ents[i][r.is_model_token] = ent[start : start + k]
                if group_experts is not None:
                    experts[i] = group_experts[start : start + k]
                start += k
            if on_progress:
                on_progress(len(group))
        return Scores(logps, ents, experts if routing else None)

    def _forward_packed(self, group: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = np.array([len(r.token_ids) for r in group])
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ids = torch.from_numpy(np.concatenate([r.token_ids for r in group]).astype(np.int64)).to(self.device)
        pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(self.device)
        extra = self._packed_kwargs(lengths) if self.varlen else {}
        hidden = self.decoder(
            input_ids=ids[None], position_ids=pos[None], use_cache=False, **extra
        ).last_hidden_state[0]
        src = np.concatenate([off + np.flatnonzero(r.is_model_token) - 1 for off, r in zip(offsets, group)])
        return hidden, torch.from_numpy(src).to(self.device)

    def _packed_kwargs(self, lengths) -> dict:
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).to(self.device)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(max(lengths)),
                "max_length_k": int(max(lengths))}

    def _forward_padded(self, group: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r.token_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):  # right padding: a trainer's layout
            ids[i, : len(r.token_ids)] = torch.from_numpy(r.token_ids.astype(np.int64))
            mask[i, : len(r.token_ids)] = 1
        hidden = self.decoder(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
        ).last_hidden_state
        src = np.concatenate([i * width + np.flatnonzero(r.is_model_token) - 1 for i, r in enumerate(group)])
        return hidden.reshape(-1, hidden.shape[-1]), torch.from_numpy(src).to(self.device)

    def _score_hidden(
        self, hidden: torch.Tensor, src: torch.Tensor, targets: torch.Tensor, semantics: LogprobSemantics
    ) -> tuple[np.ndarray, np.ndarray]:
        lp_parts, ent_parts = [], []
        for a in range(0, len(src), LM_HEAD_CHUNK_TOKENS):
            h = hidden.index_select(0, src[a : a + LM_HEAD_CHUNK_TOKENS])
            logp = logprobs_under(self._logits(h, self.spec.logits_fp32), semantics)
            lp_parts.append(logp.gather(-1, targets[a : a + LM_HEAD_CHUNK_TOKENS, None]).squeeze(1))
            ent_parts.append(entropy_from_logprobs(logp))
        if not lp_parts:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        return torch.cat(lp_parts).cpu().numpy(), torch.cat(ent_parts).cpu().numpy()

    def close(self) -> None:
        del self.model, self.decoder, self.lm_head
        self._head_fp32 = None
        free_accelerator_memory()
