"""quantization="gguf": the model runs on the GGUF file's own blocks instead of fp32 copies of them.

A GGUF model is converted once to safetensors by de-quantizing its blocks (loader.py); without this mode
the engine then runs fp32 weights, 4-7x the memory of the file. Here every matrix the file stores as
Q4_0, Q4_1 or Q8_0 keeps the file's codes and scales, and runs through the extension's q4_linear /
q8_linear (csrc/gguf_linear.cpp):
  - Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles;  w = d * q + m
  - Q4_0 block: fp16 d, 16 bytes of nibbles;          w = d * (q - 8), i.e. m = -8 d
  - Q8_0 block: fp16 d, 32 int8;                      w = d * q
(in a Q4 block byte j holds element j in its low nibble and element j + 16 in its high nibble: the
kernel reads that layout as it is). The linears of each decoder layer, the LM head and the token
embedding (rows de-quantized as they are looked up) are covered; a tied head shares the embedding's blocks.
So the weights are the same numbers the fp32 run uses (the de-quantized ones), and the output differs from
fp32's by the order of the float sums only.

Invariant checked at load: every matrix's blocks, de-quantized here, equal (within float rounding) the
weight the loader de-quantized from the same file, before that weight is released. A tensor name or a row
order we got wrong (llama.cpp stores Q and K rows permuted for its rotary layout; transformers undoes
that) fails at load, naming the tensor, instead of producing wrong text. Tensors of other types
(K-quants, F16, F32) keep the dense path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:  # the packed model is Llama's; imported for types only (models import layers)
    from transformers import PretrainedConfig

    from batchinfer.engine.layers.linear import LinearBase
    from batchinfer.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # elements per block in every supported format
# bytes per block: the fp16 scale(s) first, then the codes
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# the largest |difference| from the loader's de-quantized weight, relative to the matrix's max |w|
MATCH_TOLERANCE = 1e-5
# weight rows one thread expands to float32 at a time for a GEMM: about TILE_BYTES (an L2's share), a
# multiple of 16 rows within [16, 128] (128 rows measured best at SmolLM2's K = 576)
TILE_BYTES = 512 * 1024

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


class GGUFKernels(Protocol):
    """The block GEMMs of the CPU kernels' extension (csrc/gguf_linear.cpp): float32 x [N, K] -> [N, rows]."""

    def q8_linear(
        self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, tile_rows: int
    ) -> torch.Tensor:
        """x @ W.T for W in Q8_0 blocks (codes, scales d)."""
        ...

    def q4_linear(
        self, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, tile_rows: int
    ) -> torch.Tensor:
        """x @ W.T for W in Q4_0 / Q4_1 blocks (codes, scales d, minima m)."""
        ...


def gguf_kernel() -> GGUFKernels:
    """The extension holding q4_linear / q8_linear; a ValueError saying why where it cannot be built."""
    from batchinfer.engine.layers.cpu_attention import load

    extension = load()
    if extension is None:
        raise ValueError("quantization='gguf' runs on the native CPU kernels, which are disabled "
                         "(BATCHINFER_CPU_ATTENTION=sdpa) or could not be built (needs g++ and ninja); "
                         "run without quantization='gguf'")
    return cast(GGUFKernels, extension)  # the extension module: its functions are untyped


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, columns] matrix in a GGUF block format, rows = output features, columns % 32 == 0.

    codes: Q4 uint8 [rows, columns / 2] in GGUF's nibble layout, Q8 int8 [rows, columns];
    d, m: float32 [rows, columns / 32] (m is None for Q8_0).
    """

    kind: str  # "q4" or "q8"
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the matrix."""
        return self.d.shape[0], self.d.shape[1] * GROUP_SIZE

    def take_rows(self, index: torch.Tensor) -> BlockWeight:
        """The matrix with its rows reordered / selected by index."""
        m = None if self.m is None else self.m[index]
        return BlockWeight(self.kind, self.codes[index], self.d[index], m)

    def q4_codes(self) -> torch.Tensor:
        """A Q4 matrix's codes one per element, uint8 [rows, groups, 32] (the nibbles unpacked)."""
        rows, columns = self.shape
        nibbles = self.codes.reshape(rows, columns // GROUP_SIZE, GROUP_SIZE // 2)
        return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix the blocks stand for."""
        rows, columns = self.shape
        groups = columns // GROUP_SIZE
        if self.kind == "q8":
            q = self.codes.reshape(rows, groups, GROUP_SIZE).float()
            return (q * self.d[..., None]).reshape(rows, columns)
        q = self.q4_codes().float()
        if self.m is None:
            raise ValueError(f"{self.kind} blocks carry no offsets m")
        return (q * self.d[..., None] + self.m[..., None]).reshape(rows, columns)

    @staticmethod
    def stack(parts: list[BlockWeight]) -> BlockWeight:
        """Row-stack matrices of one kind (a fused qkv / gate_up)."""
        m = None if parts[0].m is None else torch.cat([cast(torch.Tensor, p.m) for p in parts])  # one kind
        codes, d = torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts])
        return BlockWeight(parts[0].kind, codes, d, m)


def decode_blocks(raw: np.ndarray, type_name: str, columns: int) -> BlockWeight:
    """A GGUF tensor's raw bytes ([rows, blocks * block bytes] uint8) -> its BlockWeight."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, columns // GROUP_SIZE, BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, columns)
        return BlockWeight("q8", torch.from_numpy(codes), torch.from_numpy(d), None)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:  # Q4_0: w = d * (q - 8)
        m = -8.0 * d
        nibbles = blocks[..., 2:]
    codes = nibbles.reshape(rows, columns // 2).copy()  # the reader's arrays map the file read-only
    return BlockWeight("q4", torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order transformers gives a Q/K tensor llama.cpp stored permuted (its reverse_permute)."""
    half = rows // n_head // 2
    # row (h, j, i) of the result is row (h, i, j) of the stored [n_head, half, 2] layout
    return torch.arange(rows).reshape(n_head, half, 2).transpose(1, 2).reshape(rows)


def tile_rows_for(columns: int) -> int:
    """Weight rows per float32 tile for a matrix of `columns` inputs."""
    return max(16, min(128, TILE_BYTES // (4 * columns) // 16 * 16))


def block_linear(weight: BlockWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearFn:
    """x -> x @ W.T + bias on the blocks (float32 inside, the result in `dtype`)."""
    kernel = gguf_kernel()
    tile_rows = tile_rows_for(weight.shape[1])
    codes, d = weight.codes.contiguous(), weight.d.float().contiguous()
    m = None if weight.m is None else weight.m.float().contiguous()
    bias = None if bias is None else bias.detach().float()

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        if m is None:
            out = kernel.q8_linear(flat, codes, d, tile_rows)
        else:
            out = kernel.q4_linear(flat, codes, d, m, tile_rows)
        if bias is not None:
            out += bias
        return out.to(dtype).reshape(*x.shape[:-1], out.shape[-1])

    return forward


def block_lookup(weight: BlockWeight, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids -> their rows of the matrix, de-quantized (the token embedding)."""

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        return weight.take_rows(ids.reshape(-1)).dequantize().to(dtype).reshape(*ids.shape, -1)

    return lookup


class GGUFBlockReader:
    """The GGUF file's tensors by name, decoded on request."""

    def __init__(self, gguf_path: str | Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        self.path = gguf_path
        self.tensors = {t.name: t for t in reader.tensors}
        field = reader.fields.get("general.architecture")
        self.architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
        # llama.cpp stores Q / K rows permuted for the llama architecture only (transformers undoes it there)
        self.permuted_qk = self.architecture == "llama"

    def blocks(self, name: str) -> BlockWeight | None:
        """The tensor as a BlockWeight, or None where it is absent or in another type."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.tensor_type.name not in BLOCK_BYTES:
            return None
        columns = int(tensor.shape[0])  # GGUF lists the fastest dimension first: [in, out]
        if columns % GROUP_SIZE:
            return None
        return decode_blocks(tensor.data, tensor.tensor_type.name, columns)

    def layer_blocks(
        self, layer: int, parts: tuple[str, ...], config: PretrainedConfig
    ) -> BlockWeight | None:
        """The row-stacked blocks of one fused module, or None where a part is not in one block kind."""
        found = []
        for part in parts:
            weight = self.blocks(f"blk.{layer}.{part}.weight")
            if weight is None:
                return None
            if self.permuted_qk and part in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
                weight = weight.take_rows(unpermute_rows(weight.shape[0], heads))
            found.append(weight)
        return BlockWeight.stack(found) if len({w.kind for w in found}) == 1 else None

    def check(self, blocks: BlockWeight, loaded: torch.Tensor, name: str, ours: str) -> None:
        """Raise GGUFMismatchError unless the blocks reproduce the loaded weight."""
        if blocks.shape != tuple(loaded.shape):
            raise GGUFMismatchError(f"quantization='gguf': {name} has shape {blocks.shape}, the loaded "
                                    f"{ours} {tuple(loaded.shape)}")
        # the loader rounded the same numbers to the model dtype (bf16 keeps 8 bits): compare at its precision
        weight = loaded.detach().float()
        rounded = blocks.dequantize().to(loaded.dtype).float()
        relative = max(MATCH_TOLERANCE, torch.finfo(loaded.dtype).eps)
        tolerance = relative * max(weight.abs().max().item(), 1e-30)
        error = (rounded - weight).abs().max().item()
        if error > tolerance:
            raise GGUFMismatchError(
                f"quantization='gguf': the blocks of {name} in {self.path} differ from the weight loaded "
                f"from the same file by {error:.3g}; this architecture's tensor layout is not supported "
                f"here: load it without quantization='gguf'")


def pack_gguf_blocks(model: nn.Module, gguf_path: str | Path) -> tuple[set[nn.Module], list[str]]:
    """Give each matrix stored in a block format in `gguf_path` its block kernel; (modules packed, skipped).

    The dense weights of the packed modules are released (the embedding table too once the embedding and
    a tied head both run on blocks). Raises GGUFMismatchError when blocks do not reproduce a loaded weight.
    """
    reader = GGUFBlockReader(gguf_path)
    llama = cast("LlamaForCausalLM", model)
    config = llama.config
    packed: set[nn.Module] = set()
    skipped: list[str] = []
    for index, layer in enumerate(llama.model.layers):
        for module_name, parts in GGUF_PARTS.items():
            module = cast("LinearBase", layer.get_submodule(module_name))
            blocks = reader.layer_blocks(index, parts, config)
            if blocks is None:
                skipped.append(f"layers.{index}.{module_name}")
                continue
            name = f"blk.{index}.{'+'.join(parts)}"
            reader.check(blocks, module.weight, name, f"layers.{index}.{module_name}")
            module.packed = block_linear(blocks, module.effective_bias(), module.weight.dtype)
            packed.add(module)
    embedding, head = llama.model.embed_tokens, llama.lm_head
    table = reader.blocks("token_embd.weight")
    if table is not None:
        reader.check(table, embedding.weight, "token_embd", "embed_tokens")
        embedding.lookup = block_lookup(table, embedding.weight.dtype)
    tied = head.weight is embedding.weight
    head_blocks = table if tied else reader.blocks("output.weight")
    if head_blocks is not None:
        if not tied:
            reader.check(head_blocks, head.weight, "output", "lm_head")
        head.packed = block_linear(head_blocks, None, head.weight.dtype)
        packed.add(head)
    else:
        skipped.append("lm_head")
    if table is None:
        skipped.append("embed_tokens")
    elif not tied or head_blocks is not None:  # nothing reads the dense table any more
        embedding.weight.data = embedding.weight.data.new_empty(0)
    if not tied and head_blocks is not None:
        head.weight.data = head.weight.data.new_empty(0)
    if not packed:
        types = sorted({t.tensor_type.name for t in reader.tensors.values()})
        raise ValueError(f"quantization='gguf': {gguf_path} holds no matrix in a block format this engine "
                         f"runs ({', '.join(BLOCK_BYTES)}; the file has {', '.join(types)}); run it without "
                         f"quantization='gguf' (de-quantized to the model dtype)")
    if skipped:
        logger.info("quantization='gguf': %d matrices on the file's blocks; dense (other types): %s",
                    len(packed), ", ".join(skipped))
    return packed, skipped
