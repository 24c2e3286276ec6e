"""Rebuild the example dumps in this directory: one RL step on the fixture model (4 prompts x 2
samples, every other one calling a tool between two turns; bf16 "engine" and fp32 "trainer"
log-probs from real forwards), written as each framework writes it.

    .venv/bin/python examples/dumps/make_examples.py     # verl's needs bash tests/dumps/install-verl.sh

Import any of them (docs/how-to/import.md):

    mismatch-probe import slime examples/dumps/slime --model fixtures/models/tiny-qwen2
    mismatch-probe import nemo-rl examples/dumps/nemo-rl --model fixtures/models/tiny-qwen2
    mismatch-probe import verl examples/dumps/verl --model fixtures/models/tiny-qwen2 --trust-pickle
    mismatch-probe import generic examples/dumps/generic/step.parquet --model fixtures/models/tiny-qwen2
"""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "dumps")]

from training_run import simulate, write_generic, write_nemo_rl, write_slime, write_verl

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    step = simulate(ROOT / "fixtures" / "models" / "tiny-qwen2", ROOT / "fixtures" / "prompts" / "single_turn.jsonl")
    for name in ("slime", "nemo-rl", "verl", "generic"):
        shutil.rmtree(here / name, ignore_errors=True)
    write_slime(step, here / "slime", rollout_id=3)  # --dump-details: rollout_data/3.pt, train_data/3.pt
    (here / "slime" / "tokenizer").mkdir()  # and the tokenizer, which import checks against --model's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "fixtures" / "models" / "tiny-qwen2" / name, here / "slime" / "tokenizer" / name)
    write_nemo_rl(step, here / "nemo-rl", 3)  # train_data_step3.jsonl
    write_verl(step, here / "verl", 3, old_log_probs=True)  # <exp>/<GBS..>/3/gen_batch.dp, after compute_log_prob
    write_generic(step, here / "generic" / "step.parquet")
    write_generic(step, here / "generic" / "step.jsonl", compact=True)
    print("\n".join(str(p.relative_to(ROOT)) for p in sorted(here.rglob("*")) if p.is_file()))
