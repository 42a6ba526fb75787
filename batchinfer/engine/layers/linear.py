"""Linear layers under their tensor-parallel names (vLLM's): column-parallel splits the output features
across ranks, row-parallel splits the input features and all-reduces the partial sums.

Rank and world size come from batchinfer.engine.parallel.distributed (set before the model is built). Each
parameter carries a `weight_loader(param, loaded, shard_id=None)` that the model loader calls; `loaded` is a
tensor or a safetensors slice (get_slice), so a rank reads only its own rows/columns from disk.
KV heads: with fewer KV heads than ranks each KV head is replicated on world_size / num_kv_heads ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers.context import current_float32_matmul_high, current_lora_batch
from batchinfer.engine.layers.partition import divide, local_kv_heads
from batchinfer.engine.parallel.distributed import all_reduce, tp_rank, tp_world_size

__all__ = ["local_kv_heads", "tp_rank", "tp_world_size"]


class TensorSlice(Protocol):
    """A safetensors lazy slice (safe_open.get_slice): its shape, and the part an index reads from disk."""

    def get_shape(self) -> list[int]:
        """The whole tensor's shape."""
        ...

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        """Read the indexed part."""
        ...


# What the loader hands a weight_loader: a whole tensor, or under tensor parallelism a lazy slice.
CheckpointTensor = torch.Tensor | TensorSlice


def shape_of(loaded: CheckpointTensor) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded: CheckpointTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Indices [start, start + length) along dim of a tensor or safetensors slice (reads only that part)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    return loaded[(slice(None),) * dim + (slice(start, start + length),)]


def read_all(loaded: CheckpointTensor) -> torch.Tensor:
    """The whole checkpoint tensor (a safetensors slice is read)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


class LinearBase(nn.Module):
    """y = x @ W.T (+ b); W is [output_size, input_size] as in nn.Linear; tp_dim is split across ranks.

    lora_key (set by lora.manager.LoRAManager.attach when LoRA is enabled): the adapter weights of this
    module; a step whose context carries a LoRABatch adds its adapters' deltas to their rows.
    """

    lora_key: str | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_world_size()
        # torch.empty: the loader overwrites every element, so skip nn.Linear's costly random init.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # torch's Parameter takes ad-hoc attributes
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # torch's Parameter takes ad-hoc attributes
        else:
            self.register_parameter("bias", None)
        # Set after loading by weight_packing.pack_linears (oneDNN / int8 kernel, bias included).
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The bf16x3 kernel of steps whose context asks for it (amx_linear.with_high_precision); None: none
        self.packed_high: Callable[[torch.Tensor], torch.Tensor] | None = None

    def effective_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (a row-parallel layer adds it on rank 0 only, so the sum stays right)."""
        return self.bias

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Copy this rank's slice of a checkpoint tensor into param."""
        if self.tp_size > 1 and param.dim() > self.tp_dim:  # a row-parallel bias is not split
            shard = param.size(self.tp_dim)
            expected = list(param.shape)
            expected[self.tp_dim] *= self.tp_size
            if shape_of(loaded) != tuple(expected):
                raise ValueError(
                    f"checkpoint tensor has shape {shape_of(loaded)}, the model expects {tuple(expected)}"
                )
            _checked_copy(param.data, read_part(loaded, self.tp_dim, self.tp_rank * shard, shard))
        else:
            _checked_copy(param.data, read_all(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the (local slice of the) linear map (plus the step's LoRA deltas on an adapted module)."""
        high = self.packed_high is not None and current_float32_matmul_high()
        kernel = self.packed_high if high else self.packed
        out = kernel(x) if kernel is not None else F.linear(x, self.weight, self.effective_bias())
        if self.lora_key is not None:
            lora = current_lora_batch()
            if lora is not None:
                return lora.apply(self.lora_key, x, out)
        return out


def _take_rows(
    loaded: CheckpointTensor, shard_index: int, num_shards: int, size: int, dst: torch.Tensor
) -> torch.Tensor:
    """Shard shard_index (`size` rows) of a checkpoint projection that should hold size * num_shards rows."""
    expected = (size * num_shards, *dst.shape[1:])
    if shape_of(loaded) != expected:
        raise ValueError(f"checkpoint tensor has shape {shape_of(loaded)}, the model expects {expected}")
    return read_part(loaded, 0, shard_index * size, size)


def _checked_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}"
        )
    dst.copy_(src)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_world_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Load checkpoint projection number shard_id into its rows of the fused matrix."""
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError(
                    "a fused gate/up checkpoint tensor cannot be split across tensor-parallel ranks"
                )
            return super().weight_loader(param, loaded)
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        dst = param.data.narrow(0, offset, size)
        _checked_copy(dst, _take_rows(loaded, self.tp_rank, self.tp_size, size, dst))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused in one matmul; Q heads split across ranks, KV heads split
    too or, when there are fewer KV heads than ranks, replicated (rank r holds KV head r * Hkv // tp)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        self.num_kv_heads = local_kv_heads(num_kv_heads, tp)
        self.total_num_kv_heads = num_kv_heads
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp  # the parent divides by tp
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: str | None = None
    ) -> None:
        """Load checkpoint projection shard_id ('q', 'k' or 'v') into its rows of the fused matrix."""
        if shard_id is None:
            if self.tp_size > 1:
                raise ValueError("a fused qkv checkpoint tensor cannot be split across tensor-parallel ranks")
            return super().weight_loader(param, loaded)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        dst = param.data.narrow(0, offset, size)
        if shard_id == "q":
            part = _take_rows(loaded, self.tp_rank, self.tp_size, size, dst)
        else:
            num_shards = self.total_num_kv_heads // self.num_kv_heads
            part = _take_rows(loaded, self.tp_rank * num_shards // self.tp_size, num_shards, size, dst)
        _checked_copy(dst, part)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed by one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_world_size()), output_size, bias, tp_dim=1)

    def effective_bias(self) -> torch.Tensor | None:
        """The bias is added once (by rank 0) so the all-reduced sum stays right."""
        return self.bias if self.tp_rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on this rank's slice, all-reduced across ranks."""
        return all_reduce(super().forward(x))
