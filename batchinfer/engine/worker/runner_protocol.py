"""ModelRunnerProtocol: everything the Engine asks of a model runner (ARCHITECTURE.md, contract 2).

Three runners implement it, each explicitly (no attribute forwarding): ModelRunner (one rank, this
process), TensorParallelRunner (tp_runner.py: every member drives all ranks) and PipelineParallelRunner
(pp_runner.py). The Engine never looks past these members, so a member a runner cannot honour is written
out and refuses with a clear ValueError instead of silently running on rank 0 alone.
Import-light: torch is named for type checkers only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from batchinfer.engine.lora.request import LoRARequest

# What a runner that cannot pool embeddings raises (Engine.embed turns it into the line's error).
EMBEDDINGS_NEED_ONE_STAGE = (
    "embeddings need pipeline_parallel_size=1 on this worker (the pooled last hidden state lives on no "
    "single stage); serve /v1/embeddings from a worker with pipeline_parallel_size=1"
)
# What a pipeline runner raises for a LoRA adapter (EngineConfig refuses enable_lora with stages first).
LORA_NEEDS_ONE_RANK = "enable_lora: LoRA adapters run with pipeline_parallel_size=1 only"


class TokenIds(Protocol):
    """A sequence's token ids as a runner reads them: a length and the slice of the step's new tokens."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> list[int]: ...


class ScheduledSequence(Protocol):
    """The Sequence fields a runner reads (contract 2): a core Sequence, or a worker's StepSequence."""

    @property
    def token_ids(self) -> TokenIds: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def lora_request(self) -> LoRARequest | None: ...


class ModelRunnerProtocol(Protocol):
    """Runs scheduled steps over a KV cache of num_kv_blocks blocks on `device`."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the KV cache (the same block ids on every rank)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the logits come back (the sampler works there)."""
        ...

    @property
    def step_tokens(self) -> int:
        """Tokens one forward takes: max_num_batched_tokens, on a CPU cut by worker/step_budget.py."""
        ...

    def execute_model(
        self, scheduled: Sequence[tuple[ScheduledSequence, int]], logits_counts: Sequence[int] | None = None,
        *, argmax_only_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Run one step of (sequence, new tokens); float32 logits [sum(logits_counts), vocab].

        logits_counts[i]: the logits of entry i's last c scheduled tokens (default 1 each), entry by entry;
        prompt logprobs (prompt_logprobs.py) and speculative verification ask for more than one.
        argmax_only_rows: logits rows whose reader takes only the argmax (sampler.reads_only_argmax). A runner
        may return them screened: -inf except for the tokens that can be the row's float32 argmax, which
        hold their float32 logits (layers/greedy_head.py); a runner that does not screen ignores it.
        """
        ...

    def embed(self, token_id_lists: Sequence[list[int]]) -> list[list[float]]:
        """Each input's final-norm hidden state, mean-pooled and L2-normalised; the KV cache is untouched.

        Raises ValueError (the line's error) when this runner cannot pool, never hangs other ranks.
        """
        ...

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a request's LoRA adapter; ValueError when it cannot run here."""
        ...

    def close(self) -> None:
        """Release what outlives a step (worker processes); idempotent."""
        ...
