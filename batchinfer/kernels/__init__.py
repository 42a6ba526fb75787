"""Triton kernels of the engine's CUDA path, and their pure-torch twins (suffix _ref).

`import batchinfer.kernels` works without triton installed; only the _ref functions are usable then. The
Triton kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
"""

from batchinfer.kernels.reference import lora_bgmv_ref, paged_attention_ref, rms_norm_ref, store_kvcache_ref

try:
    import triton  # noqa: F401
except ImportError as _exc:  # CPU-only install: keep the twins importable, fail clearly on the kernels
    TRITON_AVAILABLE = False
    _missing_triton = _exc

    def _needs_triton(name: str):
        def stub(*args, **kwargs):
            message = (f"batchinfer.kernels.{name} needs the `triton` package; "
                       f"use batchinfer.kernels.{name}_ref on CPU")
            raise ImportError(message) from _missing_triton

        stub.__name__ = name
        return stub

    lora_bgmv = _needs_triton("lora_bgmv")
    paged_attention = _needs_triton("paged_attention")
    rms_norm = _needs_triton("rms_norm")
    store_kvcache = _needs_triton("store_kvcache")
else:
    TRITON_AVAILABLE = True
    from batchinfer.kernels.lora import lora_bgmv
    from batchinfer.kernels.paged_attention import paged_attention
    from batchinfer.kernels.rmsnorm import rms_norm
    from batchinfer.kernels.store_kvcache import store_kvcache

__all__ = [
    "TRITON_AVAILABLE",
    "lora_bgmv",
    "lora_bgmv_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
