"""Bug 4: SGLang's Qwen3MoeForCausalLM ignores tie_word_embeddings. It always builds an LM head of its
own, and its load_weights never copies the embedding into it; a tied checkpoint has no lm_head.weight,
so the head keeps the memory it was allocated with (zeros on CPU) and every logit is the same.
Prediction: on a tied checkpoint every SGLang log-prob is log(1/1024) = -6.931472, whatever the model
says; on the same checkpoint untied (the suite's own qwen3_moe: the control) SGLang equals HF to ~1e-6."""

import numpy as np
from safetensors import safe_open
from sglang_common import OUT, ROOT, build, compare, hf_logprobs, sglang_prefill, tiny_models

SEQS = [[int(t) for t in np.random.default_rng(s).integers(3, 1000, size=40)] for s in range(3)]  # no 1023 (bug 1)
UNIFORM = -np.log(tiny_models.VOCAB)


def has_head(path) -> bool:
    with safe_open(str(path / "model.safetensors"), "np") as f:
        return "lm_head.weight" in set(f.keys())  # safe_open has no __contains__


def run(label: str, path) -> None:
    entries = sglang_prefill(path, SEQS)
    observed = np.concatenate([[e[0] for e in seq[1:]] for seq in entries]).astype(np.float64)
    expected = np.concatenate([hf_logprobs(path, seq) for seq in SEQS])
    print(f"{label}: {path.relative_to(ROOT)}, lm_head.weight in the checkpoint: {has_head(path)}")
    print(f"  SGLang log p over {observed.size} tokens: min {observed.min():+.6f}  max {observed.max():+.6f}")
    print(f"  HF fp32 log p:                 min {expected.min():+.6f}  max {expected.max():+.6f}")
    compare("HF fp32", observed, expected)
    compare("uniform, log(1/1024)", observed, np.full_like(observed, UNIFORM))


if __name__ == "__main__":
    # the suite's tiny qwen3_moe (random, seed 0), tied: SGLang's head never gets a weight
    run(
        "qwen3_moe, tie_word_embeddings=True",
        tiny_models.build("qwen3_moe", OUT / "tiny-qwen3_moe-tied", tie_word_embeddings=True),
    )
    # the same checkpoint as the family suite builds it, untied: lm_head.weight is in the file
    run("qwen3_moe, tie_word_embeddings=False (control)", build("qwen3_moe"))
    # the repository's trained MoE fixture (tied, bf16 on disk), which the .toml runs
    run("fixture tiny-qwen3-moe (tied, trained)", ROOT / "fixtures" / "models" / "tiny-qwen3-moe")
    # expected: SGLang = HF to ~1e-6 in all three; observed: tied -> every log p is -6.931472 (uniform)
