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
