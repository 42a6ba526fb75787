"""Batched LoRA (punica's BGMV): each token's adapter delta added to a linear layer's output in two kernels.

shrink: y[t] = x[t] @ A[s].T   (s = slot_index[t]; rows of base tokens, s < 0, are zero)
expand: out[t] += y[t] @ B[s].T

Stacked per slot: a_stack [slots, R, in], b_stack [slots, out_features, R] (smaller ranks zero-padded,
scaling folded into B). One program per (token, block of R or of output features); the products are
accumulated in float32, y is stored in x's dtype. The twin is kernels.reference.lora_bgmv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._device import check_device


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, y_ptr, slot_ptr, in_features, rank,
                        stride_x, stride_a_slot, stride_a_row, stride_y,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    r_block = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    rows = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < in_features
            x = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_a_slot + rows[:, None] * stride_a_row + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + token * stride_y + rows, acc.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, out_ptr, slot_ptr, out_features, rank,
                        stride_y, stride_b_slot, stride_b_row, stride_out,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < out_features
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            r_mask = rs < rank
            y = tl.load(y_ptr + token * stride_y + rs, mask=r_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_row + rs[None, :],
                        mask=col_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * y[None, :], axis=1)
        previous = tl.load(out_ptr + token * stride_out + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * stride_out + cols, (previous + acc).to(out_ptr.dtype.element_ty),
                 mask=col_mask)


def lora_bgmv(x: torch.Tensor, out: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
              slot_index: torch.Tensor) -> torch.Tensor:
    """out[t] += (x[t] @ a_stack[s].T) @ b_stack[s].T, s = slot_index[t], in place (s < 0: unchanged)."""
    tokens, in_features = x.shape
    slots, rank, a_in = a_stack.shape
    out_features = out.shape[1]
    if a_in != in_features or b_stack.shape != (slots, out_features, rank):
        raise ValueError(f"a_stack {tuple(a_stack.shape)} / b_stack {tuple(b_stack.shape)} do not fit x "
                         f"{tuple(x.shape)} and out {tuple(out.shape)}")
    if slot_index.shape != (tokens,) or out.shape[0] != tokens:
        raise ValueError(f"slot_index {tuple(slot_index.shape)} and out {tuple(out.shape)} need {tokens} "
                         "rows")
    check_device(x, out, a_stack, b_stack, slot_index)
    if tokens == 0 or rank == 0:
        return out
    x, a_stack, b_stack = x.contiguous(), a_stack.contiguous(), b_stack.contiguous()
    slot_index = slot_index.to(torch.int32).contiguous()
    y = torch.empty(tokens, rank, dtype=x.dtype, device=x.device)
    block_r = min(64, triton.next_power_of_2(rank))
    block_k = min(128, triton.next_power_of_2(in_features))
    _lora_shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, a_stack, y, slot_index, in_features, rank,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_K=block_k)
    block_n = min(128, triton.next_power_of_2(out_features))
    target = out if out.stride(-1) == 1 else out.contiguous()
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        y, b_stack, target, slot_index, out_features, rank,
        y.stride(0), b_stack.stride(0), b_stack.stride(1), target.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r)
    if target is not out:
        out.copy_(target)
    return out
