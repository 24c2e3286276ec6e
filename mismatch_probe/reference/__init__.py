"""The training-side reference: a Hugging Face forward that scores the engine's exact tokens, in one
process (``scorer``) or as torch.distributed ranks with tensor or Ulysses sequence parallelism
(``distributed``, ``parallel``). It writes the scored token shards; it never samples.
"""
