"""Sampling from an inference engine: prompts (tokenized with the model's chat template), the
multi-turn tool-use loop and its sandboxed tools. Talks to engines only through ``engines.base``.
"""
