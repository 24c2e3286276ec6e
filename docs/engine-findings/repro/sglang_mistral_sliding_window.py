"""Bug 3: SGLang runs MistralForCausalLM as LlamaForCausalLM, whose attention never
gets a sliding window. Prediction: SGLang equals HF with sliding_window=None at every position, and
differs from the real (windowed) model only where the query is 16 or more tokens in."""

import numpy as np
from sglang_common import build, hf_logprobs, sglang_prefill

SEQ = [int(t) for t in np.random.default_rng(0).integers(3, 1000, size=40)]  # no 1023 (bug 1)
WINDOW = 16  # tiny_models.WINDOW

if __name__ == "__main__":
    path = build("mistral")
    observed = np.array([e[0] for e in sglang_prefill(path, [SEQ])[0][1:]], dtype=np.float64)
    windowed = hf_logprobs(path, SEQ)  # HF: key j visible to query i iff i - 16 < j <= i
    full = hf_logprobs(path, SEQ, sliding_window=None)
    print("mistral: k (token scored), |SGLang - HF windowed|, |SGLang - HF no window|")
    for k in range(1, len(SEQ)):  # log p(SEQ[k]) is read at query position k - 1
        mark = "  (window active)" if k - 1 >= WINDOW else ""
        print(f"  {k:2d} {abs(observed[k - 1] - windowed[k - 1]):.3e} {abs(observed[k - 1] - full[k - 1]):.3e}{mark}")
