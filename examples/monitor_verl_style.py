"""Where ``mismatch_probe.Monitor`` goes in a verl PPO/GRPO loop, and what it reads from the batch.

verl's driver (``RayPPOTrainer.fit`` in ``verl/trainer/ppo/ray_trainer.py``, checked against verl
0.9.1) holds the whole step's ``DataProto`` between the workers' calls: after the rollout the batch
has ``responses``, ``response_mask`` and, with the rollout's log-probs kept
(``actor_rollout_ref.rollout.calculate_log_probs=True``), ``rollout_log_probs``; after

    old_log_prob, _ = self._compute_old_log_prob(batch)   # the actor's compute_log_prob
    batch = batch.union(old_log_prob)

it also has ``old_log_probs``, the trainer's log-probs of the same tokens: the place where verl
itself compares the two (``calculate_debug_metrics(batch)``, its ``training/rollout_probs_diff_*``)
is the place to log the step::

    if "rollout_log_probs" in batch.batch.keys():
        log_verl_batch(self.mismatch_monitor, batch, self.global_steps)

with ``self.mismatch_monitor = Monitor(...)`` made in ``__init__`` (or before ``fit``) and closed
after the loop. The driver is one process, so there is no rank to think about, and the batch is
already gathered from every data-parallel worker. All arrays are response-aligned ``[B,
response_length]``: log-prob t is that of response token t; ``response_mask`` is 0 on padding and,
in multi-turn agent loops, on tool output, so each run of 1s is one assistant turn. In bypass mode
(``rollout_correction.bypass_mode``) verl sets ``old_log_probs`` to the rollout's: there is no
trainer side to compare, so log before that or not at all.

Both sides must describe one distribution: verl's actor divides the logits by the rollout
temperature; the rollout's log-probs must be of the processed distribution as well
(``actor_rollout_ref.rollout.logprobs_mode=processed_logprobs``, verl's default), or the mismatch
measured is the temperature's.

Run it here to see the call on verl-shaped batches from the fixture model (no verl needed):

    python examples/monitor_verl_style.py --out reports/monitor-verl-demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mismatch_probe import Monitor


def log_verl_batch(monitor: Monitor, batch: Any, step: int) -> dict | None:
    """Log one verl step: ``batch`` is the ``DataProto`` after ``batch.union(old_log_prob)``."""
    data = batch.batch  # a TensorDict: tensors [B, response_length] on the driver
    return monitor.log_step(
        step,
        data["responses"],
        logp_infer=data["rollout_log_probs"],  # the rollout engine's (vLLM / SGLang)
        logp_train=data["old_log_probs"],  # the actor's compute_log_prob, before the update
        mask=data["response_mask"],
    )


class DataProtoLike:
    """What the example needs of verl's ``DataProto``: ``.batch`` (a TensorDict there) and ``.meta_info``."""

    def __init__(self, batch: dict, meta_info: dict | None = None) -> None:
        self.batch = batch
        self.meta_info = meta_info or {}


def demo(out: Path, steps: int = 2) -> Path:
    """verl-shaped batches from the fixture model (examples/monitor_plain_loop.py's engine and
    trainer), logged as the driver would log them."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import monitor_plain_loop as loop

    torch.manual_seed(0)
    tok, trainer, engine = loop.load()
    with Monitor(out) as monitor:
        for global_steps in range(1, steps + 1):  # verl counts steps from 1
            ids, enc = loop.prompts(tok, 4, offset=4 * global_steps)
            full = loop.rollout(engine, tok, ids, enc, n=2, max_new_tokens=24)
            with torch.no_grad():
                full.logp_train = loop.trainer_logprobs(trainer, full)
            p = enc["input_ids"].shape[1]  # verl's prompts are left-padded to one width, responses right-padded
            batch = DataProtoLike(
                {
                    "prompts": full.token_ids[:, :p],
                    "responses": full.token_ids[:, p:],
                    "response_mask": full.mask[:, p:].long(),
                    "rollout_log_probs": full.logp_infer[:, p:],
                    "old_log_probs": full.logp_train[:, p:],
                },
                {"global_steps": global_steps},
            )
            row = log_verl_batch(monitor, batch, global_steps)
            if row is not None:
                print(f"step {global_steps}: K3 {row['k3_kl']:.3g}, max |dp| {row['prob_diff_max']:.3g}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports") / "monitor-verl-demo")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    print(f"timeline: {demo(args.out, args.steps) / 'timeline.html'}")
