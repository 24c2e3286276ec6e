"""A plain PyTorch RL loop that logs its training-inference mismatch with ``mismatch_probe.Monitor``.

The "engine" is a bfloat16 copy of the policy that samples the responses (and reports the
log-prob of each token it sampled, as vLLM and SGLang do); the trainer is the float32 policy,
which recomputes the same tokens' log-probs in its forward before the update. Each step: sample,
score, hand both sides to the monitor, take one REINFORCE step, copy the new weights into the
engine. Runs on a CPU in seconds with the repository's fixture model:

    python examples/monitor_plain_loop.py --out reports/monitor-demo [--steps 6] [--tensorboard]

then open ``reports/monitor-demo/timeline.html``, or gate it: ``mismatch-probe gate reports/monitor-demo``.
The monitor's part is three lines: make it, ``log_step`` once per step, close it (``with``).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch_probe import Monitor

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
PROMPTS = ROOT / "fixtures" / "prompts" / "single_turn.jsonl"


@dataclass
class Batch:
    """One step's sequences, padded to ``[B, T]``: prompts left-padded, responses right-padded."""

    token_ids: torch.Tensor  # long
    attention: torch.Tensor  # bool: not padding
    mask: torch.Tensor  # bool: the tokens the policy generated (the response, up to its end of turn)
    logp_infer: torch.Tensor  # float32: the engine's log-prob of each generated token, at its position
    logp_train: torch.Tensor  # float32: the trainer's, from the forward the update takes its gradient from
    prompt_ids: list[str]


def load(model: Path = MODEL):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    trainer = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    engine = copy.deepcopy(trainer).to(torch.bfloat16).eval()
    return tok, trainer, engine


def prompts(tok, n: int, offset: int) -> tuple[list[str], dict]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    picked = [rows[(offset + i) % len(rows)] for i in range(n)]
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in picked]
    return [r["id"] for r in picked], tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@torch.no_grad()
def rollout(engine, tok, ids: list[str], enc: dict, *, n: int, max_new_tokens: int) -> Batch:
    """Sample ``n`` responses per prompt with the engine (KV cache, plain sampling at temperature 1),
    keeping the log-prob of each token it sampled from its own bfloat16 logits; the trainer's
    log-probs are filled in later."""
    input_ids = enc["input_ids"].repeat_interleave(n, 0)
    attention = enc["attention_mask"].repeat_interleave(n, 0).bool()
    b = input_ids.shape[0]
    position = (attention.long().cumsum(1) - 1).clamp(min=0)
    live = torch.ones(b, dtype=torch.bool)  # not yet ended
    tokens, logps, lives = [], [], []
    past, step_ids, step_pos = None, input_ids, position
    for _ in range(max_new_tokens):
        out = engine(
            input_ids=step_ids,
            attention_mask=attention.long(),
            position_ids=step_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logp = torch.log_softmax(out.logits[:, -1].float(), -1)
        token = torch.multinomial(logp.exp(), 1)[:, 0]
        token = torch.where(live, token, tok.pad_token_id)
        tokens.append(token)
        logps.append(torch.where(live, logp.gather(-1, token[:, None])[:, 0], 0.0))
        lives.append(live)
        live = live & (token != tok.eos_token_id)  # the end-of-turn token is the response's last
        if not live.any():
            break
        attention = torch.cat([attention, lives[-1][:, None]], 1)
        step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
    mask = torch.stack(lives, 1)
    token_ids = torch.cat([input_ids, torch.stack(tokens, 1)], 1)
    prompt = enc["attention_mask"].repeat_interleave(n, 0).bool()
    return Batch(
        token_ids=token_ids,
        attention=torch.cat([prompt, mask], 1),
        mask=torch.cat([torch.zeros_like(prompt), mask], 1),
        logp_infer=torch.cat([torch.zeros(prompt.shape), torch.stack(logps, 1)], 1),
        logp_train=torch.zeros(token_ids.shape),
        prompt_ids=[i for i in ids for _ in range(n)],
    )


def trainer_logprobs(trainer, batch: Batch) -> torch.Tensor:
    """log p(token t | tokens < t) for every t (0 at t = 0), with the gradient."""
    position = (batch.attention.long().cumsum(1) - 1).clamp(min=0)
    logits = trainer(input_ids=batch.token_ids, attention_mask=batch.attention.long(), position_ids=position).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.token_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(logp.shape[0], 1), logp], 1)


def reward(batch: Batch, tok) -> torch.Tensor:
    """A toy reward: short answers that end their turn."""
    ends = (batch.token_ids == tok.eos_token_id) & batch.mask
    length = batch.mask.sum(1).float()
    return ends.any(1).float() - 0.02 * length


def train(
    out: str | Path,
    *,
    steps: int = 4,
    prompts_per_step: int = 4,
    n: int = 2,
    max_new_tokens: int = 24,
    lr: float = 3e-4,
    seed: int = 0,
    on_step: Callable[[int, Batch], None] | None = None,
    **monitor_options,
) -> Path:
    """``steps`` optimizer steps, each logged to a Monitor writing the timeline ``out``."""
    torch.manual_seed(seed)
    tok, trainer, engine = load()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
    with Monitor(out, **monitor_options) as monitor:
        for step in range(steps):
            ids, enc = prompts(tok, prompts_per_step, offset=step * prompts_per_step)
            batch = rollout(engine, tok, ids, enc, n=n, max_new_tokens=max_new_tokens)
            trainer.train()
            logp = trainer_logprobs(trainer, batch)
            batch.logp_train = logp.detach()
            # the monitor: the engine's and the trainer's log-probs of the same sampled tokens
            monitor.log_step(step, batch.token_ids, batch.logp_infer, batch.logp_train, batch.mask)
            if on_step is not None:
                on_step(step, batch)
            # REINFORCE with a group-mean baseline, token-mean over the generated tokens
            r = reward(batch, tok).view(-1, n)
            advantage = (r - r.mean(1, keepdim=True)).view(-1, 1)
            m = batch.mask.float()
            loss = -(advantage * logp * m).sum() / m.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            engine.load_state_dict(trainer.state_dict())  # the weight sync: float32 -> bfloat16
    return Path(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports") / "monitor-demo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars to OUT/tensorboard")
    args = ap.parse_args()
    out = train(args.out, steps=args.steps, tensorboard=True if args.tensorboard else None)
    print(f"timeline: {out / 'timeline.html'}")


if __name__ == "__main__":
    main()
