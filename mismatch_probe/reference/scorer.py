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

With ``reference.sequence_parallel_size`` / ``tensor_parallel_size`` above 1 the same scorer runs
as one rank of a training layout (Ulysses SP, DTensor TP; :mod:`mismatch_probe.reference.parallel`), in
rank processes that :func:`mismatch_probe.reference.open_reference_scorer` starts; the scores come back identical in shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.environment import cuda_numerics
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.modeling.loading import (
    choose_attention,
    free_accelerator_memory,
    load_causal_lm,
    read_config,
    resolve_device,
)
from mismatch_probe.modeling.logprobs import LogprobSemantics, entropy_from_logprobs, logprobs_under
from mismatch_probe.modeling.routing import ForcedRouting, RouterRecorder, check_forced_routing
from mismatch_probe.modeling.sharded_loading import METHOD as SHARDED_LOADING
from mismatch_probe.modeling.sharded_loading import NeedsFullLoad, build_on_meta, check_loadable, load_local_shards
from mismatch_probe.modeling.varlen_attention import register as register_varlen_sdpa
from mismatch_probe.reference.parallel import (
    FsdpRoot,
    ParallelContext,
    UlyssesAttention,
    apply_fsdp,
    apply_tensor_parallel,
    check_layout,
    gather_rows,
)
from mismatch_probe.table.tokens import Rollout

# The LM head runs over a forward's scored positions a chunk at a time: logits -> log-probs -> the
# entropy's p * log p hold a few [chunk x vocab] float32 tensors at once. At most 2,048 positions, and
# at most 128 MiB of logits a chunk: at Qwen's 151,936 tokens 220 positions. A fixed 2,048 there held
# ~2.6 GiB above the weights at the head (benchmarks/bench_run_cost.py, Qwen2.5-0.5B's shape); the
# GEMM of 220 rows still runs at the full width of the head.
LM_HEAD_CHUNK_TOKENS = 2048
LM_HEAD_CHUNK_BYTES = 128 << 20


def lm_head_chunk(vocab_size: int) -> int:
    """Positions per LM-head chunk for a vocabulary of ``vocab_size`` (see LM_HEAD_CHUNK_BYTES)."""
    return max(1, min(LM_HEAD_CHUNK_TOKENS, LM_HEAD_CHUNK_BYTES // (4 * max(1, vocab_size))))


T = TypeVar("T")
# a two-token sequence scored only to join an FSDP peer's collectives (see score's min_forwards)
FILLER = Rollout(-1, "", np.array([1, 2]), np.zeros(2, np.int16), np.array([False, True]), np.zeros(2, np.float32), "")
PACKED_MASKS = {
    "model": "built by the model from the position ids",
    "precomputed": "built from the position ids by mismatch-probe (the model's own mask ignores them)",
}


@dataclass
class Scores:
    """Per rollout, full sequence length (NaN where not scored): the reference's view of the tokens."""

    logp: list[np.ndarray]
    entropy: list[np.ndarray]
    experts: list[np.ndarray | None] | None = None  # int16 [model tokens, moe layers, k], MoE only
    # routing replay (R3): the log-probs with the routing behind each model token forced to the
    # engine's experts (``Rollout.experts_infer``), every other position routing freely; full length
    logp_replay: list[np.ndarray] | None = None


@dataclass
class _Forward:
    """One micro-batch's forward on this rank: hidden states, the rows of them to score, and which
    of the micro-batch's scored tokens those are (all of them unless sequence-parallel)."""

    hidden: torch.Tensor
    src: torch.Tensor
    part: slice = field(default_factory=lambda: slice(None))
    counts: list[int] | None = None  # sequence-parallel: scored tokens per rank, in rank order


class ReferenceScorer:
    """Scores rollouts in this process; with ``parallel``, as one rank of a training layout
    (see :mod:`mismatch_probe.reference.parallel`; :class:`DistributedReferenceScorer` starts the ranks)."""

    def __init__(
        self,
        model_path: str | Path,
        spec: ReferenceSpec,
        *,
        trust_remote_code: bool = False,
        parallel: ParallelContext | None = None,
    ):
        self.model_path = Path(model_path)
        self.spec = spec
        self.parallel = parallel
        self._fsdp_root: FsdpRoot | None = None  # set once the layout is applied (reference.fsdp)
        self.device = parallel.device if parallel else resolve_device(spec.device)
        self.attention = choose_attention(
            self.model_path, spec.attn_implementation, trust_remote_code=trust_remote_code
        )
        # Packed + sdpa would otherwise build a dense [T x T] block mask per micro-batch.
        self.varlen = spec.packing and self.attention.used == "sdpa"
        attn = register_varlen_sdpa() if self.varlen else self.attention.used
        self.ulysses = None
        if parallel and parallel.sp > 1:
            self.ulysses = UlyssesAttention(inner=attn)
            attn = self.ulysses.register()
        if spec.fsdp and parallel is None:
            raise ConfigError("reference.fsdp shards the model over ranks: it needs a process group")
        self.loading = self._load(attn, trust_remote_code)
        self.decoder = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        if self.decoder is self.model or self.lm_head is None:
            raise ConfigError(f"{type(self.model).__name__} does not expose a decoder and an LM head separately")
        cfg = (
            self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        )
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._logit_scale = getattr(cfg, "logit_scale", None)  # Cohere multiplies
        self._logits_scaling = getattr(cfg, "logits_scaling", None)  # Granite divides
        self._head_fp32: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.routing = RouterRecorder(self.model)
        self.replay = ForcedRouting(self.model)
        self._replay_unavailable: str | None = None
        self._replay_checked = False
        self.layout: dict = {}
        if parallel:
            self.layout = check_layout(read_config(self.model_path), parallel.sp, parallel.tp)
            if parallel.tp > 1:
                self.layout["tensor_parallel"] = apply_tensor_parallel(self.decoder, parallel)
            if spec.fsdp:
                self._fsdp_root, self.layout["fsdp"] = apply_fsdp(self.model, parallel, spec)
        if self.loading["method"] == SHARDED_LOADING:  # the layout is in place: read this rank's slices
            self.loading.update(load_local_shards(self.model, self.model_path, self.device))
        # the checks run on the model as laid out, the same inputs on every rank (collectives included)
        self._with_all_weights(self._self_check)  # the architecture: decoder + LM head = its own logits
        # how packed rows keep their sequences apart, when attention is not per sequence (varlen)
        self.packed_masks: str | None = None
        if spec.packing and not self.varlen and self.ulysses is None:
            self.packed_masks = self._with_all_weights(self._check_packed_isolation)

    @property
    def fsdp(self) -> bool:
        """The model is wrapped with FSDP2 (its forwards go through the root unit)."""
        return self._fsdp_root is not None

    def _load(self, attn: str, trust_remote_code: bool) -> dict:
        """Set ``self.model``. A layout that shards the weights (TP, FSDP) builds it on the meta
        device, each rank to read its own slices once laid out; otherwise, or when the checkpoint
        does not map one to one onto the model, every rank loads it whole."""
        p = self.parallel
        if p is not None and p.world_size > 1 and (p.tp > 1 or self.spec.fsdp):
            model = build_on_meta(
                self.model_path, dtype=self.spec.dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
            )
            try:
                check_loadable(model, self.model_path)
            except NeedsFullLoad as exc:
                why = str(exc)
            else:
                self.model = model
                return {"method": SHARDED_LOADING}
        else:
            why = "every rank holds the whole model" if p is not None and p.world_size > 1 else None
        self.model = load_causal_lm(
            self.model_path,
            dtype=self.spec.dtype,
            attn_implementation=attn,
            device=self.device,
            trust_remote_code=trust_remote_code,
        )
        return {"method": "from_pretrained", **({"why_not_sharded": why} if why else {})}

    def _with_all_weights(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a forward outside :meth:`score`) where every weight can be read: under
        FSDP inside the root unit (which gathers them), without autograd."""
        with torch.no_grad() if self.fsdp else torch.inference_mode():
            if self._fsdp_root is None:
                return fn()
            try:
                return self._fsdp_root(fn)
            finally:
                self._head_fp32 = None

    def info(self) -> dict:
        import transformers

        return {
            "dtype": self.spec.dtype,
            "logits_fp32": self.spec.logits_fp32,
            **self.attention.record(),
            "attention_kernel": self._attention_kernel(),
            **({"packed_attention_mask": PACKED_MASKS[self.packed_masks]} if self.packed_masks else {}),
            "packing": "padding-free" if self.spec.packing else "padded",
            "micro_batch_size": self.spec.micro_batch_size,
            "fsdp": self.fsdp,
            "loading": self.loading,
            "max_tokens_per_micro_batch": self.spec.max_tokens_per_micro_batch if self.spec.packing else None,
            "device": self.device,
            "data_parallel_size": self.parallel.dp if self.parallel else 1,
            "sequence_parallel_size": self.parallel.sp if self.parallel else 1,
            "tensor_parallel_size": self.parallel.tp if self.parallel else 1,
            **({"parallel": self._parallel_info()} if self.parallel else {}),
            **cuda_numerics(self.device),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        }

    def peak_memory(self) -> list[dict]:
        """This process's peak memory (:func:`~mismatch_probe.environment.peak_memory`), as a list
        of one rank, like the distributed scorer's."""
        from mismatch_probe.environment import peak_memory

        return [peak_memory(self.device)]

    def _attention_kernel(self) -> str:
        kernel = "sdpa per sequence (varlen)" if self.varlen else self.attention.used
        return f"Ulysses all-to-all around {kernel}" if self.ulysses else kernel

    def _parallel_info(self) -> dict:
        p = self.parallel
        info = {
            "world_size": p.world_size,
            "backend": p.backend,
            "mesh": {"dp": p.dp, "sp": p.sp, "tp": p.tp},
            "launcher": p.launcher,
        }
        if p.sp > 1:
            info["ulysses"] = {
                "inner_attention": self.ulysses.inner,
                "attention_heads_per_rank": self.layout["attention_heads_per_rank"],
                "kv_head_repeats": self.layout["kv_head_repeats"],
            }
        if p.tp > 1:
            info["tensor_parallel"] = self.layout["tensor_parallel"]
        if self.fsdp:
            info["fsdp"] = self.layout["fsdp"]
        return info

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

    def _check_packed_isolation(self) -> str:
        """Packed rows rely on the model building a block-diagonal mask from the position ids.
        Some architectures ignore them (transformers' gpt-oss builds its masks without them), so a
        sequence would attend to the ones packed before it. Score the same sequence after two
        different neighbours: with isolation its logits do not move. If they do, pass masks built
        from the position ids ourselves; if even that fails, refuse packing."""
        vocab = self.lm_head.weight.shape[0]
        n = 24
        seq = torch.arange(3, 3 + n, device=self.device) % vocab
        pos = self._tensor(np.concatenate([np.arange(n), np.arange(n)]))[None]

        def logits_after(first: torch.Tensor, masks: bool) -> torch.Tensor:
            ids = torch.cat([first, seq])[None]
            extra = {"attention_mask": self._packed_attention_mask(pos)} if masks else {}
            hidden = self.decoder(input_ids=ids, position_ids=pos, use_cache=False, **extra).last_hidden_state
            return self._logits(hidden[0, n:], fp32=True)

        neighbours = (
            torch.arange(5, 5 + n, device=self.device) * 7 % vocab,
            torch.arange(9, 9 + n, device=self.device) * 13 % vocab,
        )
        for masks in (False, True):
            a, b = (logits_after(first, masks) for first in neighbours)
            if torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max())):
                return "precomputed" if masks else "model"
        raise ConfigError(
            f"{type(self.model).__name__}: sequences packed into one row attend to each other "
            f"with attn_implementation={self.attention.used!r}",
            hint="score padded micro-batches instead: --no-packing (reference.packing = false)",
        )

    def _packed_attention_mask(self, position_ids: torch.Tensor):
        """The model's masks for a packed row, built by transformers from the position ids (a dict
        by layer type for models with sliding or chunked layers)."""
        from transformers.masking_utils import create_masks_for_generate

        # only the batch size, length, dtype and device of the embeddings are read
        embeds = torch.zeros((1, 1, 1), dtype=self.lm_head.weight.dtype, device=self.device)
        embeds = embeds.expand(1, position_ids.shape[1], 1)
        return create_masks_for_generate(
            self.model.config, embeds, attention_mask=None, past_key_values=None, position_ids=position_ids
        )

    def routing_replay_unavailable(self) -> str | None:
        """Why this scorer cannot also score with the engine's routing replayed (None: it can).
        The first call checks the mechanism on the model once (:func:`check_forced_routing`)."""
        if not self.routing.active:
            return "the reference model has no MoE routers"
        p = self.parallel
        if p is not None and (p.sp > 1 or p.tp > 1 or self.fsdp):
            return (
                "the reference runs as a sharded training layout (Ulysses SP, TP or FSDP), which routing "
                "replay does not support yet; it needs a single-process reference"
            )
        if not self._replay_checked:
            vocab = self.lm_head.weight.shape[0]
            ids = torch.arange(3, 19, device=self.device)[None] % vocab
            self._replay_unavailable = self._with_all_weights(lambda: check_forced_routing(self.model, ids))
            self._replay_checked = True
        return self._replay_unavailable

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
        *,
        min_forwards: int = 0,
        replay: bool = False,
    ) -> Scores:
        """Score every model token of ``rollouts``; routing too when the engine recorded it.

        ``min_forwards``: run filler forwards (scores discarded) up to that many, so this rank
        joins as many collectives as a data-parallel peer with more to score (FSDP).
        ``replay``: where the engine recorded routing, score the tokens a second time with the
        routing behind each model token forced to the engine's experts (``Scores.logp_replay``;
        :meth:`routing_replay_unavailable` says where it cannot)."""
        record = self.routing.active and all(r.experts_infer is not None for r in rollouts) and bool(rollouts)
        replay = replay and record
        if replay and (why := self.routing_replay_unavailable()):
            raise ConfigError(f"routing replay: {why}", hint="turn it off: reference.routing_replay = false")
        if not record:
            scores = self._score(rollouts, semantics, on_progress, None)
        else:
            with self.routing:
                scores = self._score(rollouts, semantics, on_progress, self.routing, replay)
        if min_forwards:
            for _ in range(min_forwards - sum(1 for _ in self.micro_batches(rollouts))):
                self._score([FILLER], semantics, None, None)
        return scores

    def _score(self, rollouts, semantics, on_progress, routing: RouterRecorder | None, replay=False) -> Scores:
        # FSDP2 writes the gathered weights into buffers made outside inference mode, which it forbids
        with torch.no_grad() if self.fsdp else torch.inference_mode():
            return self._score_all(rollouts, semantics, on_progress, routing, replay)

    def _score_all(self, rollouts, semantics, on_progress, routing: RouterRecorder | None, replay=False) -> Scores:
        logps = [np.full(len(r.token_ids), np.nan, dtype=np.float32) for r in rollouts]
        ents = [np.full(len(r.token_ids), np.nan, dtype=np.float32) for r in rollouts]
        experts: list[np.ndarray | None] = [None] * len(rollouts)
        replayed = [np.full(len(r.token_ids), np.nan, dtype=np.float32) for r in rollouts] if replay else None
        for idx in self.micro_batches(rollouts):
            group = [rollouts[i] for i in idx]
            for r in group:
                if len(r.is_model_token) and r.is_model_token[0]:
                    raise DataError(
                        f"sample {r.sample_id}: its first token is marked as a model token, "
                        "but nothing precedes it to predict it"
                    )
            if self._fsdp_root is None:
                parts = self._micro_batch(group, semantics, routing, replay)
            else:  # FSDP gathers the root's weights for the call, the layers' as each runs
                parts = self._fsdp_root(lambda group=group: self._micro_batch(group, semantics, routing, replay))
                self._head_fp32 = None  # a copy of weights that are sharded again
            lp, ent = parts[0].cpu().numpy(), parts[1].cpu().numpy()
            group_experts = parts[2].cpu().numpy().astype(np.int16) if routing else None
            lp_replay = parts[3].cpu().numpy() if replay else None
            start = 0
            for i, r in zip(idx, group):
                k = int(r.is_model_token.sum())
                logps[i][r.is_model_token] = lp[start : start + k]
                ents[i][r.is_model_token] = ent[start : start + k]
                if group_experts is not None:
                    experts[i] = group_experts[start : start + k]
                if replayed is not None and lp_replay is not None:
                    replayed[i][r.is_model_token] = lp_replay[start : start + k]
                start += k
            if on_progress:
                on_progress(len(group))
        return Scores(logps, ents, experts if routing else None, replayed)

    def _micro_batch(
        self, group: list[Rollout], semantics, routing: RouterRecorder | None, replay: bool = False
    ) -> list[torch.Tensor]:
        """One micro-batch through the decoder and the LM head: its scored tokens' log-probs and
        entropies (and routing; and with ``replay`` the log-probs again, with the engine's routing
        forced), in order, on every rank of the layout."""
        fwd = self._forward_packed(group) if self.spec.packing else self._forward_padded(group)
        # the routing of the scored rows: the inputs whose hidden states give each token's logits
        group_experts = routing.take().index_select(0, fwd.src).to(torch.int32) if routing else None
        targets = np.concatenate([r.token_ids[r.is_model_token] for r in group]).astype(np.int64)
        target_ids = torch.from_numpy(targets[fwd.part]).to(self.device)
        parts = [*self._score_hidden(fwd.hidden, fwd.src, target_ids, semantics)]
        if group_experts is not None:
            parts.append(group_experts.to(self.device))
        if replay and routing is not None:
            parts.append(self._score_replayed(group, semantics, routing, target_ids))
        if fwd.counts is not None:  # sequence-parallel: every rank scored its slice of the row
            parts = gather_rows(parts, fwd.counts, self.parallel.sp_group)
        return parts

    def _score_replayed(
        self, group: list[Rollout], semantics, routing: RouterRecorder, target_ids: torch.Tensor
    ) -> torch.Tensor:
        """The scored tokens' log-probs from a forward whose routing behind each model token (the
        row of the input before it) is forced to the engine's recorded experts; other rows route
        freely. The recorder checks that every MoE layer routed the forced rows as told."""
        try:  # the engine's ids must fit the reference's MoE layers (ForcedRouting.force checks them)
            forced = torch.from_numpy(np.concatenate([r.experts_infer for r in group]).astype(np.int64))
            forced = forced.to(self.device)
            fwd = self._forward_packed(group, forced) if self.spec.packing else self._forward_padded(group, forced)
        except ValueError as exc:
            raise DataError(f"routing replay: {exc}") from None
        took = routing.take().index_select(0, fwd.src).to(torch.int64)
        if not torch.equal(took, forced.sort(dim=-1).values):
            raise RuntimeError("routing replay: the MoE layers did not route the forced rows to the engine's experts")
        return self._score_hidden(fwd.hidden, fwd.src, target_ids, semantics)[0]

    def _forcing(self, src: np.ndarray, forced: torch.Tensor | None):
        """Forwards in this block route rows ``src`` to ``forced`` (None: a free forward)."""
        return nullcontext() if forced is None else self.replay.force(self._tensor(src), forced)

    def _forward_packed(self, group: list[Rollout], forced: torch.Tensor | None = None) -> _Forward:
        """The micro-batch as one packed row; ``forced``: the experts of each scored row (routing replay)."""
        lengths = np.array([len(r.token_ids) for r in group])
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ids = np.concatenate([r.token_ids for r in group]).astype(np.int64)
        pos = np.concatenate([np.arange(n) for n in lengths])
        src = np.concatenate([off + np.flatnonzero(r.is_model_token) - 1 for off, r in zip(offsets, group)])
        if self.ulysses is not None:
            assert forced is None, "routing replay runs on a single-process reference"
            return self._forward_packed_ulysses(ids, pos, lengths, src)
        position_ids = self._tensor(pos)[None]
        extra = self._packed_kwargs(lengths) if self.varlen else {}
        if self.packed_masks == "precomputed":
            extra["attention_mask"] = self._packed_attention_mask(position_ids)
        with self._forcing(src, forced):
            hidden = self.decoder(
                input_ids=self._tensor(ids)[None], position_ids=position_ids, use_cache=False, **extra
            ).last_hidden_state[0]
        return _Forward(hidden, self._tensor(src))

    def _forward_packed_ulysses(self, ids, pos, lengths, src) -> _Forward:
        """This rank's slice of the packed row through the decoder; ``src`` (ascending) cut to it."""
        n, rank = self.parallel.sp, self.parallel.sp_rank
        pad = -len(ids) % n
        if pad:  # a segment of its own at the end, so no real token attends to it
            ids = np.concatenate([ids, np.zeros(pad, np.int64)])
            pos = np.concatenate([pos, np.arange(pad)])
            lengths = np.concatenate([lengths, [pad]])
        width = len(ids) // n
        bounds = np.searchsorted(src, np.arange(n + 1) * width)  # src[bounds[r]:bounds[r+1]] on rank r
        lo = rank * width
        global_pos = self._tensor(pos)[None]
        with self.ulysses.packed_row(self.parallel.sp_group, n, global_pos, self.layout["kv_head_repeats"]):
            hidden = self.decoder(
                input_ids=self._tensor(ids[lo : lo + width])[None],
                position_ids=global_pos[:, lo : lo + width],
                use_cache=False,
                **self._packed_kwargs(lengths),
            ).last_hidden_state[0]
        part = slice(int(bounds[rank]), int(bounds[rank + 1]))
        return _Forward(hidden, self._tensor(src[part] - lo), part, np.diff(bounds).tolist())

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def _packed_kwargs(self, lengths) -> dict:
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).to(self.device)
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": int(max(lengths)),
            "max_length_k": int(max(lengths)),
        }

    def _forward_padded(self, group: list[Rollout], forced: torch.Tensor | None = None) -> _Forward:
        """The micro-batch as right-padded rows; ``forced``: the experts of each scored row (routing replay)."""
        width = max(len(r.token_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, r in enumerate(group):  # right padding: a trainer's layout
            ids[i, : len(r.token_ids)] = torch.from_numpy(r.token_ids.astype(np.int64))
            mask[i, : len(r.token_ids)] = 1
        # the routers see the batch flattened row-major: row i, position t is row i * width + t
        src = np.concatenate([i * width + np.flatnonzero(r.is_model_token) - 1 for i, r in enumerate(group)])
        with self._forcing(src, forced):
            hidden = self.decoder(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
            ).last_hidden_state
        return _Forward(hidden.reshape(-1, hidden.shape[-1]), self._tensor(src))

    def _score_hidden(
        self, hidden: torch.Tensor, src: torch.Tensor, targets: torch.Tensor, semantics: LogprobSemantics
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lp_parts, ent_parts = [], []
        chunk = lm_head_chunk(int(self.lm_head.weight.shape[0]))
        for a in range(0, len(src), chunk):
            h = hidden.index_select(0, src[a : a + chunk])
            logp = logprobs_under(self._logits(h, self.spec.logits_fp32), semantics)
            lp_parts.append(logp.gather(-1, targets[a : a + chunk, None]).squeeze(1))
            ent_parts.append(entropy_from_logprobs(logp))
        if not lp_parts:
            empty = torch.zeros(0, dtype=torch.float32, device=self.device)
            return empty, empty.clone()
        return torch.cat(lp_parts).float(), torch.cat(ent_parts).float()

    def close(self) -> None:
        del self.model, self.decoder, self.lm_head
        self._head_fp32 = None
        free_accelerator_memory()


def routing_replay(enabled: bool, scorer) -> bool | str | None:
    """Whether the reference also scores with the engine's routing replayed (R3) in an MoE run
    whose engine recorded its routing: True, or why not (a string); None when the spec turns it
    off (``reference.routing_replay``). ``scorer``: a :class:`ReferenceScorer`, or the rank
    processes' scorer (Ulysses SP, TP or FSDP), which cannot."""
    if not enabled:
        return None
    if not isinstance(scorer, ReferenceScorer):  # rank processes: sequence or tensor parallel, FSDP
        return (
            "the reference runs as rank processes (Ulysses SP, TP or FSDP), which routing replay does not "
            "support yet; it needs a single-process reference"
        )
    return scorer.routing_replay_unavailable() or True


def replay_info(replay: bool | str | None) -> dict:
    """The reference section's ``routing_replay``: what the score stage did about the routing
    replay what-if (True: run; a string: why not; None: turned off or not an MoE run with routing)."""
    if replay is None:
        return {}
    return {"routing_replay": "the engine's experts forced (R3)" if replay is True else f"not run: {replay}"}
