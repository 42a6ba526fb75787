"""Pure-torch twins of the Triton kernels: they define what each kernel must compute.

They run anywhere torch runs (the CPU engine path uses them) and are the oracle of the kernel tests.
Layouts (ARCHITECTURE.md, contract 4 for the cache and slots, contract 3 for the step's batch):
  key/value            [T, num_kv_heads, head_dim]                 one row per new token
  k_cache/v_cache      [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping         [T] int, slot = block_id * block_size + offset, -1 = do not store
  q / out              [T, num_heads, head_dim]                    tokens of all sequences, packed
  cu_seqlens_q         [S + 1] int32, sequence s owns q rows cu_seqlens_q[s] : cu_seqlens_q[s + 1]
  seq_lens             [S] int32, total context of s (cached tokens + its new tokens)
  block_tables         [S, max_blocks] int32, padded with -1
"""

from __future__ import annotations

import torch


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i]/value[i] into the cache slot slot_mapping[i] (in place); slots < 0 are skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len positions of one sequence, read through its block table: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    **_launch_hints: object,
) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V; computed in float32, returned in q's dtype.

    Query i of sequence s sits at absolute position seq_lens[s] - q_len[s] + i and sees keys
    0 .. that position. Query head h reads kv head h // (num_heads // num_kv_heads).
    Extra keyword arguments (max_seqlen_q, num_splits, ...) are launch hints of the Triton kernel,
    accepted and ignored so both functions can be called the same way.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], seq_len).float()  # [L, Hkv, D]
        v = gather_kv(v_cache, block_tables[s], seq_len).float()
        qs = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qs, k) * scale  # [Hkv, G, q_len, L]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, num_heads, head_dim)
        out[q_start:q_end] = o.to(out.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, as Hugging Face's LlamaRMSNorm rounds it.

    With residual: h = x + residual; returns (rms_norm(h), h), h being the next layer's residual.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (weight * normed).to(x.dtype)
    return y if residual is None else (y, residual)


def lora_bgmv_ref(
    x: torch.Tensor,
    out: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    slot_index: torch.Tensor,
) -> torch.Tensor:
    """out[t] += (x[t] @ a_stack[s].T) @ b_stack[s].T with s = slot_index[t] (in place); s < 0: nothing.

    x [T, in], out [T, out_features], a_stack [slots, R, in], b_stack [slots, out_features, R] (an adapter
    of a smaller rank is zero-padded to R, scaling folded into b), slot_index [T] int. The shrink product is
    kept in float32 and rounded once to x's dtype, as the kernel does.
    """
    for slot in torch.unique(slot_index[slot_index >= 0]).tolist():
        rows = (slot_index == slot).nonzero().flatten()
        shrunk = (x[rows].float() @ a_stack[slot].float().T).to(x.dtype)
        out.index_add_(0, rows, (shrunk.float() @ b_stack[slot].float().T).to(out.dtype))
    return out
