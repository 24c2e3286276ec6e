"""``mismatch_probe.Monitor`` in TRL's ``GRPOTrainer``, as a ``transformers.TrainerCallback``.

With ``GRPOConfig(use_vllm=True)`` TRL keeps both sides of the mismatch in the batch that
``GRPOTrainer._generate_and_score_completions`` returns (checked against TRL v1.9.0 and its main
branch, 1.10.0.dev0: ``trl/trainer/grpo_trainer.py``):

- ``sampling_per_token_logps``: vLLM's log-prob of each completion token (``[B, C]``, padded with 0);
- ``old_per_token_logps``: the policy's, recomputed before the update; TRL computes it whenever
  ``vllm_importance_sampling_correction`` is on (its default), or when generation and optimizer
  steps are misaligned;
- ``completion_ids``, ``completion_mask`` and, in multi-turn tool loops, ``tool_mask`` (0 on a
  tool's output): the tokens the policy generated are ``completion_mask * tool_mask``.

A callback is not handed the batch, so :meth:`MismatchMonitorCallback.attach` wraps the trainer's
``_generate_and_score_completions`` to keep what it returns; ``on_step_end`` logs it under the
optimizer step that consumed it, and ``on_train_end`` closes the monitor::

    from trl import GRPOConfig, GRPOTrainer
    from mismatch_probe import Monitor

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, ...), train_dataset=...)
    MismatchMonitorCallback(Monitor("reports/grpo-timeline", wandb=True)).attach(trainer)
    trainer.train()

With several processes (accelerate), each generates its own share of the batch: the monitor on
rank 0 logs rank 0's share (a sample of the step; the other ranks' monitors do nothing), or pass
``Monitor(f"reports/grpo-timeline/rank{rank}", rank_zero_only=False)`` to keep every rank's.
Both sides describe one distribution: TRL's per-token log-probs divide the logits by
``temperature``, and TRL starts vLLM with ``logprobs_mode="processed_logprobs"``
(``trl/generation/vllm_generation.py``, ``trl/scripts/vllm_serve.py``).

``python examples/monitor_trl_callback.py`` runs the callback against a stand-in trainer that
returns TRL-shaped batches (TRL itself is not needed for that).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from mismatch_probe import Monitor


class MismatchMonitorCallback(TrainerCallback):
    """Logs each training batch TRL's GRPOTrainer generates to a :class:`~mismatch_probe.Monitor`."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.pending: list[dict[str, Any]] = []
        self.trainer: Any = None

    def attach(self, trainer: Any) -> MismatchMonitorCallback:
        """Keep every training batch ``trainer`` generates, and register as its callback."""
        generate = trainer._generate_and_score_completions
        self.trainer = trainer

        def generate_and_keep(*args: Any, **kwargs: Any) -> dict[str, Any]:
            output = generate(*args, **kwargs)
            if trainer.model.training and "sampling_per_token_logps" in output and "old_per_token_logps" in output:
                self.pending.append(output)
            return output

        trainer._generate_and_score_completions = generate_and_keep
        trainer.add_callback(self)
        return self

    def on_step_end(self, args, state, control, **kwargs):
        for output in self.pending:
            mask = output["completion_mask"]
            if output.get("tool_mask") is not None:
                mask = mask * output["tool_mask"]
            self.monitor.log_step(
                state.global_step,
                output["completion_ids"],
                logp_infer=output["sampling_per_token_logps"],
                logp_train=output["old_per_token_logps"],
                mask=mask,
            )
        self.pending.clear()

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.close()


class _StandInTrainer:
    """What the callback touches of a GRPOTrainer, returning TRL-shaped batches from the fixture
    model (examples/monitor_plain_loop.py's engine and trainer)."""

    def __init__(self) -> None:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import monitor_plain_loop as loop

        self.loop = loop
        self.tok, self.model, self.engine = loop.load()
        self.model.train()
        self.callbacks: list[TrainerCallback] = []
        self.calls = 0

    def add_callback(self, callback: TrainerCallback) -> None:
        self.callbacks.append(callback)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self.calls += 1
        ids, enc = self.loop.prompts(self.tok, 4, offset=4 * self.calls)
        full = self.loop.rollout(self.engine, self.tok, ids, enc, n=2, max_new_tokens=24)
        with torch.no_grad():
            logp = self.loop.trainer_logprobs(self.model, full)
        p = enc["input_ids"].shape[1]
        return {
            "prompt_ids": full.token_ids[:, :p],
            "prompt_mask": full.attention[:, :p].long(),
            "completion_ids": full.token_ids[:, p:],
            "completion_mask": full.mask[:, p:].long(),
            "sampling_per_token_logps": full.logp_infer[:, p:],
            "old_per_token_logps": logp[:, p:],
        }


def demo(out: Path, steps: int = 2) -> Path:
    from types import SimpleNamespace

    torch.manual_seed(0)
    trainer = _StandInTrainer()
    callback = MismatchMonitorCallback(Monitor(out)).attach(trainer)
    state = SimpleNamespace(global_step=0)
    for _ in range(steps):  # what Trainer.train does around the callback, per optimizer step
        trainer._generate_and_score_completions({})
        state.global_step += 1
        callback.on_step_end(None, state, None)
    callback.on_train_end(None, state, None)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports") / "monitor-trl-demo")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    print(f"timeline: {demo(args.out, args.steps) / 'timeline.html'}")
