"""Bug 1: SGLang reports token id 0 for every prompt token equal to vocab_size - 1
in input_token_logprobs (the value is still the right one). Family-independent: qwen2 shows it too."""

from sglang_common import build, hf_logprobs, sglang_prefill

V = 1024  # tiny_models.VOCAB: SGLang's ModelConfig.vocab_size for these checkpoints
SEQ = [1, 17, 300, V - 1, 42, V - 2, 7, V - 1, 99, 5]  # 1023 twice; 1022 as a control

if __name__ == "__main__":
    for family in ("qwen2", "llama"):
        path = build(family)
        expected = hf_logprobs(path, SEQ)
        entries = sglang_prefill(path, [SEQ])[0][1:]  # entry 0 has no log-prob
        print(f"{family}: position, token, SGLang's id, SGLang log p, HF fp32 log p")
        for k, ((val, tid, _), tok, ref) in enumerate(zip(entries, SEQ[1:], expected), start=1):
            flag = "   <-- id rewritten to 0, value still log p(1023)" if tid != tok else ""
            print(f"  {k:2d} {tok:5d} {tid:5d} {val:+.6f} {ref:+.6f}{flag}")
        # expected: ids equal SEQ[1:] everywhere; observed: 0 where the token is 1023 (not at 1022),
        # and the log-probs agree with HF to ~1e-6 at every position, the 1023 ones included
