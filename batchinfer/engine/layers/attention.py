"""Paged attention layer: writes the step's new K/V into the paged cache through slot_mapping, then
attends each query to its sequence's cached keys read through the block table.

Two backends, picked per step by the model runner (EngineConfig.attention_backend):
- "triton" (CUDA): kernels.store_kvcache + kernels.paged_attention, one launch each per layer.
- "torch" (CPU, or forced): the cache is read by whole blocks into padded batches and handed to one
  scaled_dot_product_attention call per group of similar-length sequences. The gather indices and masks
  depend only on the batch layout, so attention_plan.build_torch_plan computes them once per step for
  all layers. On CPU in float32, decode tokens (one query per sequence) instead go to the native kernel
  of cpu_attention, which reads the blocks in place (no padded copy); prefill chunks keep SDPA.
- "dense" (embeddings, any device): whole inputs packed, no cache read or written; one causal SDPA per
  group of similar-length inputs padded at the end (attention_plan.build_dense_groups).

Cache layout (ARCHITECTURE.md, contract 4), shared with kernels/: k_cache/v_cache
[num_blocks, block_size, num_kv_heads, head_dim]; position p of a sequence is row p % block_size of block
block_table[p // block_size].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers import cpu_attention
from batchinfer.engine.layers.attention_plan import DenseGroup, TorchAttentionPlan, attend_group
from batchinfer.engine.layers.context import get_context
from batchinfer.engine.layers.quantized_attention import QuantizedKV, quantized_paged_attention


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Store k/v [T, Hkv, D] into the cache, then attend q [T, H, D]; returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    ops = cpu_attention.fused_ops_for(k_cache)
    if ops is not None and k.stride(-1) == 1 and k.stride(-2) == head_dim and v.stride(-2) == head_dim:
        ops.store_kv_(k, v, k_cache, v_cache, plan.store_slots, plan.store_rows)  # one pass, no copies
    else:
        if plan.store_rows is not None:
            k, v = k.index_select(0, plan.store_rows), v.index_select(0, plan.store_rows)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.store_slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.store_slots, v)
    k_blocks, v_blocks = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    out = torch.empty_like(q)
    native = plan.native_decode
    if native is not None:
        if native.token_index is None:
            cpu_attention.paged_decode_attention(
                out, q, k_cache, v_cache, native.block_tables, native.seq_lens, scale
            )
        else:
            queries = q.index_select(0, native.token_index)
            o = cpu_attention.paged_decode_attention(
                torch.empty_like(queries), queries, k_cache, v_cache, native.block_tables, native.seq_lens,
                scale,
            )
            out.index_copy_(0, native.token_index, o)
    for g in plan.groups:
        n, length = g.num_seqs, g.num_blocks * block_size
        # [n, Hkv, L, D] views over rows gathered whole blocks at a time (contiguous copies of block_size
        # rows).
        keys = k_blocks.index_select(0, g.block_ids).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        values = v_blocks.index_select(0, g.block_ids).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        attend_group(q, keys, values, g, out, scale=scale, num_kv_heads=num_kv_heads)
    return out



class Attention(nn.Module):
    """Attention over the paged KV cache of this layer (k_cache/v_cache are bound by the model runner)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.quantized_kv: QuantizedKV | None = None  # set by the model runner when kv_cache_dtype quantizes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (rotated) -> attention output [T, H * D]."""
        ctx = get_context()
        if ctx.backend == "dense":  # packed whole inputs, no KV cache (ModelRunner.embed)
            o = self._dense(q, k, v, ctx.dense_groups)
        elif ctx.backend == "triton":
            import batchinfer.kernels as kernels

            kernels.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
            o = kernels.paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                cu_seqlens_q=ctx.cu_seqlens_q,
                seq_lens=ctx.seq_lens,
                block_tables=ctx.block_tables,
                scale=self.scale,
                max_seqlen_q=ctx.max_seqlen_q,
                max_seqlen_k=ctx.max_seqlen_k,
            )
        else:
            if ctx.torch_plan is None:
                raise RuntimeError("torch attention backend selected but the step has no torch plan")
            if self.quantized_kv is not None:
                o = quantized_paged_attention(q, k, v, self.quantized_kv, ctx.torch_plan, self.scale)
            else:
                o = torch_paged_attention(q, k, v, self.k_cache, self.v_cache, ctx.torch_plan, self.scale)
        return o.reshape(-1, self.num_heads * self.head_dim)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[DenseGroup] | None
               ) -> torch.Tensor:
        """Causal attention within each packed input, no cache: one SDPA per group of similar lengths."""
        gqa = self.num_heads != self.num_kv_heads
        if groups is None:  # the tokens are one input
            return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  is_causal=True, scale=self.scale,
                                                  enable_gqa=gqa).transpose(0, 1)
        num_tokens = q.shape[0]
        # Rows gathered from contiguous 2-D copies: index_select over the strided [T, H, D] views of the fused
        # qkv output is several times slower than the copy.
        flat = [t.reshape(num_tokens, -1).contiguous() for t in (q, k, v)]
        out = q.new_empty(num_tokens, self.num_heads * self.head_dim)
        for g in groups:
            n, length = g.num_seqs, g.length
            if g.token_index is None:
                rows = [t.narrow(0, g.start, n * length) for t in flat]
            else:
                rows = [t.index_select(0, g.token_index) for t in flat]
            gq, gk, gv = (t.view(n, length, -1, self.head_dim).transpose(1, 2) for t in rows)
            o = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True, scale=self.scale, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(n * length, -1)
            target = out.narrow(0, g.start, n * length if g.valid_rows is None else len(g.valid_rows))
            if g.valid_rows is None:
                target.copy_(o)
            else:
                torch.index_select(o, 0, g.valid_rows, out=target)
        return out
