"""A GGUF model's float32 linears on AMX tiles over its exact 4-bit blocks (csrc/amx_block_gemm.cpp).

Why: a model de-quantized from a Q4_0 / Q4_1 file (SmolLM2's alias is Q4_1) holds float32 weights that are
exactly W = d q + m per group of 32 inputs (q in 0..15, d and m the file's fp16 scales): 4.5 bits of
information in 32. Its float32 GEMMs on AVX-512 FMAs are arithmetic-bound from ~16 rows. The block kernel
multiplies float32 x by the codes on AMX's bf16 tiles with every product exact (x split into three
bfloat16s; q is an integer below 16) and every sum in float32, then scales each 32-input group's sums by d
and adds m times the group's sum of x: float32 arithmetic on the same weights, regrouped (its largest
error against float64 is below the panel GEMM's in tests/engine/test_exact_blocks.py), at 0.75 bytes per
parameter instead of 4. Unlike float32_matmul_precision "high" (bf16x3), no bit of a weight or of x is
dropped, so it runs under every float32_matmul_precision, "highest" included. (As everywhere on AMX and in
bf16 conversions, subnormal inputs count as zero, and below ~2^-110 the third part of x, itself subnormal,
is dropped: values far below any activation's.)

When: float32 on CPU, no quantization, one rank (no tensor or pipeline parallelism), BATCHINFER_CPU_LINEAR
unset ("auto"; "panel" / "onednn" keep those kernels: the A/B switch), the native kernels built with AMX
bf16 and granted the tile state, and the model named by an alias or a .gguf path. Each decoder layer's
fused linear whose parts are all Q4_0 / Q4_1 blocks and whose loaded float32 weight equals d q + m
exactly (every element compared in float64 at load: a permuted row or a rounded sum fails it) runs here;
any other keeps its kernel (logged). The LM head keeps its own (the greedy head screen reads its table).
Under float32_matmul_precision "auto" embeddings still get bf16x3 beside the blocks (amx_linear.py, packed
from weight(): its GEMM runs ~2x this one at the 1000s of rows an embeddings forward packs); "high" keeps
the blocks for the linears (as fast at a decode step's rows, and exact).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from batchinfer.engine.layers.amx_linear import amx_extension
from batchinfer.engine.layers.gguf_weights import GGUF_PARTS, BlockWeight, GGUFBlockReader
from batchinfer.engine.model_files import cache_dir, gguf_source
from batchinfer.engine.native.cpu_features import CPU_LINEAR_ENV

if TYPE_CHECKING:
    from batchinfer.engine.layers.linear import LinearBase
    from batchinfer.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
FIELDS = ("codes", "d", "m")  # a BlockWeight's tensors in the blocks cache, in constructor order
BLOCKS_CACHE_VERSION = 1  # in the cache key: a change to what layer_blocks stores (row order, parts) bumps it
CHECK_ELEMENTS = 1 << 20  # elements exactly_equal compares at a time


class ExactBlockLinear:
    """x -> x @ W.T + bias for W = d q + m in 4-bit blocks, float32 on AMX tiles (amx_block_linear).

    float32 in and out. A class so that worker/native_step.py can hand the codes to the C++ decoder stack.
    """

    def __init__(self, blocks: BlockWeight, bias: torch.Tensor | None, extension: Any, *,
                 keep_blocks: bool = False) -> None:
        if blocks.kind != "q4" or blocks.m is None:
            raise ValueError(f"ExactBlockLinear: 4-bit blocks with offsets, not {blocks.kind}")
        rows, columns = blocks.shape
        codes = blocks.q4_codes().reshape(rows, columns).contiguous()
        self.codes, self.scales = extension.pack_amx_blocks(codes, blocks.d.float().contiguous(),
                                                            blocks.m.float().contiguous())
        # the file's blocks again (0.75 bytes per parameter), for weight(): only where embeddings may want
        # bf16x3 beside the blocks (float32_matmul_precision "auto")
        self.blocks = blocks if keep_blocks else None
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = rows, columns
        self._extension = extension

    def weight(self) -> torch.Tensor | None:
        """The [N, K] float32 weight again, exactly (d q + m, as the load checked); None: blocks not kept."""
        return None if self.blocks is None else self.blocks.dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"ExactBlockLinear: x has {x.shape[-1]} features, the weight {self.in_features}")
        if x.dim() != 2:  # the engine's activations are [T, features]; keep any other caller working
            return self(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        return self._extension.amx_block_linear(x, self.codes, self.scales, self.bias, self.out_features)


def exactly_equal(blocks: BlockWeight, weight: torch.Tensor) -> bool:
    """True when the float32 weight is d q + m of the blocks, element for element, with no rounding."""
    if blocks.kind != "q4" or blocks.m is None or tuple(weight.shape) != blocks.shape \
            or weight.dtype != torch.float32:
        return False
    rows, columns = blocks.shape
    step = max(1, CHECK_ELEMENTS // columns)  # float64 temporaries of a few MB, not the whole matrix's
    for start in range(0, rows, step):
        part = BlockWeight("q4", blocks.codes[start:start + step], blocks.d[start:start + step],
                           blocks.m[start:start + step])
        q = part.q4_codes().double()
        exact = (q * part.d.double()[..., None] + cast(torch.Tensor, part.m).double()[..., None])
        if not torch.equal(exact.reshape(-1, columns), weight[start:start + step].detach().double()):
            return False
    return True


def exact_blocks_source(*, model: str, dtype: torch.dtype, device: torch.device, quantization: str | None,
                        ranks: int) -> Path | None:
    """The .gguf file whose blocks a model of this configuration runs its linears on, or None (see When)."""
    if not (dtype == torch.float32 and device.type == "cpu" and quantization is None and ranks == 1
            and os.environ.get(CPU_LINEAR_ENV, "auto") == "auto") or amx_extension() is None:
        return None
    try:
        return gguf_source(model)
    except FileNotFoundError:  # an alias served from the conversion cache after its package went away
        return None


def pack_exact_blocks(model: nn.Module, gguf_path: Path, *, keep_blocks: bool = False) -> int:
    """Give each decoder linear whose float32 weight is exactly its GGUF blocks the block kernel; how many.

    keep_blocks: each kernel keeps the file's blocks too, for ExactBlockLinear.weight()
    (float32_matmul_precision "auto": embeddings pack bf16x3 from it).
    """
    extension = amx_extension()
    if extension is None:
        return 0
    llama = cast("LlamaForCausalLM", model)
    found = layer_blocks(gguf_path, llama)
    packed, kept = 0, []
    for index, layer in enumerate(llama.model.layers):
        for module_name in GGUF_PARTS:
            module = cast("LinearBase", layer.get_submodule(module_name))
            weight = _dense_float32(module)
            blocks = found.get((index, module_name))
            if weight is None or blocks is None or not exactly_equal(blocks, weight):
                kept.append(f"layers.{index}.{module_name}")
                continue
            module.packed = ExactBlockLinear(blocks, module.effective_bias(), extension,
                                             keep_blocks=keep_blocks)
            if module.weight.numel() > 0:  # kept dense (no panels): the codes replace it
                module.weight.data = module.weight.data.new_empty(0)
            packed += 1
    if kept:
        logger.info("exact 4-bit blocks: %d linears on AMX, %d keep their kernel (not exactly d q + m "
                    "blocks): %s", packed, len(kept), ", ".join(kept[:8]))
    return packed


def layer_blocks(gguf_path: Path, model: LlamaForCausalLM) -> dict[tuple[int, str], BlockWeight]:
    """Each decoder linear's 4-bit blocks in the file (Q / K rows in transformers' order), by (layer, name).

    Cached as safetensors in the cache directory, keyed by the file's path, size and mtime: gguf's reader
    takes ~4 s on SmolLM2's file (its tokenizer's strings), the cache ~0.1 s. A damaged cache is read again
    from the file; the load's bit-for-bit check guards the weights either way.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    stat = gguf_path.stat()
    identity = f"{BLOCKS_CACHE_VERSION}\0{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()
    cached = cache_dir() / "gguf_blocks" / f"{gguf_path.stem}-{key[:16]}.safetensors"
    if cached.is_file():
        try:
            tensors = load_file(cached)
            return {(int(layer), name): BlockWeight("q4", *(tensors[f"{layer}:{name}:{f}"] for f in FIELDS))
                    for layer, name, field in (k.split(":") for k in tensors) if field == "codes"}
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            logger.warning("exact 4-bit blocks: cache %s unreadable (%s); reading %s again", cached, exc,
                           gguf_path)
    reader = GGUFBlockReader(gguf_path)
    found: dict[tuple[int, str], BlockWeight] = {}
    for index in range(len(model.model.layers)):
        for module_name, parts in GGUF_PARTS.items():
            blocks = reader.layer_blocks(index, parts, model.config)
            if blocks is not None and blocks.kind == "q4" and blocks.m is not None:
                found[(index, module_name)] = blocks
    tensors = {f"{layer}:{name}:{field}": value.contiguous() for (layer, name), blocks in found.items()
               for field, value in zip(FIELDS, (blocks.codes, blocks.d, blocks.m), strict=True)
               if value is not None}
    partial: Path | None = None
    try:  # only a speed-up: a cache that cannot be written (read-only, disk full) costs the next load ~4 s
        cached.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{cached.name}.", suffix=".tmp", dir=cached.parent)
        os.close(handle)
        partial = Path(name)
        save_file(tensors, partial)
        os.replace(partial, cached)  # atomic: a concurrent reader sees the whole file or none
    except OSError as exc:
        logger.warning("exact 4-bit blocks: could not cache them in %s (%s)", cached.parent, exc)
        if partial is not None:
            partial.unlink(missing_ok=True)
    return found


def _dense_float32(module: LinearBase) -> torch.Tensor | None:
    from batchinfer.engine.layers.amx_linear import dense_weight

    found = dense_weight(module)
    return None if found is None else found[0]
