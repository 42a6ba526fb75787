"""Linear layers under their tensor-parallel names (vLLM's): column-parallel splits the output features
across ranks, row-parallel splits the input features and all-reduces the partial sums.

Tensor parallelism itself comes later: today the world size is 1, so every layer holds the full matrix.
The weight loaders already take the rank's slice, so TP only needs the process group and the all-reduce.
Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that the model loader calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def tp_rank() -> int:
    """This process's tensor-parallel rank (always 0 until tensor parallelism lands)."""
    return 0


def tp_world_size() -> int:
    """Number of tensor-parallel ranks (always 1 until tensor parallelism lands)."""
    return 1


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x @ W.T (+ b); W is [output_size, input_size] as in nn.Linear. tp_dim: the dim split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_world_size()
        # torch.empty: the loader overwrites every element, so skip nn.Linear's costly random init.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of a checkpoint tensor into param."""
        if self.tp_dim is not None and self.tp_size > 1 and param.dim() > self.tp_dim:
            shard = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * shard, shard)
        _checked_copy(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the (local slice of the) linear map."""
        return F.linear(x, self.weight, self.bias)


def _take_rows(loaded: torch.Tensor, rank: int, tp_size: int, size: int, dst: torch.Tensor) -> torch.Tensor:
    """This rank's `size` rows of a checkpoint projection that should hold size * tp_size rows."""
    expected = (size * tp_size, *dst.shape[1:])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {expected}")
    return loaded.narrow(0, rank * size, size)


def _checked_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """The same full matrix on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, tp_world_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Load checkpoint projection number shard_id into its rows of the fused matrix."""
        if shard_id is None:
            return super().weight_loader(param, loaded)
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        dst = param.data.narrow(0, offset, size)
        _checked_copy(dst, _take_rows(loaded, self.tp_rank, self.tp_size, size, dst))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections fused in one matmul; KV heads split across ranks like Q heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = _divide(num_kv_heads, tp)
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Load checkpoint projection shard_id ('q', 'k' or 'v') into its rows of the fused matrix."""
        if shard_id is None:
            return super().weight_loader(param, loaded)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        dst = param.data.narrow(0, offset, size)
        _checked_copy(dst, _take_rows(loaded, self.tp_rank, self.tp_size, size, dst))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce once TP lands)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, tp_world_size()), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on this rank's slice; the bias is added once (by rank 0) so the sum stays right."""
        return F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
