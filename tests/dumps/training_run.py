"""A small RL step on a fixture model, written out the way each framework dumps it.

:func:`simulate` plays both sides of a training step with real Hugging Face forwards: it samples
responses (some with a tool call whose output the policy did not sample), takes the "engine"
log-probs from a bfloat16 forward and the "trainer" log-probs from a float32 one, and keeps every
array as the ground truth. The writers put the same step in slime's, NeMo-RL's, verl's, prime-rl's
and the generic format, field for field as each framework's source writes them (see each writer),
so a test can import the dump and compare against :class:`Step` in float64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

TOOL_IDS = [17, 23, 42, 99, 5]  # a tool's output: tokens the policy did not sample


@dataclass
class Sequence:
    prompt_id: str
    prompt_len: int
    token_ids: np.ndarray  # int64, full
    model_mask: np.ndarray  # bool, full
    logp_engine: np.ndarray  # float32, full (NaN off model tokens)
    logp_trainer: np.ndarray  # float32, full
    experts: np.ndarray | None = None  # int32 [len - 1, moe layers, k]: routing of input position i
    experts_trainer: np.ndarray | None = None  # the same from the float32 forward

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class Step:
    sequences: list[Sequence]
    temperature: float = 1.0

    def model_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(engine, trainer) log-probs of every model token, float64, in sample order."""
        li = np.concatenate([s.logp_engine[s.model_mask] for s in self.sequences]).astype(np.float64)
        lt = np.concatenate([s.logp_trainer[s.model_mask] for s in self.sequences]).astype(np.float64)
        return li, lt


def simulate(
    model_dir: Path, prompts: Path, *, n_prompts: int = 4, n: int = 2, seed: int = 0, record_routing: bool = False
) -> Step:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    trainer = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rows = [json.loads(line) for line in prompts.read_text().splitlines()[:n_prompts]]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p, row in enumerate(rows):
        text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        for j in range(n):
            ids, mask = list(prompt), [False] * len(prompt)
            segments = [8, 6] if (p + j) % 2 else [12]  # every other sample calls a tool between two turns
            for k, length in enumerate(segments):
                if k:
                    ids += TOOL_IDS
                    mask += [False] * len(TOOL_IDS)
                for _ in range(length):
                    with torch.inference_mode():
                        logits = trainer(torch.tensor([ids])).logits[0, -1].float()
                    ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
                    mask.append(True)
            t = torch.tensor([ids])
            full_e, experts = _logp(engine, t, record_routing)
            full_t, experts_t = _logp(trainer, t, record_routing)
            m = np.array(mask)
            out.append(
                Sequence(
                    prompt_id=row["id"],
                    prompt_len=len(prompt),
                    token_ids=np.array(ids, dtype=np.int64),
                    model_mask=m,
                    logp_engine=np.where(m, full_e, np.nan).astype(np.float32),
                    logp_trainer=np.where(m, full_t, np.nan).astype(np.float32),
                    experts=experts,
                    experts_trainer=experts_t,
                )
            )
    return Step(out)


def _logp(model, ids: torch.Tensor, routing: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """log p(token t | tokens < t) for every t (NaN at 0), and the routing of each input position."""
    from mismatch_probe.modeling.routing import RouterRecorder

    recorder = RouterRecorder(model)
    with torch.inference_mode(), recorder:
        logits = model(ids).logits[0].float()
        experts = recorder.take().numpy().astype(np.int32) if routing and recorder.active else None
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()
    return np.concatenate([[np.nan], lp]), None if experts is None else experts[:-1]


# ---- slime (slime/utils/types.py Sample.to_dict, slime/observability/*_data_utils.py) --------------


def write_slime(step: Step, directory: Path, rollout_id: int = 3, *, train: bool = True) -> Path:
    """``--dump-details DIR``: ``rollout_data/<id>.pt`` and ``train_data/<id>.pt`` (format_version 2)."""
    (directory / "rollout_data").mkdir(parents=True, exist_ok=True)
    samples, train_samples = [], []
    for k, s in enumerate(step.sequences):
        r = s.response_len
        loss_mask = s.model_mask[s.prompt_len :].astype(int).tolist()
        # tool tokens: 0.0 (Sample.append_response_tokens(trainable=False))
        rollout_lp = np.where(s.model_mask, s.logp_engine, 0.0)[s.prompt_len :].astype(float).tolist()
        experts = None if s.experts is None else torch.from_numpy(s.experts.astype(np.int32))
        samples.append(_slime_sample(k, s, loss_mask, rollout_lp, experts))
        train_lp = torch.from_numpy(np.where(s.model_mask, s.logp_trainer, -3.0)[s.prompt_len :].astype(np.float32))
        train_samples.append(
            {
                "data_parallel_rank": 0,
                "sample_index": k,
                "rollout_position": k,
                "tokens": torch.tensor(s.token_ids, dtype=torch.long),
                "response_lengths": r,
                "rewards": 0.5,
                "truncated": 0,
                "loss_masks": torch.tensor(loss_mask, dtype=torch.int32),
                "rollout_ids": k,
                "rollout_mask_sums": torch.tensor(float(sum(loss_mask))),
                "rollout_log_probs": torch.tensor(rollout_lp, dtype=torch.float32),
                "source_names": "unknown",
                "total_lengths": len(s.token_ids),
                "local_raw_reward": 1.0,
                "log_probs": train_lp,  # Megatron's, every response token (tool tokens too)
                "kl": torch.zeros(r),
                "advantages": torch.zeros(r),
                "returns": torch.zeros(r),
            }
        )
    rollout = directory / "rollout_data" / f"{rollout_id}.pt"
    torch.save({"rollout_id": rollout_id, "samples": samples}, rollout)
    if train:
        (directory / "train_data").mkdir(exist_ok=True)
        torch.save(
            {
                "format_version": 2,
                "rollout_id": rollout_id,
                "rank": 0,
                "samples": train_samples,
                "dp_shards": [{"rank": 0, "data_parallel_rank": 0, "sample_indices": list(range(len(samples)))}],
                "raw_reward": [1.0] * len(samples),
            },
            directory / "train_data" / f"{rollout_id}.pt",
        )
    return rollout


def _slime_sample(k: int, s: Sequence, loss_mask: list, rollout_lp: list, experts) -> dict:
    return {
        "group_index": int(s.prompt_id.rsplit("-", 1)[-1]),
        "index": k,
        "rollout_id": None,
        "prompt": "",
        "tokens": s.token_ids.tolist(),
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {},
        "response": "",
        "response_length": s.response_len,
        "label": None,
        "reward": 1.0,
        "loss_mask": loss_mask,
        "weight_versions": ["3"],
        "rollout_log_probs": rollout_lp,
        "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        "rollout_routed_experts": experts,
        "remove_sample": False,
        "teacher_log_probs": None,
        "status": "completed",
        "metadata": {},
        "generate_function_path": None,
        "custom_rm_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {
            "spec_accept_token_num": 0,
            "spec_draft_token_num": 0,
            "spec_verify_ct": 0,
            "completion_token_num": 0,
        },
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": s.prompt_len},
    }


# ---- generic (docs/dump-format.md) ------------------------------------------------------------


def write_generic(step: Step, path: Path, *, trainer: bool = True, compact: bool = False) -> Path:
    """Parquet or JSON Lines by suffix; ``compact``: log-probs one per model token, else full length."""
    rows = []
    for s in step.sequences:
        pick = (lambda a: a[s.model_mask]) if compact else (lambda a: a)
        row = {
            "token_ids": s.token_ids.tolist(),
            "model_mask": s.model_mask.astype(int).tolist(),
            "logp_engine": [None if np.isnan(x) else float(x) for x in pick(s.logp_engine)],
            "prompt_id": s.prompt_id,
        }
        if trainer:
            row["logp_trainer"] = [None if np.isnan(x) else float(x) for x in pick(s.logp_trainer)]
        if s.experts is not None:
            row["routed_experts"] = s.experts.tolist()
        rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- NeMo-RL (nemo_rl/algorithms/grpo.py grpo_train, nemo_rl/utils/logger.py) ----------------------

ENV_IDS = [30, 31, 32]  # the environment's closing message ("Environment: correct"), loss mask 0


def write_nemo_rl(
    step: Step, directory: Path, n: int = 4, *, forced_on_policy: bool = False, divisible_by: int = 4
) -> Path:
    """``train_data_step{n}.jsonl`` as ``log_batched_dict_as_jsonl`` writes it: one line per sample,
    each value with the batch's leading dimension of 1, right-padded to the batch's longest row
    (rounded up to ``divisible_by``), log-probs at the position of their token (index 0: 0.0)."""
    flat = []
    for s in step.sequences:
        ids = s.token_ids.tolist() + ENV_IDS
        mask = s.model_mask.astype(int).tolist() + [0] * len(ENV_IDS)
        gen = np.where(s.model_mask, s.logp_engine, 0.0).tolist() + [0.0] * len(ENV_IDS)
        prev = np.where(s.model_mask, s.logp_trainer, -2.5).tolist() + [-4.0] * len(ENV_IDS)
        prev[0] = 0.0
        if forced_on_policy:
            prev = [0.0] * len(ids)
        flat.append((ids, mask, gen, prev))
    width = -(-max(len(f[0]) for f in flat) // divisible_by) * divisible_by

    def pad(xs, v):
        return xs + [v] * (width - len(xs))

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"train_data_step{n}.jsonl"
    with open(path, "w") as fh:
        for i, (ids, mask, gen, prev) in enumerate(flat):
            row = {
                "content": [["<prompt>", "<response>", "Environment: correct"]],
                "rewards": [1.0],
                "input_lengths": [len(ids)],
                "token_ids": [pad(ids, 0)],
                "token_loss_mask": [pad(mask, 0)],
                "sample_loss_mask": [1.0],
                "advantages": [[0.5] * width],
                "generation_logprobs": [pad(gen, 0.0)],
                "prev_logprobs": [pad(prev, 0.0)],
                "idx": i,
            }
            fh.write(json.dumps(row, default=str) + "\n")
    return path


# ---- verl (verl/experimental/agent_loop/agent_loop.py _postprocess; verl/utils/skip/rollout_skip.py) --

VERL_PAD = 0  # tokenizer.pad_token_id: prompts are left-padded and responses right-padded with it


def verl_site() -> str | None:
    """Where verl is for the dump builder: $MISMATCH_PROBE_VERL_SITE, or what install-verl.sh made."""
    import os

    site = os.environ.get("MISMATCH_PROBE_VERL_SITE") or str(Path(__file__).resolve().parents[2] / ".verl-site")
    return site if (Path(site) / "verl" / "protocol.py").is_file() else None


def write_verl(
    step: Step, root: Path, gen_step: int = 2, *, old_log_probs: bool = False, numpy_serialization: bool = False
) -> Path:
    """verl 0.9's rollout cache of ``step``, built and saved by verl's own DataProto (in a process
    with verl on its path): ``{root}/exp_proj/GBS{b}_N2_in{P}_out{R}/{gen_step}/gen_batch.dp``.
    ``numpy_serialization``: as with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``."""
    import os
    import subprocess
    import sys
    import tempfile

    site = verl_site()
    if site is None:
        raise RuntimeError("verl is not installed for the tests: bash tests/dumps/install-verl.sh")
    arrays, uids, out = verl_batch(step, root, gen_step, old_log_probs=old_log_probs)
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "arrays.npz", **arrays)
        (Path(tmp) / "uids.json").write_text(json.dumps(uids))
        builder = str(Path(__file__).with_name("verl_dump.py"))
        args = [sys.executable, builder, f"{tmp}/arrays.npz", f"{tmp}/uids.json", str(out)]
        env = {**os.environ, "PYTHONPATH": site}
        if numpy_serialization:
            env["VERL_DATAPROTO_SERIALIZATION_METHOD"] = "numpy"
        subprocess.run(args, check=True, env=env, timeout=300)
    return root


def verl_batch(
    step: Step, root: Path, gen_step: int = 2, *, old_log_probs: bool = False
) -> tuple[dict[str, np.ndarray], list[str], Path]:
    """The tensors of ``step``'s batch as the agent loop pads them, its uids, and where RolloutSkip saves it."""
    seqs = step.sequences
    width_p = max(s.prompt_len for s in seqs) + 3  # rollout.prompt_length: more than the longest
    width_r = max(s.response_len for s in seqs) + 5
    b = len(seqs)
    prompts = np.full((b, width_p), VERL_PAD, np.int64)
    responses = np.full((b, width_r), VERL_PAD, np.int64)
    attention = np.zeros((b, width_p + width_r), np.int64)
    response_mask = np.zeros((b, width_r), np.int64)
    rollout_lp = np.zeros((b, width_r), np.float32)
    trainer_lp = np.zeros((b, width_r), np.float32)
    routed = None
    if seqs[0].experts is not None:
        routed = np.zeros((b, width_p + width_r, *seqs[0].experts.shape[1:]), np.int16)
    for i, s in enumerate(seqs):
        p, r = s.prompt_len, s.response_len
        prompts[i, width_p - p :] = s.token_ids[:p]
        responses[i, :r] = s.token_ids[p:]
        attention[i, width_p - p : width_p + r] = 1
        response_mask[i, :r] = s.model_mask[p:]
        rollout_lp[i, :r] = np.where(s.model_mask, s.logp_engine, 0.0)[p:]  # tool tokens: 0.0
        trainer_lp[i, :r] = np.where(s.model_mask, s.logp_trainer, -1.0)[p:]
        if routed is not None:  # rows from the left padding on: the prompt and all but the last token
            routed[i, width_p - p : width_p - p + len(s.experts)] = s.experts
    position = np.clip(np.cumsum(attention, -1) - 1, 0, None)
    arrays = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": position,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_lp,
        "__num_turns__": np.array([2 + 2 * (int(s.model_mask[:-1].sum()) != 0) for s in seqs], np.int32),
    }
    if old_log_probs:
        arrays["old_log_probs"] = trainer_lp
    if routed is not None:
        arrays["routed_experts"] = routed
    out = root / "exp_proj" / f"GBS{b // 2}_N2_in{width_p}_out{width_r}" / str(gen_step) / "gen_batch.dp"
    return arrays, [s.prompt_id for s in seqs], out


# ---- prime-rl (prime_rl/transports/rollouts/{types,filesystem}.py, prime_rl/trainer/batch.py,
# prime_rl/trainer/rl/token_export.py, at 559b447) -------------------------------------------------


class PrimeEncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class PrimeRoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]  # [seq_len, layers, topk]
    dtype: str


class PrimeMicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """prime-rl's ``MicroBatch``, as declared (the order is the wire format)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: PrimeRoutedExperts | None = None
    mm_kwargs: dict[str, PrimeEncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


PRIME_ENV = "reverse-text"


def write_prime_rl(
    step: Step,
    directory: Path,
    step_number: int,
    *,
    ranks: int = 2,
    seq_len: int | None = None,
    pad_to_multiple_of: int = 8,
    export: bool = True,
    rollouts: bool = True,
    ce_only: int = 0,
    vocab_size: int = 1024,
) -> Path:
    """prime-rl's ``output_dir`` after step ``step_number``: the orchestrator's
    ``rollouts/step_N/rank_r.bin`` (filesystem transport) and the trainer's
    ``token_exports/step_N/rank_r.jsonl`` with ``STABLE``. Each sequence becomes a sample as
    ``prepare_sample`` makes it, packed first-fit decreasing into micro-batches of ``seq_len``
    tokens (``packed_samples_into_micro_bs``), padded to ``pad_to_multiple_of``
    (``pad_micro_batch``) and dealt to ``ranks`` data ranks, the count evened out with zero-loss
    copies (``_make_dummy_batch``); the ranks' split is round-robin, not prime-rl's
    Karmarkar-Karp (nothing read depends on it). ``ce_only``: the first that many samples train
    their tokens as cross-entropy alone (``sft_distill``'s routing: rl weight 0, ce weight 1)."""
    import copy

    seq_len = seq_len or 2 * max(len(s.token_ids) for s in step.sequences)
    samples = []
    for k, s in enumerate(step.sequences):
        n = len(s.token_ids)
        mask = s.model_mask.tolist()
        routed = None
        if s.experts is not None:  # verifiers' Branch.routed_experts: uint8, one row per token
            rows = np.zeros((n, *s.experts.shape[1:]), np.uint8)
            rows[: len(s.experts)] = s.experts
            routed = PrimeRoutedExperts(rows.tobytes(), list(rows.shape), "uint8")
        mb = PrimeMicroBatch(
            input_ids=s.token_ids.tolist(),
            loss_mask=mask,
            advantages=[0.5 if m else 0.0 for m in mask],  # the rollout's scalar over its sampled tokens
            inference_logprobs=np.where(s.model_mask, s.logp_engine, 0.0).astype(float).tolist(),
            position_ids=list(range(n)),
            sequence_lengths=[n],
            temperatures=[step.temperature] * n,  # TrainSink.process_group: the env's temperature
            env_names=[PRIME_ENV] * n,
            seq_lens=[n],
            routed_experts=routed,
        )
        if k < ce_only:  # stamp_loss_routing(sample, "ce")
            mb.rl_weights = [0.0] * n
            mb.ce_weights = [1.0 if m else 0.0 for m in mask]
        samples.append((mb, s))

    # first-fit decreasing, never splitting a sample
    samples.sort(key=lambda x: -len(x[0].input_ids))
    bins: list[list[tuple[PrimeMicroBatch, Sequence]]] = []
    for item in samples:
        for b in bins:
            if sum(len(x[0].input_ids) for x in b) + len(item[0].input_ids) <= seq_len:
                b.append(item)
                break
        else:
            bins.append([item])
    packed = [_prime_pack(b, pad_to_multiple_of) for b in bins]
    while len(packed) % ranks:
        dummy = copy.deepcopy(packed[0])
        dummy[0].advantages = [0.0] * len(dummy[0].input_ids)
        dummy[0].loss_mask = [False] * len(dummy[0].input_ids)
        packed.append(dummy)
    per_rank = [packed[r::ranks] for r in range(ranks)]

    encoder = msgspec.msgpack.Encoder()
    if rollouts:
        out = directory / "rollouts" / f"step_{step_number}"
        out.mkdir(parents=True, exist_ok=True)
        for r, batches in enumerate(per_rank):
            tmp = out / f"rank_{r}.bin.tmp"
            tmp.write_bytes(encoder.encode([mb for mb, _ in batches]))
            tmp.rename(out / f"rank_{r}.bin")
    if export:
        out = directory / "token_exports" / f"step_{step_number}"
        out.mkdir(parents=True, exist_ok=True)
        for r, batches in enumerate(per_rank):
            exported = 0
            with open(out / f"rank_{r}.jsonl", "w") as fh:
                for micro_step, (mb, trainer) in enumerate(batches):
                    for line in _prime_export_lines(mb, trainer, step_number, r, micro_step, vocab_size):
                        fh.write(json.dumps({**line, "export_sequence_idx": exported}, separators=(",", ":")))
                        fh.write("\n")
                        exported += 1
        (out / "STABLE").touch()  # TokenExporter.mark_stable, after every rank flushed
    return directory


def _prime_pack(items: list, pad_to_multiple_of: int) -> tuple[PrimeMicroBatch, np.ndarray]:
    """``_materialize_bin`` then ``pad_micro_batch``; with the trainer's per-token log-probs of the
    packed row (the simulation's float32 forward), for the export."""
    first = items[0][0]
    mb = PrimeMicroBatch(
        **{f: [] for f in ("input_ids", "loss_mask", "advantages", "inference_logprobs")},
        position_ids=[],
        sequence_lengths=[],
        temperatures=[],
        env_names=[],
        seq_lens=[],
    )
    mb.routed_experts = (
        None if first.routed_experts is None else PrimeRoutedExperts(b"", [0, *first.routed_experts.shape[1:]], "uint8")
    )
    streams = any(x[0].rl_weights is not None for x in items)
    if streams:
        mb.rl_weights, mb.ce_weights = [], []
    trainer = []
    for sample, s in items:
        n = len(sample.input_ids)
        for f in (
            "input_ids",
            "loss_mask",
            "advantages",
            "inference_logprobs",
            "position_ids",
            "temperatures",
            "env_names",
        ):
            getattr(mb, f).extend(getattr(sample, f))
        mb.sequence_lengths.append(n)
        mb.seq_lens.append(n)
        if streams:  # STREAM_FILL: rl 1.0, ce 0.0 for a sample without the stream
            mb.rl_weights.extend(sample.rl_weights if sample.rl_weights is not None else [1.0] * n)
            mb.ce_weights.extend(sample.ce_weights if sample.ce_weights is not None else [0.0] * n)
        if mb.routed_experts is not None:
            mb.routed_experts.data += sample.routed_experts.data
            mb.routed_experts.shape[0] += n
        # the trainer's log-prob of every token: off the sampled ones, whatever its forward gave
        lp = np.where(s.model_mask, s.logp_trainer, -3.0).astype(np.float32)
        lp[0] = -6.5  # shifted in from the previous sample's last position: never a sampled token
        trainer.append(lp)
    pad = (pad_to_multiple_of - len(mb.input_ids) % pad_to_multiple_of) % pad_to_multiple_of
    if pad:
        mb.input_ids += [1] * pad
        mb.advantages += [0.0] * pad
        mb.loss_mask += [False] * pad
        mb.position_ids += list(range(pad))
        mb.sequence_lengths[-1] += pad
        mb.seq_lens[-1] += pad
        mb.inference_logprobs += [0.0] * pad
        mb.temperatures += [1.0] * pad
        if streams:
            mb.rl_weights += [0.0] * pad
            mb.ce_weights += [0.0] * pad
        if mb.routed_experts is not None:
            row = int(np.prod(mb.routed_experts.shape[1:]))
            mb.routed_experts.data += b"\0" * (pad * row)
            mb.routed_experts.shape[0] += pad
        mb.env_names += [""] * pad
        trainer.append(np.full(pad, -4.0, np.float32))
    return mb, np.concatenate(trainer)


def _prime_export_lines(
    mb: PrimeMicroBatch, trainer: np.ndarray, step: int, rank: int, micro_step: int, vocab_size: int
):
    """``TokenExporter.export`` of one micro-batch: its columns as the trainer holds them (float32),
    one line per sequence with a loss-mask token, padding trimmed."""
    n = len(mb.input_ids)

    def f32(values) -> list[float]:  # the trainer's tensors are float32; tolist() widens them exactly
        return [float(x) for x in np.asarray(values, np.float32)]

    trainer = trainer.copy()
    trainer[0] = np.log(1.0 / vocab_size)  # shift_tensor_right's pad value
    inference = np.asarray(mb.inference_logprobs, np.float32)
    log_ratio = trainer - inference
    columns = {
        "token_ids": list(mb.input_ids),
        "position_ids": list(mb.position_ids),
        "loss_mask": list(mb.loss_mask),
        "advantages": f32(mb.advantages),
        "inference_logprobs": f32(inference),
        "trainer_logprobs": f32(trainer),
        "entropy": f32(np.full(n, 1.25)),
        "mismatch_kl": f32(np.exp(log_ratio) - log_ratio - 1),
        "log_importance_ratio": f32(log_ratio),
        "importance_ratio": f32(np.exp(log_ratio)),
        "prob_delta": f32(np.exp(trainer) - np.exp(inference)),
        "is_masked": [False] * n,
        "is_masked_high": [False] * n,
        "is_masked_low": [False] * n,
        "rl_weights": f32(mb.rl_weights) if mb.rl_weights is not None else [None] * n,
        "ce_weights": f32(mb.ce_weights) if mb.ce_weights is not None else [None] * n,
        "ref_kl_weights": [None] * n,
    }
    start = 0
    for idx, length in enumerate(mb.sequence_lengths):
        end = start + length
        while end > start and mb.env_names[end - 1] == "" and not mb.loss_mask[end - 1]:  # _trim_padding
            end -= 1
        if end > start and any(mb.loss_mask[start:end]):
            yield {
                "schema_version": 1,
                "step": step,
                "rank": rank,
                "micro_step": micro_step,
                "micro_sequence_idx": idx,
                "env_name": next((e for e in mb.env_names[start:end] if e), None),
                **{key: values[start:end] for key, values in columns.items()},
            }
        start += length
