"""One Triton kernel for decode and (chunked) prefill attention over the paged KV cache.

Work decomposition: a program owns (a tile of query rows of one sequence, one kv head, one KV split).
- Query rows: BLOCK_Q tokens x GROUP query heads of the same kv head (GQA), so every K/V tile is loaded
  once for the whole group; BLOCK_M = BLOCK_Q * GROUP (rounded up to a power of two >= 16 for tl.dot).
- Keys: the program walks its sequence's context in tiles of BLOCK_N positions, looking up each position's
  physical block in the block table, with an online (flash) softmax in base 2.
- Split-KV (flash-decoding): with few programs and long contexts the context is cut into NUM_SPLITS
  ranges handled by separate programs; each writes its unnormalized partial (acc, running max, running
  sum) and a second kernel merges them with log-sum-exp weights.

Causality: query i of sequence s sits at absolute position seq_lens[s] - q_len[s] + i and sees keys
0 .. that position, so decode (q_len 1), a fresh prefill and a prefill chunk behind cached prefix blocks
are the same case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels._device import check_device

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (partials + merge) outweighs the parallelism
MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt_seq,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns q-blocks [cu[s] // BLOCK_Q + s, cu[s+1] // BLOCK_Q + s + 1): at least its
    # cdiv(q_len, BLOCK_Q) blocks, with no host-side count. Binary search for the owner of this block.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first >= q_len:  # spare block of the upper bound
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    row_pos = context_len + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=io_mask, other=0.0)

    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, q_len)  # keys seen by the block's last row
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    # Finite start: a row with no visible key in this split keeps row_max finite, so exp2 never sees
    # inf - inf.
    row_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    cols = tl.arange(0, BLOCK_N)
    k_base = k_cache_ptr + kv_head * stride_kc_head
    v_base = v_cache_ptr + kv_head * stride_vc_head
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * BLOCK_N + cols
        key_valid = key_pos < kv_end
        block = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k = tl.load(k_base + block[None, :] * stride_kc_block + slot[None, :] * stride_kc_slot
                    + dims[:, None],
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # [DIM_PAD, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(row_valid[:, None] & (key_pos[None, :] <= row_pos[:, None]), s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                    + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_N, DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    if NUM_SPLITS == 1:
        o = acc / tl.where(row_valid, row_sum, 1.0)[:, None]  # spare rows have row_sum 0 and are not stored
        tl.store(out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)
        tl.store(part_max_ptr + part, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_out_t,
    stride_out_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_valid = heads < NUM_HEADS
    heads = tl.minimum(heads, NUM_HEADS - 1)  # spare rows re-read the last head (never stored): no 0/0
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = (splits < NUM_SPLITS)[None, :]
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    part = (token * NUM_HEADS + heads[:, None]) * NUM_SPLITS + splits[None, :]  # [HEADS, SPLITS]
    # Split 0 always holds key 0, so each head's max is finite; empty splits weigh exp2(-1e30 - max) = 0.
    m = tl.load(part_max_ptr + part, mask=split_valid, other=float("-inf"))
    weight = tl.exp2(m - tl.max(m, axis=1)[:, None])
    total = tl.sum(weight * tl.load(part_sum_ptr + part, mask=split_valid, other=0.0), axis=1)
    acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                  mask=split_valid[:, :, None] & dim_valid[None, None, :], other=0.0)
    o = tl.sum(acc * weight[:, :, None], axis=1) / total[:, None]
    tl.store(out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & dim_valid[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and parallelism of one paged_attention launch."""

    block_m: int  # query rows per program (BLOCK_Q tokens x GROUP heads)
    block_n: int  # key positions per inner-loop tile
    num_splits: int
    num_warps: int
    num_stages: int


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small machine, so the split heuristic still gets exercised


def choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    elem_bytes: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_sms: int,
    num_splits: int | None = None,
) -> LaunchConfig:
    """Pick tiles (decode: 16 rows; prefill: 64) and the KV split count (few programs + long context).

    Register and shared-memory figures behind the tiles come from compiling for sm_90 (ptxas -v): with
    head_dim 128 the 16-bit configs use 80 (decode) and 193 (prefill) registers without spills; float32
    tl.dot (ieee) spills beyond 16 x 32 tiles, so float32 keeps the decode tiles for prefill too.
    """
    rows = max(16, triton.next_power_of_2(group))
    if max_seqlen_q == 1 or elem_bytes == 4:
        block_m, block_n, num_warps, num_stages = rows, 32, 4, 3
    else:
        block_m, block_n, num_warps, num_stages = max(64, rows), 64 if head_dim <= 128 else 32, 4, 2
    if num_splits is None:
        block_q = block_m // group
        programs = num_kv_heads * (num_seqs if max_seqlen_q == 1 else num_tokens // block_q + num_seqs)
        num_splits = 1
        while (num_splits < MAX_SPLITS and programs * num_splits < 4 * num_sms
               and max_seqlen_k // (2 * num_splits) >= MIN_KEYS_PER_SPLIT):
            num_splits *= 2
    return LaunchConfig(block_m, block_n, num_splits, num_warps, num_stages)


def _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} kv heads "
                         f"of dim {k_cache.shape[3]}: head dims must match and num_heads divide by "
                         "num_kv_heads")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,)),
                           ("seq_lens", seq_lens, (num_seqs,))):
        if t.dim() != 1 or tuple(t.shape) != shape or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64) of shape {list(shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, k_cache, v_cache need a contiguous last dim and block_tables contiguous rows")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dim, got "
                         f"{out.dtype} {tuple(out.shape)}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries [T, H, D] over the paged K/V cache; returns out [T, H, D].

    max_seqlen_q / max_seqlen_k (host ints) only steer the launch config, never the result; pass them to
    avoid a device sync (and when capturing CUDA graphs). num_splits forces the KV split count (1 = none).
    """
    _check(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    check_device(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens.max())
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None for the heuristic), got {num_splits}")
    cfg = choose_config(num_tokens=num_tokens, num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
                        head_dim=head_dim, elem_bytes=q.element_size(), max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k, num_sms=_num_sms(q.device), num_splits=num_splits)
    return launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out, cfg)


def launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale: float, out: torch.Tensor,
           cfg: LaunchConfig) -> torch.Tensor:
    """Run the kernel(s) with an explicit LaunchConfig (paged_attention picks one; benchmarks sweep them)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if cfg.block_m < group or cfg.block_m < 16:
        raise ValueError(f"block_m={cfg.block_m} must be >= 16 and >= the GQA group ({group})")
    block_q = cfg.block_m // group
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if cfg.num_splits > 1:
        parts = num_tokens * num_heads * cfg.num_splits
        part_acc = torch.empty(parts, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused: the NUM_SPLITS == 1 branch is compiled out
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, cfg.num_splits)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, part_acc, part_max, part_sum,
        scale * math.log2(math.e), num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, NUM_SPLITS=cfg.num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        splits_pad = triton.next_power_of_2(cfg.num_splits)
        heads_per_program = max(1, min(triton.next_power_of_2(num_heads), 4096 // (splits_pad * dim_pad)))
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, heads_per_program))](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=cfg.num_splits,
            SPLITS_PAD=splits_pad, HEADS_PER_PROGRAM=heads_per_program, num_warps=4,
        )
    return out
