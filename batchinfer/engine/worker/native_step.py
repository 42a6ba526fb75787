"""One CPU step of the Llama decoder stack as one native call: no Python between layers (issue 34).

Why: the Python layer loop costs ~18 dispatches per layer (norms, four linears, rotary, K/V store,
attention, SiLU-and-mul, views), 30 layers a step; on 2 cores that interpreter time is 10-40% of a small
decode step (most for int8, whose GEMMs are fastest). csrc/decoder_stack.cpp runs the same kernels in the
same order from C++ over the weights the layers were packed into (weight_packing.py), so its output is
bit-identical to the Python loop, which stays as the fallback and the reference.

What runs natively: a whole-model Llama (no pipeline stage, one tensor-parallel rank, no LoRA) on CPU in
float32 / bfloat16 whose linears are panel-packed, oneDNN-prepacked, int8 (fbgemm or oneDNN) or plain
dense, with the fused CPU kernels enabled. A decode-only step runs attention natively too
(csrc/paged_attention.cpp), over a cache of the model dtype or of int8 / u8 codes (kv_cache_dtype; stored
by csrc/fused_ops.cpp's store_kv_quantized_, as the Python path stores them); any other step (prefill
chunks, or a KV cache the native kernel cannot read: bf16 under a float32 model, fp8_e4m3) calls back into
the Attention layer once per layer (layers/attention.py stays the one attention entry). Set
BATCHINFER_CPU_NATIVE_STEP=0 for the Python loop (A/B runs).
"""

from __future__ import annotations

import os
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

import torch

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.amx_linear import AmxLinear
from batchinfer.engine.layers.attention import Attention
from batchinfer.engine.layers.context import AttentionContext
from batchinfer.engine.layers.exact_blocks import ExactBlockLinear
from batchinfer.engine.layers.linear import LinearBase
from batchinfer.engine.layers.weight_packing import Int8Linear, OneDnnLinear, PanelLinear
from batchinfer.engine.parallel.distributed import tp_world_size

if TYPE_CHECKING:
    from batchinfer.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

NATIVE_STEP_ENV = "BATCHINFER_CPU_NATIVE_STEP"  # "0": the Python layer loop instead (A/B runs)

# One linear as the C++ stack takes it: (kind, weight, bias, int8 packed params (exact blocks: their scales),
# per_token, reduce_range, out_features (the panel and AMX GEMMs' N; 0 for the others))
LinearSpec = tuple[int, torch.Tensor, torch.Tensor | None, object, bool, bool, int]


class NativeLinearKind(IntEnum):
    """How a linear's weight is packed (decoder_stack.cpp's LinearKind)."""

    ATEN = 0  # the dense weight, at::linear
    ONEDNN = 1  # oneDNN's prepacked weight, mkldnn::_linear_pointwise
    INT8 = 2  # the packed int8 weight (fbgemm's or oneDNN's), quantized::linear_dynamic
    PANEL = 3  # the panels of csrc/panel_gemm.cpp, panel_linear
    AMX = 4  # the bf16 halves of csrc/amx_gemm.cpp, amx_linear (float32_matmul_precision high)
    AMX_BLOCKS = 5  # exact 4-bit blocks of csrc/amx_block_gemm.cpp, amx_block_linear (scales as "packed")


class DecoderStackHandle(Protocol):
    """The C++ DecoderStack object (csrc/decoder_stack.cpp)."""

    def add_layer(self, input_norm: torch.Tensor, post_attention_norm: torch.Tensor,
                  linears: list[LinearSpec]) -> None: ...

    def bind_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None: ...

    def bind_quantized_caches(self, k_codes: list[torch.Tensor], v_codes: list[torch.Tensor],
                              k_params: list[torch.Tensor], v_params: list[torch.Tensor]) -> None: ...

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                rows: torch.Tensor | None, block_tables: torch.Tensor | None, seq_lens: torch.Tensor | None,
                attention: object) -> torch.Tensor: ...


def native_step_enabled() -> bool:
    """BATCHINFER_CPU_NATIVE_STEP is not "0"."""
    return os.environ.get(NATIVE_STEP_ENV, "1") != "0"


def linear_spec(module: LinearBase) -> LinearSpec | None:
    """The C++ stack's view of a linear's kernel, or None when it has none (GGUF blocks, LoRA)."""
    if module.lora_key is not None:
        return None
    packed = module.packed
    if isinstance(packed, PanelLinear):
        return (NativeLinearKind.PANEL, packed.panels, packed.bias, None, False, False, packed.out_features)
    if isinstance(packed, AmxLinear):
        return (NativeLinearKind.AMX, packed.halves, packed.bias, None, False, False, packed.out_features)
    if isinstance(packed, ExactBlockLinear):
        return (NativeLinearKind.AMX_BLOCKS, packed.codes, packed.bias, packed.scales, False, False,
                packed.out_features)
    if isinstance(packed, OneDnnLinear):
        return (NativeLinearKind.ONEDNN, packed.packed, packed.bias, None, False, False, 0)
    if isinstance(packed, Int8Linear):
        bias = packed.float_bias if packed.per_token else None  # per tensor, the packed params hold it
        return (NativeLinearKind.INT8, torch.empty(0), bias, packed.packed, packed.per_token,
                packed.reduce_range, 0)
    if packed is None and module.weight.numel() > 0:
        return (NativeLinearKind.ATEN, module.weight.detach(), module.effective_bias(), None, False, False, 0)
    return None


def _layer_specs(layer: LlamaDecoderLayer) -> list[LinearSpec] | None:
    attn, mlp = layer.self_attn, layer.mlp
    specs = [linear_spec(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    return None if any(s is None for s in specs) else [s for s in specs if s is not None]


class NativeStep:
    """The model's decoder stack bound into one C++ object; forward() replaces LlamaModel.forward."""

    def __init__(self, model: LlamaForCausalLM, stack: DecoderStackHandle,
                 attention_layers: list[Attention]) -> None:
        self.model = model
        self.stack = stack
        self.attention_layers = attention_layers
        self._bound_cache: torch.Tensor | None = None  # layer 0's k_cache when the caches were bound
        self._native_cache = False  # the bound caches are ones the C++ attention reads (plain or int8 / u8)

    @classmethod
    def build(cls, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> NativeStep | None:
        """The native stack of a loaded, packed model, or None where the Python loop must run it."""
        from batchinfer.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

        if (not native_step_enabled() or device.type != "cpu" or dtype not in cpu_attention.NATIVE_DTYPES
                or cpu_attention._FUSED_OFF or tp_world_size() != 1
                or not isinstance(model, LlamaForCausalLM)):
            return None
        ext = cpu_attention.load()
        inner = model.model
        layers = [layer for layer in inner.stage_layers if isinstance(layer, LlamaDecoderLayer)]
        whole = inner.stage.is_first and inner.stage.is_last and len(layers) == inner.stage.num_layers
        if ext is None or not hasattr(ext, "DecoderStack") or not whole:
            return None
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        final_norm = inner.norm
        eps = final_norm.eps
        if any(n.eps != eps or n.weight.dtype != dtype for n in [*norms, final_norm]):
            return None
        attentions = [layer.self_attn.attn for layer in layers]
        shape = (attentions[0].num_heads, attentions[0].num_kv_heads, attentions[0].head_dim)
        if any((a.num_heads, a.num_kv_heads, a.head_dim) != shape for a in attentions):
            return None
        specs = [_layer_specs(layer) for layer in layers]
        if any(spec is None for spec in specs):
            return None
        stack: DecoderStackHandle = ext.DecoderStack(*shape, attentions[0].scale, eps,
                                                     final_norm.weight.detach())
        for layer, spec in zip(layers, specs, strict=True):
            stack.add_layer(layer.input_layernorm.weight.detach(),
                            layer.post_attention_layernorm.weight.detach(), spec or [])
        return cls(model, stack, attentions)

    def _bind_caches(self, dtype: torch.dtype) -> None:
        """Hand the C++ stack the layers' current cache views (again whenever the runner reallocated them)."""
        layers = self.attention_layers
        if self._bound_cache is layers[0].k_cache:
            return
        quantized = [a.quantized_kv for a in layers]
        codes = [(q.k_codes, q.v_codes, q.k_params, q.v_params) for q in quantized
                 if q is not None and q.k_params is not None and q.v_params is not None
                 and q.k_codes.dtype in cpu_attention.QUANTIZED_CODES]
        if len(codes) == len(layers):  # int8 / u8 codes with their params
            self.stack.bind_quantized_caches(*(list(part) for part in zip(*codes, strict=True)))
            self._native_cache = True
        else:
            self.stack.bind_caches([a.k_cache for a in layers], [a.v_cache for a in layers])
            self._native_cache = all(q is None for q in quantized) and layers[0].k_cache.dtype == dtype
        self._bound_cache = layers[0].k_cache

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The Python attention of one layer (steps the native kernel does not take alone)."""
        return self.attention_layers[layer](q, k, v)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of packed tokens, as LlamaModel.forward returns them."""
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb.cos_sin(positions, hidden.dtype)
        plan = context.torch_plan
        if plan is None:
            raise RuntimeError("the native CPU step needs the torch attention backend's plan")
        self._bind_caches(hidden.dtype)
        decode = plan.native_decode
        decode_only = not plan.groups and decode is not None and decode.token_index is None
        if decode is not None and decode_only and self._native_cache:
            return self.stack.forward(hidden, cos.contiguous(), sin.contiguous(), plan.store_slots,
                                      plan.store_rows, decode.block_tables, decode.seq_lens, None)
        return self.stack.forward(hidden, cos.contiguous(), sin.contiguous(), plan.store_slots,
                                  plan.store_rows, None, None, self._attend)
