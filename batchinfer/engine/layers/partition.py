"""How tensor parallelism splits a layer's widths across ranks (vLLM's `divide`), in one import-free module:
the linear layers and the LoRA adapter loader both shape their shards by it, and neither imports the other.
"""

from __future__ import annotations


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, refused unless it splits evenly across the tensor-parallel ranks."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held per rank: an even split, or 1 (replicated) when there are fewer KV heads than ranks."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size {tp_size} is neither a divisor nor a multiple of num_key_value_heads="
            f"{num_kv_heads}"
        )
    return 1
