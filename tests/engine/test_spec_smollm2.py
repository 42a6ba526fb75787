"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy output identical with and without it.

Kept short (3 copy-heavy prompts, 32 tokens). The draft model is SmolLM2's own first 6 layers (there is no
smaller SmolLM2): it shows the draft path on a real model; its acceptance is modest.
"""

from __future__ import annotations

import pytest

from batchinfer.engine import LLM, SamplingParams
from batchinfer.engine.spec_decode.truncated_draft import write_truncated_draft

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
TICKETS = [
    "Customer Maria Lopez lives in Lisbon. On order 481516 she bought a blue kettle for 42.50 dollars.",
    "Customer John Smith lives in Denver. On order 112358 he bought two garden chairs for 89.99 dollars.",
    "Customer Aiko Tanaka lives in Osaka. On order 271828 she bought a desk lamp for 19.00 dollars.",
]
CONVERSATIONS = [[{"role": "user", "content": f"{t}\nQuote the ticket word for word, then give the order "
                   "number."}] for t in TICKETS]
# Small blocks and budget: preemption and chunked prefill happen while sequences speculate.
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "num_kv_blocks": 20, "block_size": 8,
          "max_num_batched_tokens": 48}


@pytest.fixture(scope="module")
def plain_outputs(smollm2) -> list[list[int]]:
    llm = LLM(str(smollm2), **ENGINE)
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    assert llm.engine.get_stats().num_preemptions > 0  # the scenario preempts
    return [o.outputs[0].token_ids for o in outputs]


def _check(llm: LLM, plain: list[list[int]]) -> None:
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.engine.block_manager.check_invariants([])


def test_ngram_greedy_identical(smollm2, plain_outputs) -> None:
    config = {"method": "ngram", "num_speculative_tokens": 6}
    _check(LLM(str(smollm2), speculative_config=config, **ENGINE), plain_outputs)


def test_truncated_draft_greedy_identical(smollm2, plain_outputs, tmp_path) -> None:
    draft = write_truncated_draft(smollm2, tmp_path / "draft", num_layers=6)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    _check(LLM(str(smollm2), speculative_config=config, **ENGINE), plain_outputs)
