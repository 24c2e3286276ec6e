"""The worker extension vLLM mixes into its workers when a probe syncs weights or runs a
quantized engine (``worker_extension_cls``, as verl, OpenRLHF and TRL do); its methods are reached
through ``LLM.collective_rpc`` and run in every worker process, next to the model.

Imported by vLLM's worker processes only: keep it light (no vLLM import at module level).
"""

from __future__ import annotations

from mismatch_probe.engines.weight_sync import module_digest, tensor_digest, unpack_bucket

TARGET = "mismatch_probe.engines.vllm_sync.ProbeWorkerExtension"  # vLLM imports it by this dotted name


def kernel_weight(module_name, module, leaf, param):
    """The weight a linear layer's CPU kernel applies, where vLLM's CPU build repacked it (oneDNN,
    sgl-kernel) and left an empty parameter: the kernel applied to the identity gives W^T."""
    import torch

    linear = getattr(module, "cpu_linear", None)
    size = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    if leaf != "weight" or linear is None or not size:
        return None
    eye = torch.eye(int(size), dtype=param.dtype)
    return linear(eye, None, None).t().contiguous()


# what an unquantized linear layer's CPU GEMM calls (vllm/model_executor/layers/utils.py:
# dispatch_cpu_unquantized_gemm sets ``cpu_linear`` to a lambda over one of these)
GEMM_CALLS = {
    "weight_packed_linear_cpu": "sgl-kernel (AMX)",
    "onednn_mm": "oneDNN",
    "zentorch_linear_unary": "zentorch",
    "linear": "torch",
}


def gemm_path(linear) -> str:
    """The GEMM a layer's ``cpu_linear`` runs, from the names its code calls."""
    names = set(getattr(getattr(linear, "__code__", None), "co_names", ()))
    return next((path for call, path in GEMM_CALLS.items() if call in names), "other")


def quantized_weight(module, kernel) -> dict | None:
    """A quantized layer's weight as its kernel keeps it, read from the kernel and the layer: the
    number format (the kernel's configuration; else the stored dtype), the tensor (with its dtype)
    or handle that holds it, the bits each weight takes there (dense packing: the format's width),
    and the path the kernel took where it chose one by the CPU."""
    import torch

    config = getattr(kernel, "config", None)
    weight_type = getattr(config, "weight_type", None)  # mixed precision (wNa16): a vLLM ScalarType
    names = getattr(kernel, "layer_param_names", None)  # scaled mm: (weight, weight_scale, ...)
    holder_name = getattr(kernel, "w_q_name", None) or (names[0] if names else "weight")
    holder = getattr(module, holder_name, None)
    if weight_type is not None:
        fmt, bits = str(weight_type), int(weight_type.size_bits)
    elif type(config).__name__.startswith("Int8"):
        fmt, bits = "int8", 8
    elif isinstance(holder, torch.Tensor) and holder.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        fmt, bits = str(holder.dtype).removeprefix("torch."), 8
    else:
        return None
    out: dict = {"format": fmt, "bits": bits}
    if isinstance(holder, torch.Tensor) and holder.numel():
        out["held_in"] = f"{holder_name}: {str(holder.dtype).removeprefix('torch.')}"
        logical = _logical_weights(module, config)
        if logical:  # packed weights are dense: the holder's bits over the weights it holds
            out["stored_bits_per_weight"] = round(holder.numel() * holder.element_size() * 8 / logical, 3)
    elif (handler := getattr(kernel, "dnnl_handler", None)) is not None:
        # oneDNN took the weight into its own prepacked memory; the layer keeps no tensor of it
        out["held_in"] = f"oneDNN handle ({type(handler).__name__})"
    else:
        out["held_in"] = "unknown"
    path = {k: getattr(module, k) for k in ("isa_hint", "use_w4a8") if hasattr(module, k)}
    method = getattr(kernel, "linear_method", None)
    if method is not None:
        path["linear_method"] = getattr(method, "__name__", str(method))
    if path:
        out["path"] = path
    return out


def _logical_weights(module, config) -> int | None:
    """How many weights a linear layer's partition holds (in x out)."""
    shape = getattr(config, "partition_weight_shape", None)
    if shape:
        return int(shape[0]) * int(shape[1])
    k = getattr(module, "input_size_per_partition", None)
    widths = getattr(module, "output_partition_sizes", None)
    return int(k) * int(sum(widths)) if k and widths else None


class ProbeWorkerExtension:
    """Methods added to vLLM's ``Worker`` (``self`` is the worker: ``self.model_runner``)."""

    def _probe_model(self):
        return self.model_runner.get_model()

    def probe_begin_update(self) -> None:
        """Ready every layer for weights in checkpoint format, as vLLM's own ``reload_weights``
        does (its CPU kernels, and quantized ones, keep weights repacked after the first load)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._probe_model())

    def probe_finish_update(self) -> None:
        """Process what was loaded into the kernels' layout (a layer that got nothing keeps its
        previous tensors: vLLM logs 'Failed to load weights')."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self._probe_model(), self.vllm_config.model_config)

    def probe_load_weights(self, packed_bucket) -> list[str]:
        """The tensor transfer: one bucket (``weight_sync.pack_bucket``) into the model's own
        ``load_weights`` (which re-shards and re-fuses the checkpoint's names into vLLM's layout),
        returning the parameter names it reports as loaded."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            loaded = self._probe_model().load_weights(weights=unpack_bucket(packed_bucket))
        return sorted(loaded) if loaded is not None else []

    def probe_parameter_names(self) -> list[str]:
        return [name for name, _ in self._probe_model().named_parameters()]

    def probe_weight_digest(self) -> dict:
        # as (rows, bytes): vLLM's RPC passes bytes through as they are (not every array type)
        model = self._probe_model()
        digest = module_digest(model, effective=kernel_weight)
        # layers that keep their weight and a repacked copy for their GEMM (a tied embedding: the
        # lookup reads the weight, the LM head the copy) are digested twice: both must be updated
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if getattr(module, "cpu_linear", None) is None or weight is None or weight.numel() == 0:
                continue
            applied = kernel_weight(module_name, module, "weight", weight)
            if applied is not None:
                digest.update({f"{module_name}.weight[kernel]": tensor_digest(applied)})
        return {k: (v.shape[0], v.tobytes()) for k, v in digest.items()}

    def probe_quantization(self) -> dict:
        """What each layer with a quantization method runs, as this worker holds it after loading:
        the method, the compressed-tensors scheme and the kernel chosen for this platform, and every
        parameter's dtype and shape (the CPU build repacks weights: these are the packed ones)."""
        model = self._probe_model()
        layers = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            scheme = getattr(module, "scheme", None)
            kernel = next(
                (k for owner in (scheme, method) for a in ("kernel", "fp8_linear") if (k := getattr(owner, a, None))),
                None,
            )
            layers[name] = {
                "method": type(method).__name__,
                "scheme": type(scheme).__name__ if scheme is not None else None,
                "kernel": type(kernel).__name__ if kernel is not None else None,
                "weight": quantized_weight(module, kernel) if kernel is not None else None,
                "params": {
                    p: [str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for p, t in module.named_parameters(recurse=False)
                    if t is not None
                },
            }
        quant_config = self.vllm_config.quant_config
        return {
            "quant_config": type(quant_config).__name__ if quant_config is not None else None,
            "kv_cache_dtype": str(self.vllm_config.cache_config.cache_dtype),
            "layers": layers,
        }

    def probe_kernels(self) -> dict:
        """The kernels this worker chose, read from its layers: each attention backend with the
        instruction set it runs (vLLM's CPU attention: amx, vec or vec16; MLA: AMX_MLA or CPU_MLA)
        and each unquantized linear layer's CPU GEMM (:data:`GEMM_CALLS`), with how many layers run
        each. vLLM picks them by the CPU (ARCHITECTURE.md, Run record)."""
        from collections import Counter

        attention: Counter = Counter()
        gemm: Counter = Counter()
        for _, module in self._probe_model().named_modules():
            backend = getattr(module, "attn_backend", None)
            if backend is not None and hasattr(backend, "get_name"):
                isa = getattr(module, "isa", None)
                attention[backend.get_name() + (f" ({isa})" if isa else "")] += 1
            linear = getattr(module, "cpu_linear", None)
            if linear is not None:
                gemm[gemm_path(linear)] += 1
        out: dict = {}
        if self.vllm_config.device_config.device_type == "cpu":
            import platform

            import torch

            # vLLM's CPU library by its own rule (vllm/platforms/cpu.py: import_kernels), and its AMX paths
            if platform.machine().lower() in ("x86_64", "amd64"):
                library = (
                    "vllm._C_AVX2"
                    if not torch.cpu._is_avx512_supported()
                    else "vllm._C"
                    if torch.cpu._is_avx512_bf16_supported()
                    else "vllm._C_AVX512"
                )
            else:
                library = "vllm._C"
            out.update(library=library, amx=bool(torch.cpu._is_amx_tile_supported()))
        return {**out, "attention": dict(attention), **({"gemm": dict(gemm)} if gemm else {})}

    def probe_untie_lm_head(self) -> bool:
        """Test-only fault: the LM head becomes a tensor of its own (a copy of the embedding as it
        is now), so an update of the embedding no longer reaches it."""
        import copy

        model = self._probe_model()
        head = getattr(model, "lm_head", None)
        if head is None:
            return False
        if not hasattr(self, "_probe_tied_head"):
            self._probe_tied_head = head
        model.lm_head = copy.deepcopy(self._probe_tied_head)
        return True

    def probe_retie_lm_head(self) -> bool:
        """Undo :meth:`probe_untie_lm_head` (the next sync without the fault): True when it did."""
        head = self.__dict__.pop("_probe_tied_head", None)
        if head is None:
            return False
        self._probe_model().lm_head = head
        return True
