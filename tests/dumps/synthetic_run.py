"""A synthetic RL run of many steps, with the mismatch drifting from a known step, in each dump format.

Each step is a batch of sequences (a prompt, a response, every other one with a tool call inside it)
whose trainer log-probs are the engine's plus Gaussian noise of standard deviation sigma_t, so the
step's K3 is about sigma_t^2 / 2. sigma_t^2 varies from step to step (a real run's policy moves
every step, so its steps differ by more than their sampling noise) and, from ``drift_at`` on, is
``factor`` times larger (``ramp``: grows linearly to ``factor`` over ``ramp`` steps). The writers
are the import tests' (training_run.py), so each format is laid out as its framework writes it.

    python tests/dumps/synthetic_run.py OUT --format generic --steps 200 --drift-at 120 [--factor 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_run import (
    Sequence,
    Step,
    verl_batch,
    verl_site,
    write_generic,
    write_nemo_rl,
    write_prime_rl,
    write_slime,
)

FORMATS = ("generic", "nemo-rl", "slime", "verl", "prime-rl")
PROMPT_LEN, RESPONSE_LEN = 16, 32
BASE_SIGMA = 0.02  # K3 about 2e-4: a bf16 rollout's order of magnitude


def synthetic_run(
    n_steps: int = 200,
    *,
    drift_at: int | None = None,
    factor: float = 3.0,
    ramp: int = 0,
    n_sequences: int = 32,
    jitter: float = 0.15,
    seed: int = 0,
    first_step: int = 1,
) -> dict[int, Step]:
    """Steps ``first_step`` .. ``first_step + n_steps - 1``; the mismatch's variance is multiplied by
    ``factor`` from step ``drift_at`` on (reached linearly over ``ramp`` steps)."""
    rng = np.random.default_rng(seed)
    steps = {}
    for k in range(n_steps):
        number = first_step + k
        variance = BASE_SIGMA**2 * np.exp(jitter * rng.standard_normal())
        if drift_at is not None and number >= drift_at:
            grown = min(1.0, (number - drift_at + 1) / ramp) if ramp else 1.0
            variance *= 1.0 + (factor - 1.0) * grown
        sequences = []
        for j in range(n_sequences):
            ids = rng.integers(0, 1000, PROMPT_LEN + RESPONSE_LEN)
            mask = np.r_[np.zeros(PROMPT_LEN, bool), np.ones(RESPONSE_LEN, bool)]
            if j % 2:  # a tool's output inside the response: a second assistant turn after it
                mask[PROMPT_LEN + 12 : PROMPT_LEN + 17] = False
            engine = -rng.exponential(1.0, len(ids))
            trainer = np.minimum(engine + rng.normal(0.0, np.sqrt(variance), len(ids)), -1e-6)
            engine[~mask], trainer[~mask] = np.nan, np.nan
            sequences.append(
                Sequence(
                    f"p-{j // 4}",
                    PROMPT_LEN,
                    ids.astype(np.int64),
                    mask,
                    engine.astype(np.float32),
                    trainer.astype(np.float32),
                )
            )
        steps[number] = Step(sequences)
    return steps


def write_run(fmt: str, steps: dict[int, Step], directory: Path) -> Path:
    """The steps as ``fmt``'s framework lays a run's dumps out; returns the path to give ``timeline``."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "generic":
        for number, step in steps.items():
            write_generic(step, directory / f"step_{number}.parquet")
        return directory
    if fmt == "nemo-rl":
        for number, step in steps.items():
            write_nemo_rl(step, directory, n=number)
        return directory
    if fmt == "slime":
        for number, step in steps.items():
            write_slime(step, directory, rollout_id=number)
        return directory
    if fmt == "verl":
        return write_verl_steps(steps, directory)
    if fmt == "prime-rl":
        for number, step in steps.items():
            write_prime_rl(step, directory, number)
        return directory
    raise ValueError(f"unknown format {fmt}")


def write_verl_steps(steps: dict[int, Step], root: Path) -> Path:
    """verl 0.9's rollout cache of every step (``.../GBS{b}_N2_in{P}_out{R}/{step}/gen_batch.dp``),
    saved by verl's own DataProto in one process (training_run.write_verl starts one per step)."""
    site = verl_site()
    if site is None:
        raise RuntimeError("verl is not installed for the tests: bash tests/dumps/install-verl.sh")
    with tempfile.TemporaryDirectory() as tmp:
        args = []
        for number, step in steps.items():
            arrays, uids, out = verl_batch(step, root, gen_step=number, old_log_probs=True)
            np.savez(Path(tmp) / f"{number}.npz", **arrays)
            (Path(tmp) / f"{number}.json").write_text(json.dumps(uids))
            args += [f"{tmp}/{number}.npz", f"{tmp}/{number}.json", str(out)]
        builder = str(Path(__file__).with_name("verl_dump.py"))
        subprocess.run(
            [sys.executable, builder, *args], check=True, env={**os.environ, "PYTHONPATH": site}, timeout=600
        )
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=FORMATS, default="generic")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--drift-at", type=int, default=None)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--ramp", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = synthetic_run(args.steps, drift_at=args.drift_at, factor=args.factor, ramp=args.ramp, seed=args.seed)
    path = write_run(args.format, steps, args.out)
    print(json.dumps({"path": str(path), "steps": len(steps), "drift_at": args.drift_at, "factor": args.factor}))


if __name__ == "__main__":
    main()
