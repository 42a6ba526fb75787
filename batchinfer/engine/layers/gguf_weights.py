"""quantization="gguf": the linear layers run on the GGUF file's own 4-bit blocks instead of fp32 copies.

A GGUF model is converted once to safetensors by de-quantizing its blocks (loader.py); without this mode
the engine then runs fp32 weights, 7x the memory of the file's Q4 blocks. Here each linear whose GGUF
tensors are Q4_0 or Q4_1 keeps the file's codes and scales and runs the extension's q4_linear
(cpu_gguf_source.py), which computes x @ W.T with W = d * q + m per group of 32 input channels:
  - Q4_1 block: fp16 d, fp16 m, 32 nibbles q;  w = d * q + m
  - Q4_0 block: fp16 d, 32 nibbles q;          w = d * (q - 8), i.e. m = -8 d
(nibble j < 16 of a block is the low half of byte j, nibble j >= 16 the high half of byte j - 16).
So the weights are the same numbers the fp32 run uses (the de-quantized ones), and the output differs from
fp32's by the order of the float sums only.

Invariant checked at load: every layer's blocks, de-quantized here, equal (within float rounding) the
weight the loader de-quantized from the same file, before that weight is released. A tensor name or a row
order we got wrong (llama.cpp stores Q and K rows permuted for its rotary layout; transformers undoes
that) fails at load, naming the tensor, instead of producing wrong text. Tensors of other types (Q8_0,
like SmolLM2's tied embedding / LM head, K-quants, F16, F32) keep the dense path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

GROUP_SIZE = 32  # elements per Q4_0 / Q4_1 block
# bytes per block: scales first (fp16 d [, fp16 m]), then 16 bytes of nibbles
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
# the largest |difference| from the loader's de-quantized weight, relative to the layer's max |w|
MATCH_TOLERANCE = 1e-5
# weight rows one thread expands to float32 at a time for a GEMM (128 x 1536 floats: 768 KiB at most)
TILE_ROWS = 128

# our fused module -> the GGUF tensors of one layer whose rows it stacks, in order
GGUF_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}

LinearFn = Callable[[torch.Tensor], torch.Tensor]


class GGUFMismatchError(ValueError):
    """A GGUF tensor's blocks do not reproduce the weight loaded from the same file."""


def gguf_kernel() -> Any:
    """The extension holding q4_linear; a ValueError saying why where it cannot be built."""
    from batchinfer.engine.layers.cpu_attention import load

    extension = load()
    if extension is None:
        raise ValueError("quantization='gguf' runs on the native CPU kernels, which are disabled "
                         "(BATCHINFER_CPU_ATTENTION=sdpa) or could not be built (needs g++ and ninja); "
                         "run without quantization='gguf'")
    return extension


def decode_q4_blocks(raw: np.ndarray, type_name: str, columns: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    """[rows, blocks * bytes] uint8 -> (q int32 [rows, columns] in 0..15, d, m float32 [rows, groups])."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, columns // GROUP_SIZE, BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8), i.e. m = -8 d
        m = -8.0 * d
        nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, columns)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float weight of decoded blocks: d * q + m per group."""
    return q.float() * d.repeat_interleave(GROUP_SIZE, dim=1) + m.repeat_interleave(GROUP_SIZE, dim=1)


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order transformers gives a Q/K tensor llama.cpp stored permuted (its reverse_permute)."""
    half = rows // n_head // 2
    # row (h, j, i) of the result is row (h, i, j) of the stored [n_head, half, 2] layout
    return torch.arange(rows).reshape(n_head, half, 2).transpose(1, 2).reshape(rows)


def q4_linear(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
              dtype: torch.dtype) -> LinearFn:
    """x -> x @ W.T + bias on the packed 4-bit codes, W = d * q + m per group of 32 (float32 inside)."""
    kernel = gguf_kernel()
    rows, columns = q.shape
    groups = q.reshape(rows, columns // GROUP_SIZE, GROUP_SIZE).to(torch.uint8)
    half = GROUP_SIZE // 2  # GGUF's layout: byte j holds element j (low nibble) and j + 16 (high nibble)
    codes = (groups[..., :half] | (groups[..., half:] << 4)).reshape(rows, columns // 2).contiguous()
    d, m = d.float().contiguous(), m.float().contiguous()
    bias = None if bias is None else bias.detach().float()

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        out = kernel.q4_linear(flat, codes, d, m, TILE_ROWS)
        if bias is not None:
            out += bias
        return out.to(dtype).reshape(*x.shape[:-1], out.shape[-1])

    return forward


def _layer_blocks(tensors: dict, layer: int, parts: tuple[str, ...], config) -> tuple | None:
    """The decoded, row-stacked blocks of one fused module, or None where a part is not Q4_0 / Q4_1."""
    qs, ds, ms = [], [], []
    for part in parts:
        tensor = tensors.get(f"blk.{layer}.{part}.weight")
        if tensor is None or tensor.tensor_type.name not in BLOCK_BYTES:
            return None
        columns = int(tensor.shape[0])  # GGUF lists the fastest dimension first: [in, out]
        q, d, m = decode_q4_blocks(tensor.data, tensor.tensor_type.name, columns)
        if part in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
            order = unpermute_rows(q.shape[0], heads)
            q, d, m = q[order], d[order], m[order]
        qs.append(q)
        ds.append(d)
        ms.append(m)
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


def pack_gguf_q4(model: nn.Module, gguf_path: str | Path) -> tuple[set[nn.Module], list[str]]:
    """Give each linear stored as Q4_0 / Q4_1 in `gguf_path` its 4-bit kernel; (modules packed, skipped).

    Raises GGUFMismatchError when a layer's blocks do not reproduce its loaded weight.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    packed: set[nn.Module] = set()
    skipped: list[str] = []
    for layer_index, layer in enumerate(model.model.layers):
        for module_name, parts in GGUF_PARTS.items():
            module = layer.get_submodule(module_name)
            blocks = _layer_blocks(tensors, layer_index, parts, config)
            if blocks is None or module.weight.shape[1] % GROUP_SIZE:
                skipped.append(f"layers.{layer_index}.{module_name}")
                continue
            q, d, m = blocks
            weight = module.weight.detach().float()
            if q.shape != weight.shape:
                raise GGUFMismatchError(
                    f"quantization='gguf': blk.{layer_index}.{'+'.join(parts)} has shape {tuple(q.shape)}, "
                    f"the loaded layers.{layer_index}.{module_name} {tuple(weight.shape)}")
            error = (dequantize(q, d, m) - weight).abs().max().item()
            if error > MATCH_TOLERANCE * max(weight.abs().max().item(), 1e-30):
                raise GGUFMismatchError(
                    f"quantization='gguf': the blocks of blk.{layer_index}.{'+'.join(parts)} in {gguf_path} "
                    f"differ from the weight loaded from the same file by {error:.3g}; this architecture's "
                    f"tensor layout is not supported here: load it without quantization='gguf'")
            bias = module.effective_bias()
            module.packed = q4_linear(q, d, m, bias, module.weight.dtype)
            packed.add(module)
    return packed, skipped
