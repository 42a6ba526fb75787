"""DecodeGraphs: CUDA graphs of decode-only steps (one new token per sequence), the runner's replay path.

Captured at start, once per ladder batch size (1, 2, 4, 8, ... up to max_num_seqs), largest first, sharing
one memory pool; a step of n sequences replays the smallest graph of at least n, its layout copied into the
static tensors the graphs read (padding rows write no cache slot and attend to slot 0: finite, discarded).
Prefill steps, steps with LoRA adapters (captured without them) and block tables wider than captured run
eagerly.
"""

from __future__ import annotations

import torch

from batchinfer.engine.layers.context import AttentionContext, set_context


def ladder_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below max_num_seqs, then max_num_seqs."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """The captured decode graphs of one model (none until `capture`)."""

    def __init__(self, *, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode batch size -> captured graph
        self._static: dict[str, torch.Tensor] = {}

    def size_for(self, context: AttentionContext, *, num_seqs: int, decode_only: bool) -> int | None:
        """The graph size that replays this step, or None to run it eagerly."""
        if not self.graphs or not decode_only or context.lora is not None:
            return None  # the graphs are captured without adapters
        if context.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        for size in sorted(self.graphs):
            if size >= num_seqs:
                return size
        return None

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, *, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> None:
        """Capture model's decode step per ladder batch size, sharing one memory pool."""
        max_bs = self.max_num_seqs
        self._static = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=device),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=device),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            "hidden": torch.zeros(max_bs, hidden_size, dtype=dtype, device=device),
        }
        s = self._static
        pool = None
        for size in reversed(ladder_sizes(max_bs)):
            context = AttentionContext(
                slot_mapping=s["slot_mapping"][:size],
                cu_seqlens_q=s["cu_seqlens_q"][: size + 1],
                seq_lens=s["seq_lens"][:size],
                block_tables=s["block_tables"][:size],
                max_seqlen_q=1,
                max_seqlen_k=self.max_model_len,  # the launch config must hold for any decode length
                backend="triton",
            )
            set_context(context)
            try:
                s["hidden"][:size] = model(s["input_ids"][:size], s["positions"][:size])  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    s["hidden"][:size] = model(s["input_ids"][:size], s["positions"][:size])
            finally:
                set_context(None)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
            torch.cuda.synchronize(device)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: AttentionContext, *,
               num_seqs: int, size: int) -> torch.Tensor:
        """The step's last hidden states [num_seqs, hidden], from the graph of `size` (size_for's answer)."""
        s, n = self._static, num_seqs
        s["input_ids"][:n] = input_ids
        s["positions"][:n] = positions
        s["slot_mapping"][:n] = context.slot_mapping
        s["slot_mapping"][n:size] = -1  # padding rows write nothing
        s["seq_lens"][:n] = context.seq_lens
        s["seq_lens"][n:size] = 1  # padding rows attend to slot 0 of block 0: finite, discarded
        width = context.block_tables.shape[1]
        s["block_tables"][:n, :width] = context.block_tables
        s["block_tables"][n:size] = 0
        self.graphs[size].replay()
        return s["hidden"][:n]
