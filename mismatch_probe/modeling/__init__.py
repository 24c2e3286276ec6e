"""Hugging Face model plumbing shared by the engines and the reference: loading checkpoints and
tokenizers, choosing the attention kernel, log-prob semantics (raw vs processed), the MoE router
recorder and the varlen SDPA kernel for packed rows. Torch-only; no engine library is imported here.
"""
