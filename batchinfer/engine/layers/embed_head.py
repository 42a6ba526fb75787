"""Token embedding and LM head, vocab-parallel: rank r holds the contiguous vocab rows
[r * per_rank, (r + 1) * per_rank), per_rank = ceil(vocab / world size); the last shard is zero-padded.

Embedding: each rank looks up the ids it owns, zeroes the others, and one all-reduce sums the rows.
LM head: each rank computes the logits of its vocab shard; rank 0 gathers and concatenates them (the
sampler runs there only), other ranks get an empty tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers.linear import CheckpointTensor, read_part, shape_of, tp_rank, tp_world_size
from batchinfer.engine.parallel.distributed import all_reduce, gather_last_dim


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, hidden]; each rank holds a contiguous slice of the vocab."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank()
        self.tp_size = tp_world_size()
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # torch's Parameter takes ad-hoc attributes
        # Set after loading by quantization="gguf" (gguf_weights): ids -> rows de-quantized from the file's
        # blocks, the dense table then released.
        self.lookup: Callable[[torch.Tensor], torch.Tensor] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Copy this rank's vocab rows of the checkpoint table (tensor or safetensors slice) into param."""
        expected = (self.num_embeddings, self.embedding_dim)
        if shape_of(loaded) != expected:
            raise ValueError(f"embedding has shape {shape_of(loaded)}, the model expects {expected}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(read_part(loaded, 0, self.vocab_start, rows))
        param.data[rows:].zero_()  # padding rows of the last shard: never looked up, logits dropped

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        if self.lookup is not None:
            return self.lookup(input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        rows = F.embedding(local, self.weight).masked_fill_(~owned.unsqueeze(-1), 0)
        return all_reduce(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab logits; may share its weight with the embedding (tied)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        # Set after loading by weight_packing.pack_linears (a oneDNN / int8 copy of the output matrix).
        self.packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding table as the output matrix (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype (on rank 0; other ranks: an empty tensor)."""
        logits = F.linear(hidden_states, self.weight) if self.packed is None else self.packed(hidden_states)
        if self.tp_size == 1:
            return logits
        gathered = gather_last_dim(logits)
        if gathered is None:
            return logits.new_empty(0)
        return gathered[:, : self.num_embeddings]
