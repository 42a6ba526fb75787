"""Speculative decoding inside continuous batching (vLLM v1's design): proposers guess k tokens of a
decoding sequence, the target verifies them as one chunk in the ordinary varlen step, and an exact
acceptance rule keeps the target's output distribution.

- config.py: `speculative_config` (the two shapes, validation naming the field).
- ngram.py: prompt-lookup proposer (no model).
- draft.py: draft-model proposer (a second ModelRunner mirroring the target's block tables).
- rejection.py: greedy, seeded-replay and standard rejection-sampling acceptance.
- verify.py: the sampler-side verification of a step's speculating rows.
- speculator.py: the engine's glue (propose, drafts in the forward, verify and append, counters).
- truncated_draft.py: a draft made of the target's first layers (tests, experiments).

The scheduler plans k lookahead slots per speculating sequence; the engine proposes, runs, verifies and
appends the accepted tokens one by one through its usual path (stop rules, logprobs, max_tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchinfer.engine.speculative_config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.spec_decode.draft import DraftModelProposer
    from batchinfer.engine.spec_decode.ngram import NgramProposer

__all__ = ["SpeculativeConfig", "make_proposer", "parse_speculative_config"]


def make_proposer(spec: SpeculativeConfig, target_config: EngineConfig, *, num_kv_blocks: int,
                  vocab_size: int, max_model_len: int) -> NgramProposer | DraftModelProposer:
    """The proposer of `spec`: an NgramProposer, or a DraftModelProposer (which loads the draft)."""
    if spec.method == "ngram":
        from batchinfer.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from batchinfer.engine.spec_decode.draft import DraftModelProposer

    return DraftModelProposer(spec, target_config, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size,
                              max_model_len=max_model_len)
