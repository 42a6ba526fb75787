"""Prefix caching through the whole engine: same outputs on and off, exact hit counts, salts, sharing."""

from __future__ import annotations

import pytest

from batchinfer.engine import LLM, SamplingParams
from tests.fixtures.tiny_models import training_sentences

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)



def check_every_step(llm: LLM) -> None:
    """After each step: ref counts equal the running block tables exactly (so never negative)."""
    engine, step = llm.engine, llm.engine.step

    def checked_step(**kwargs):
        outputs = step(**kwargs)
        engine.block_manager.check_invariants(engine.scheduler.running)
        return outputs

    engine.step = checked_step


def family_prompts() -> list[str]:
    """Three long shared prefixes, ten suffixes each, interleaved (worst order for the cache)."""
    sentences = training_sentences(60, seed=9)
    prefixes = [" ".join(sentences[i * 5 : i * 5 + 5]) for i in range(3)]
    return [f"{prefixes[i % 3]} {sentences[30 + i]}" for i in range(30)]


def ids(count: int) -> list[int]:
    """A prompt of `count` token ids, the same for every call."""
    return [3 + (i * 7) % 400 for i in range(count)]


SCENARIOS = {
    "roomy": {},
    "evicting": {"num_kv_blocks": 24, "max_num_seqs": 4},  # cached prefixes get evicted and recomputed
    "preempting": {"num_kv_blocks": 40, "block_size": 4},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_outputs_identical_with_cache_on_and_off(tiny_llama, make_llm, scenario: str) -> None:
    prompts = family_prompts()
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama, enable_prefix_caching=caching, **SCENARIOS[scenario])
        check_every_step(llm)
        results[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.engine.get_stats()
        if caching:
            assert stats.prefix_cache_hits > 0
            cache = llm.engine.block_manager.stats
            if scenario == "evicting":
                assert cache.evictions > 0
        else:
            assert stats.prefix_cache_queries == 0
        if scenario == "preempting":
            assert stats.num_preemptions > 0
    assert results[True] == results[False]


def test_two_prompts_sharing_three_full_blocks_hit_three_blocks(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)  # block_size 16
    shared = ids(48)
    first = llm.generate([shared + [11, 12, 13, 14, 15]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    before = llm.engine.get_stats()
    second = llm.generate([shared + [21, 22, 23, 24, 25, 26, 27]], GREEDY)[0]
    after = llm.engine.get_stats()
    assert second.num_cached_tokens == 48
    assert after.prefix_cache_block_hits - before.prefix_cache_block_hits == 3
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    assert after.prefix_cache_queries - before.prefix_cache_queries == 55
    assert after.prompt_tokens - before.prompt_tokens == 7  # only the uncached tokens were computed


def test_same_batch_requests_share_blocks_in_the_step_they_are_admitted(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    shared = ids(48)
    outputs = llm.generate([shared + [11, 12], shared + [21, 22, 23]], GREEDY)
    assert sorted(o.num_cached_tokens for o in outputs) == [0, 48]
    assert llm.engine.get_stats().num_steps == GREEDY.max_tokens  # both prefilled in the first step
    alone = make_llm(tiny_llama, enable_prefix_caching=False).generate([shared + [21, 22, 23]], GREEDY)[0]
    assert outputs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_last_prompt_token_is_recomputed(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    prompt = ids(48)  # exactly three full blocks
    llm.generate([prompt], GREEDY)
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 32  # capped at 47 tokens, rounded down to a block


def test_salted_requests_only_hit_their_own_salt(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    engine, prompt = llm.engine, ids(40)

    def run(request_id: str, salt: str | None) -> int:
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            finished = engine.step()
        return finished[0].num_cached_tokens

    assert run("a1", "alice") == 0
    assert run("b1", "bob") == 0
    assert run("n1", None) == 0
    assert run("a2", "alice") == 32
    assert run("b2", "bob") == 32
    assert run("n2", None) == 32


def test_n_children_share_the_prompt_blocks(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.engine
    shared_refs = []
    step = engine.step

    def spy(**kwargs):
        outputs = step(**kwargs)
        if engine.scheduler.running:
            first_block = engine.scheduler.running[0].block_table[0]
            shared_refs.append(engine.block_manager.blocks[first_block].ref_cnt)
        return outputs

    engine.step = spy
    prompt = ids(40)  # two full blocks + 8 tokens
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))[
        0
    ]
    assert len(out.outputs) == 4
    assert engine.get_stats().prefix_cache_block_hits == 3 * 2  # children 1..3 reuse child 0's two blocks
    assert shared_refs[0] == 4


def test_blocks_filled_during_decode_are_reusable(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    prompt = ids(20)
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    continuation = prompt + first.outputs[0].token_ids[:28]  # 48 tokens: blocks 2 and 3 were decoded
    follow = llm.generate([continuation + [5]], GREEDY)[0]
    assert follow.num_cached_tokens == 48


def test_reset_prefix_cache(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    prompt = ids(40)
    llm.generate([prompt], GREEDY)
    llm.engine.add_request("busy", [7, 8, 9], GREEDY)
    llm.engine.step()
    assert not llm.engine.reset_prefix_cache()  # a request still holds blocks
    llm.engine.abort("busy")
    assert llm.engine.reset_prefix_cache()
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_generate_admits_prompts_grouped_by_prefix(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_num_seqs=2)
    engine = llm.engine
    admitted: list[list[int]] = []
    add = engine.add_request

    def spy(request_id, prompt, params, **kwargs):
        admitted.append(list(prompt))
        return add(request_id, prompt, params, **kwargs)

    engine.add_request = spy
    prompts = family_prompts()
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outputs] == prompts  # results in input order
    tokenizer = llm.get_tokenizer()
    families = [tokenizer.decode(p)[:20] for p in admitted]
    switches = sum(a != b for a, b in zip(families, families[1:], strict=False))
    assert switches == 2  # three families, each admitted as one run
