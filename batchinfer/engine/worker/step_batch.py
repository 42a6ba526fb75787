"""One step's flat batch: the scheduled sequences' new tokens packed, with the layout tensors attention reads.

ModelRunner (and a pipeline stage) build one per step (ARCHITECTURE.md, contract 3): for each (seq, n) the
tokens seq.token_ids[c : c + n] (c = seq.num_computed_tokens) run at positions c .. c + n - 1, their K/V go
to the cache slots of seq.block_table, and every query attends causally to all earlier positions of its
sequence.

  input_ids, positions  [T]        packed new tokens of all sequences
  slot_mapping          [T] int64  block_table[pos // block_size] * block_size + pos % block_size
  cu_seqlens_q          [S+1] int32 prefix sums of the per-sequence new-token counts
  seq_lens              [S] int32  c + n, the context after this step
  block_tables          [S, max_blocks] int32, padded with -1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchinfer.engine.layers.attention_plan import build_torch_plan
from batchinfer.engine.layers.context import AttentionContext

if TYPE_CHECKING:
    from batchinfer.engine.lora.manager import LoRAManager
    from batchinfer.engine.worker.runner_protocol import ScheduledSequence


@dataclass
class StepBatch:
    """The packed inputs of one forward and the rows whose logits it returns."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [rows] int64: the flat tokens whose logits come back, in batch order
    context: AttentionContext  # the layout tensors above, set as the step's attention context
    num_seqs: int
    is_decode_only: bool  # every sequence runs one token (CUDA graphs replay such steps)


def build_step_batch(
    scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None, *,
    block_size: int, max_model_len: int, attention_backend: str, native_decode: bool, dtype: torch.dtype,
    device: torch.device, lora_manager: LoRAManager | None,
) -> StepBatch:
    """The step's batch; ValueError for an entry the block manager or scheduler got wrong.

    logits_counts[i] (default 1 each): the logits of entry i's last c scheduled tokens (speculative
    verification); native_decode: decode tokens go to the native CPU kernel (attention_plan.py).
    """
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for seq, num_new in scheduled:
        check_entry(seq, num_new, block_size=bs, max_model_len=max_model_len)
        start = seq.num_computed_tokens
        end = start + num_new
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        q_lens.append(num_new)
        seq_lens.append(end)
        tables.append(seq.block_table)
    num_seqs = len(scheduled)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions_t = torch.tensor(positions, dtype=torch.long)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
    slot_mapping = block_tables[seq_index, positions_t // bs].long() * bs + positions_t % bs
    cu_seqlens_q = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(q_lens_t, 0, out=cu_seqlens_q[1:])
    logits_indices = cu_seqlens_q[1:].long() - 1
    if logits_counts is not None:
        logits_indices = last_positions(logits_indices, logits_counts, q_lens)
    plan = None
    if attention_backend == "torch":
        plan = build_torch_plan(
            q_lens=q_lens, seq_lens=seq_lens, block_tables=tables, slot_mapping=slot_mapping.to(device),
            block_size=bs, dtype=dtype, device=device, native_decode=native_decode,
        )
    context = AttentionContext(
        slot_mapping=to_device(slot_mapping, device),
        cu_seqlens_q=to_device(cu_seqlens_q, device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        block_tables=to_device(block_tables, device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        backend=attention_backend,
        torch_plan=plan,
        lora=None if lora_manager is None else lora_manager.batch_for(scheduled),
    )
    return StepBatch(
        input_ids=to_device(torch.tensor(input_ids, dtype=torch.long), device),
        positions=to_device(positions_t, device),
        logits_indices=to_device(logits_indices, device),
        context=context,
        num_seqs=num_seqs,
        is_decode_only=max(q_lens) == 1,
    )


def check_entry(seq: ScheduledSequence, num_new: int, *, block_size: int, max_model_len: int) -> None:
    """ValueError unless seq's next num_new tokens can run: they exist, fit max_model_len and have slots."""
    start = seq.num_computed_tokens
    end = start + num_new
    if num_new < 1 or end > len(seq.token_ids):
        raise ValueError(
            f"scheduled {num_new} tokens from position {start} of a sequence with "
            f"{len(seq.token_ids)} tokens: need 1 <= n <= len(token_ids) - num_computed_tokens"
        )
    if end > max_model_len:
        raise ValueError(f"sequence reaches position {end} > max_model_len {max_model_len}")
    if len(seq.block_table) * block_size < end:
        raise ValueError(
            f"block_table holds {len(seq.block_table)} blocks ({len(seq.block_table) * block_size} slots) "
            f"but the step needs {end} positions; the block manager must allocate before the step"
        )


def check_logits_count(count: int, q_len: int) -> None:
    """ValueError unless 1 <= count <= q_len (the logits asked of an entry of q_len scheduled tokens)."""
    if not 1 <= count <= q_len:
        raise ValueError(f"logits_counts: {count} logits asked of an entry of {q_len} scheduled tokens")


def last_positions(last: torch.Tensor, counts: Sequence[int], q_lens: list[int]) -> torch.Tensor:
    """Flat token indices of each entry's last counts[i] tokens, entry by entry ([sum(counts)] int64)."""
    if len(counts) != len(q_lens):
        raise ValueError(f"logits_counts has {len(counts)} entries for a step of {len(q_lens)} sequences")
    for count, q_len in zip(counts, q_lens, strict=True):
        check_logits_count(count, q_len)
    counts_t = torch.tensor(counts, dtype=torch.long)
    ends = torch.repeat_interleave(last + 1, counts_t)
    offsets = torch.arange(int(counts_t.sum())) - torch.repeat_interleave(torch.cumsum(counts_t, 0), counts_t)
    return ends + offsets


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """tensor on device: itself on a CPU, else copied from pinned memory without blocking the host."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
