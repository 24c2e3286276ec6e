"""The routed experts vLLM and SGLang return, as the probe's rows (pure numpy; no engine imports).

Both engines capture the top-k expert ids of every input position they forward, once per decoder
layer, after top-k selection and before any expert-parallel remap (logical ids, the checkpoint's),
and return them per request for the positions ``[start, prompt_len + generated - 1)`` (the last
generated token is never forwarded):

- vLLM (``enable_return_routed_experts``, per request ``SamplingParams.routed_experts_prompt_start``):
  ``CompletionOutput.routed_experts``, a numpy array ``[positions, num_hidden_layers, top_k]``,
  uint8 (up to 256 experts) or uint16; over HTTP (``/v1/completions``) the same array as base64 of
  its ``.npy`` bytes in ``choices[i].routed_experts``.
- SGLang (``enable_return_routed_experts``, per request ``return_routed_experts`` and one
  ``routed_experts_start_len`` for a whole batch): ``meta_info["routed_experts"]``, base64 of the raw
  little-endian int32 values, flat, no shape: ``[positions, num_hidden_layers, top_k]``.

The layer axis is the Hugging Face decoder layer index (``model.layers.N``), every layer: a dense
layer's rows are never written (zeros, or whatever the buffer held), so only the MoE layers the
reference records are kept (:func:`moe_layers_from_config`, the same list as
``modeling/routing.py: RouterRecorder.layers``). The k ids come in the router kernel's order, which
no engine guarantees: they are sorted per token, the project's convention (``Completion.experts``:
int16 ``[generated tokens, moe_layers, top_k]``, row j the routing of absolute position
``prompt_len - 1 + j``, the input that produced generated token j's logits).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.errors import EngineError

# config keys, in the order transformers' families use them
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "experts_per_token", "moe_k")


def text_config(config: dict) -> dict:
    """The decoder's part of a Hugging Face config dict (a multimodal model's ``text_config``)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _first_int(c: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = c.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def moe_layers_from_config(config: dict) -> list[int]:
    """The decoder layers whose MLP is a routed MoE block, by their ``model.layers.N`` index, as
    transformers builds the model from ``config`` (a config dict, defaults filled in or not); []
    for a dense model. The rules are transformers' own, family by family:

    - ``mlp_layer_types`` (transformers 5's per-layer list: ``"dense"`` or a MoE kind);
    - ``moe_layers`` (llama4's list);
    - ``moe_layer_start_index`` / ``moe_layer_end_index`` / ``moe_layer_interval`` (ernie4_5_moe);
    - ``mlp_only_layers`` and ``decoder_sparse_step`` (qwen2_moe, qwen3_moe, qwen3_next, ...): MoE where
      the layer is not listed and ``(N + 1) % step == 0``;
    - ``first_k_dense_replace`` (deepseek_v2/v3, glm4_moe, dots1, ...): MoE from layer k on.
      transformers ignores ``moe_layer_freq`` there (vLLM's deepseek_v2 does not), and so does this;
    - otherwise every layer (mixtral, gpt_oss, olmoe, minimax, ...).
    """
    c = text_config(config)
    n = c.get("num_hidden_layers")
    experts = _first_int(c, EXPERT_COUNT_KEYS)
    if not isinstance(n, int) or n < 1 or not experts or experts < 1:
        return []
    layers = range(n)
    if isinstance(types := c.get("mlp_layer_types"), list) and len(types) == n:
        return [i for i in layers if types[i] != "dense"]
    if isinstance(listed := c.get("moe_layers"), list):
        return sorted(int(i) for i in listed if 0 <= int(i) < n)
    if "moe_layer_start_index" in c or "moe_layer_interval" in c:
        start = int(c.get("moe_layer_start_index") or 0)
        end = c.get("moe_layer_end_index")
        end = n - 1 if end is None or int(end) < 0 else int(end)
        interval = int(c.get("moe_layer_interval") or 1)
        return [i for i in layers if (i + 1) % interval == 0 and start <= i <= end]
    if "mlp_only_layers" in c or "decoder_sparse_step" in c:
        dense = {int(i) for i in c.get("mlp_only_layers") or []}
        step = int(c.get("decoder_sparse_step") or 1)
        return [i for i in layers if i not in dense and (i + 1) % step == 0]
    if (first_dense := c.get("first_k_dense_replace")) is not None:
        return [i for i in layers if i >= int(first_dense)]
    return list(layers)


@dataclass(frozen=True)
class MoeLayout:
    """A checkpoint's routing as the engines return it (every decoder layer, top-k columns) and as
    the probe records it (the MoE layers only)."""

    moe_layers: list[int]
    top_k: int
    num_experts: int | None
    num_hidden_layers: int

    def describe(self) -> dict:
        """``engine.routing`` in run.json: the same keys as ``RouterRecorder.describe``."""
        return {"moe_layers": list(self.moe_layers), "top_k": self.top_k, "num_experts": self.num_experts}

    def rows(self, routed: np.ndarray, prompt_len: int, start: int, n_generated: int, *, what: str) -> np.ndarray:
        """:func:`rows_for_generated` of an engine's ``routed`` under this layout (its MoE layers,
        top-k and expert count checked)."""
        return rows_for_generated(
            routed,
            prompt_len,
            start,
            n_generated,
            self.moe_layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
            what=what,
        )


def moe_layout(config: dict) -> MoeLayout | None:
    """The MoE layout of a config dict; None for a dense model (or one without a top-k)."""
    layers = moe_layers_from_config(config)
    c = text_config(config)
    top_k = _first_int(c, TOP_K_KEYS)
    if not layers or not top_k or top_k < 1:
        return None
    return MoeLayout(layers, top_k, _first_int(c, EXPERT_COUNT_KEYS), int(c["num_hidden_layers"]))


def checkpoint_config(model_path: str | Path, *, trust_remote_code: bool = False) -> dict:
    """The checkpoint's config as the engines read it: transformers' config with its defaults filled
    in (a key the checkpoint's config.json leaves out has the family's default), or the raw
    config.json where transformers cannot read it."""
    import json

    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code).to_dict()
    except Exception:
        try:
            return json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, ValueError):
            return {}  # no readable config: the engine says why, with its own message


def rows_for_generated(
    routed: np.ndarray,
    prompt_len: int,
    start: int,
    n_generated: int,
    moe_layers: list[int],
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
    what: str = "the engine",
) -> np.ndarray:
    """The routing behind each generated token, int16 ``[n_generated, len(moe_layers), k]``, ids
    sorted per token, from an engine's ``routed`` ``[positions, num_hidden_layers, k]`` that starts
    at absolute position ``start``: row j is position ``prompt_len - 1 + j``. Anything else than the
    rows asked for raises :class:`EngineError`, saying what came back."""
    routed = np.asarray(routed)
    expected = prompt_len + n_generated - 1 - start
    if routed.ndim != 3:
        raise EngineError(
            f"{what} returned routed experts of shape {list(routed.shape)}, not [positions, layers, top_k]"
        )
    if not 0 <= start <= prompt_len - 1:
        raise EngineError(
            f"routing asked from position {start} cannot cover the last prompt position {prompt_len - 1} "
            f"(prompt of {prompt_len} tokens)"
        )
    rows, n_layers, k = routed.shape
    if rows != expected:
        ignored = (
            " (the whole sequence from position 0: it ignored the start)" if start and rows == expected + start else ""
        )
        raise EngineError(
            f"{what} returned routed experts for {rows} positions{ignored}, expected {expected}: positions {start} to "
            f"{prompt_len + n_generated - 2} of a {prompt_len}-token prompt and {n_generated} generated tokens "
            "(the last generated token is never forwarded)"
        )
    if moe_layers and max(moe_layers) >= n_layers:
        raise EngineError(
            f"{what} returned routed experts for {n_layers} layers; the checkpoint has MoE layer {max(moe_layers)}"
        )
    if top_k is not None and k != top_k:
        raise EngineError(f"{what} returned {k} routed experts per token and layer; the checkpoint routes top-{top_k}")
    first = prompt_len - 1 - start
    out = routed[first : first + n_generated][:, list(moe_layers), :].astype(np.int64)
    if out.size and (int(out.min()) < 0 or (num_experts is not None and int(out.max()) >= num_experts)):
        bad = int(out.min()) if int(out.min()) < 0 else int(out.max())
        raise EngineError(
            f"{what} returned expert id {bad} in an MoE layer"
            + (f"; the checkpoint has {num_experts} routed experts" if num_experts is not None else "")
        )
    return np.sort(out, axis=-1).astype(np.int16)


def _b64(value: Any, what: str) -> bytes:
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("ascii")
    if not isinstance(value, str):
        raise EngineError(f"{what} returned routed experts as {type(value).__name__}, not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineError(f"{what} returned routed experts that are not base64 ({exc})") from None


def decode_vllm_npy_b64(s: str | bytes, *, what: str = "vLLM") -> np.ndarray:
    """vLLM's OpenAI server's ``routed_experts``: base64 of ``np.save`` bytes
    (vllm/utils/serial_utils.py: numpy2base64), ``[positions, num_hidden_layers, top_k]`` uint8/uint16."""
    raw = _b64(s, what)
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise EngineError(f"{what} returned routed experts that are not a .npy array ({exc})") from None
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise EngineError(
            f"{what} returned routed experts as {array.dtype} {list(array.shape)}, not integer [positions, layers, top_k]"
        )
    return array


def decode_sglang_int32_b64(s: str | bytes, num_layers: int, top_k: int, *, what: str = "SGLang") -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]``: base64 of raw little-endian int32 values, flat
    (srt/managers/tokenizer_manager.py, detokenizer_manager.py: ``b64encode(tensor.numpy().tobytes())``),
    reshaped to ``[positions, num_layers, top_k]`` (its ``hf_text_config.num_hidden_layers`` and
    ``num_experts_per_tok``)."""
    raw = _b64(s, what)
    per_position = num_layers * top_k
    if len(raw) % 4 or (len(raw) // 4) % per_position:
        raise EngineError(
            f"{what} returned {len(raw)} bytes of routed experts, not a whole number of int32 rows of "
            f"{num_layers} layers x top-{top_k}"
        )
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
