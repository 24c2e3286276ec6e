"""Bug 2: SGLang's torch_native attention backend drops Gemma-2's attention
logit soft-cap (attn_logit_softcapping); the final-logit soft-cap is applied. Prediction: SGLang
matches HF with attn_logit_softcapping=None to ~1e-6, and differs from the real model by ~1 nat."""

import numpy as np
from sglang_common import build, compare, hf_logprobs, sglang_prefill

SEQ = [int(t) for t in np.random.default_rng(0).integers(3, 1000, size=40)]  # no 1023 (bug 1)

if __name__ == "__main__":
    path = build("gemma2")  # caps: final 3.0, attention 2.0; window 16 on layer 0
    observed = np.array([e[0] for e in sglang_prefill(path, [SEQ])[0][1:]], dtype=np.float64)
    print("gemma2, SGLang CPU (torch_native) prefill log-probs")
    compare("HF fp32 (as configured)", observed, hf_logprobs(path, SEQ))
    compare("HF fp32, attn_logit_softcapping=None", observed, hf_logprobs(path, SEQ, attn_logit_softcapping=None))
    compare("HF fp32, final_logit_softcapping=None", observed, hf_logprobs(path, SEQ, final_logit_softcapping=None))
