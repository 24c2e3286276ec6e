"""What the SGLang reproductions share: the suite's tiny checkpoints, SGLang's CPU engine started as
mismatch-probe's adapter starts it, and the Hugging Face float32 forward they are held against.

Run each with the SGLang venv, from the repository root:
    .venv-sglang/bin/python docs/engine-findings/repro/sglang_last_vocab_id.py
Mirrors how mismatch_probe/engines/sglang.py starts SGLang on CPU (SGLANG_USE_CPU_ENGINE=1 before
the import, device="cpu", attention_backend="torch_native", disable_cuda_graph=True, float32,
skip_tokenizer_init=True, token-id prompts, max_new_tokens=0 + logprob_start_len for the prefill).
"""

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read at SGLang's import, as the adapter sets it
os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # raw log-probs (input ones are raw anyway)

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))  # tests/ is not a package; the suite imports it this way too
import tiny_models

OUT = ROOT / "build" / "engine-findings"


def build(family: str) -> Path:
    """The suite's own tiny checkpoint (fp32 safetensors, fixture tokenizer, seed 0)."""
    return tiny_models.build(family, OUT / f"tiny-{family}")


def hf_logprobs(path: Path, seq: list[int], **overrides) -> np.ndarray:
    """HF float32 log p(seq[k] | seq[:k]) for k = 1..n-1 (eager attention: soft-caps are honoured).
    ``overrides`` edit the config first (e.g. attn_logit_softcapping=None, sliding_window=None)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[:-1]
    return lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].double().numpy()


def sglang_prefill(path: Path, seqs: list[list[int]]) -> list[list[tuple]]:
    """SGLang's input_token_logprobs entries (logprob, token_id, text) for every position of each
    sequence (entry 0 has no log-prob), through the offline engine on CPU."""
    import sglang

    engine = sglang.Engine(
        model_path=str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        attention_backend="torch_native",  # what the adapter sets on CPU (sgl-kernel's AMX ops absent)
        disable_cuda_graph=True,
        disable_radix_cache=True,
        max_total_tokens=4096,
        random_seed=0,
        log_level="warning",
    )
    try:
        outs = engine.generate(
            input_ids=[[int(t) for t in s] for s in seqs],
            sampling_params=[{"max_new_tokens": 0, "temperature": 0.0}] * len(seqs),
            return_logprob=True,
            logprob_start_len=[0] * len(seqs),
        )
    finally:
        engine.shutdown()
    return [o["meta_info"]["input_token_logprobs"] for o in outs]


def compare(name: str, observed: np.ndarray, expected: np.ndarray) -> None:
    d = observed - expected
    k3 = float(np.mean(np.exp(d) - 1 - d))  # k3-style, over the scored positions
    print(f"  vs {name:<34s} max|dlogp| {np.abs(d).max():.3e}   mean|dlogp| {np.abs(d).mean():.3e}   k3 {k3:.3e}")
