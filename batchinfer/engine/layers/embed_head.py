"""Token embedding and LM head under their vocab-parallel names (the vocab is split across TP ranks later)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.layers.linear import tp_rank, tp_world_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, hidden]; with TP each rank would hold a contiguous slice of the vocab."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        if tp_world_size() != 1:
            raise NotImplementedError("vocab-parallel embedding across ranks is not implemented yet")
        self.num_embeddings = num_embeddings
        self.tp_rank = tp_rank()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy the checkpoint table (this rank's vocab slice) into param."""
        if param.shape != loaded.shape:
            raise ValueError(f"embedding has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab logits; may share its weight with the embedding (tied)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding table as the output matrix (tie_word_embeddings)."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model dtype."""
        return F.linear(hidden_states, self.weight)
