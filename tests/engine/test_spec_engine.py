"""Speculative decoding through the engine on the tiny random models: exact output, no leaked block.

Drafts used: the n-gram proposer (prompt lookup), and draft models made from the target itself, either the
same weights (every greedy draft is accepted: proves the draft's mirrored KV cache is right) or the target
truncated to its first layer (partial acceptance, the realistic case).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from batchinfer.engine import SamplingParams
from batchinfer.engine.spec_decode.truncated_draft import write_truncated_draft
from tests.engine.spec_stats import assert_distributed_as
from tests.fixtures.tiny_models import training_sentences

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ALWAYS = 1024  # disable_by_batch_size: speculate at any batch size
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": ALWAYS}
SCENARIOS = {
    "roomy": {},
    "preempting": {"num_kv_blocks": 24, "block_size": 8},
    "chunked": {"max_num_batched_tokens": 24},
}


def prompts(count: int = 20) -> list[str]:
    """Prompts of 1 to ~90 tokens built from the tokenizer's training sentences."""
    rng = random.Random(0)
    sentences = training_sentences(200, seed=5)
    return [" ".join(rng.sample(sentences, rng.randint(1, 6))) for _ in range(count)]


def draft_model(path: Path, kind: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The draft of `kind`: the target's own directory ("same") or its first layer ("truncated")."""
    if kind == "same":
        return str(path)
    out = tmp_path_factory.getbasetemp() / f"draft-{path.name}-1layer"
    if not (out / "config.json").exists():
        write_truncated_draft(path, out, num_layers=1)
    return str(out)


def spec_config(method: str, path: Path, tmp_path_factory: pytest.TempPathFactory, **extra) -> dict:
    """NGRAM, or a 3-token draft_model config with the truncated draft."""
    if method == "ngram":
        return {**NGRAM, **extra}
    return {"method": "draft_model", "model": draft_model(path, "truncated", tmp_path_factory),
            "num_speculative_tokens": 3, "disable_by_batch_size": ALWAYS, **extra}


def checked_run(llm, batch: list[str], params) -> list:
    """generate(), asserting after every step that block ref counts match the live sequences exactly."""
    engine = llm.engine
    step = engine.step

    def checking_step(**kwargs):
        out = step(**kwargs)
        engine.block_manager.check_invariants(engine.scheduler.running)
        for seq in engine.scheduler.running:  # the KV of accepted tokens only: the last is never computed
            assert seq.num_computed_tokens <= seq.num_tokens - 1
        return out

    engine.step = checking_step
    try:
        return llm.generate(batch, params)
    finally:
        engine.step = step


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_greedy_output_is_identical_with_speculation(request, make_llm, tmp_path_factory, model: str,
                                                     method: str, scenario: str) -> None:
    path = request.getfixturevalue(model)
    batch = prompts()
    plain = make_llm(path, **SCENARIOS[scenario]).generate(batch, GREEDY)
    config = spec_config(method, path, tmp_path_factory)
    llm = make_llm(path, speculative_config=config, **SCENARIOS[scenario])
    fast = checked_run(llm, batch, GREEDY)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.get_stats()
    assert stats.generation_tokens == MAX_NEW * len(batch)
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert 0 <= stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens > 0
    if scenario == "preempting":
        assert stats.num_preemptions > 0


def test_a_draft_with_the_targets_weights_is_always_accepted(tiny_llama, make_llm, tmp_path_factory) -> None:
    config = {"method": "draft_model", "model": draft_model(tiny_llama, "same", tmp_path_factory),
              "num_speculative_tokens": 4, "disable_by_batch_size": ALWAYS}
    llm = make_llm(tiny_llama, speculative_config=config, num_kv_blocks=40, block_size=8)
    batch = prompts(12)
    plain = make_llm(tiny_llama, num_kv_blocks=40, block_size=8).generate(batch, GREEDY)
    fast = checked_run(llm, batch, GREEDY)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.get_stats()
    # Near-ties between the chunked and the one-token forward may reject a rare draft; nothing else may.
    assert stats.spec_num_accepted_tokens >= 0.97 * stats.spec_num_draft_tokens
    assert stats.num_steps < MAX_NEW * 0.6 + 12  # ~1 + 4 tokens per step once decoding


def test_stops_logprobs_and_lengths_match_without_speculation(tiny_llama, make_llm, tmp_path_factory) -> None:
    batch = prompts(8)
    base = make_llm(tiny_llama).generate(batch[:1], GREEDY)[0].outputs[0]
    text, tokens = base.text, base.token_ids
    cases = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[tokens[5]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=6, stop_token_ids=[tokens[1]]),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3,
                       bad_words=["cat"]),
        SamplingParams(temperature=0, max_tokens=MAX_NEW, include_stop_str_in_output=True,
                       stop=[text[4:7]]),
    ]
    same = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4,
            "disable_by_batch_size": ALWAYS}
    for config in (NGRAM, same):
        llm = make_llm(tiny_llama, speculative_config=config)
        plain_llm = make_llm(tiny_llama)
        for params in cases:
            fast = checked_run(llm, batch, params)
            plain = plain_llm.generate(batch, params)
            for a, b in zip(fast, plain, strict=True):
                ours, ref = a.outputs[0], b.outputs[0]
                assert (ours.token_ids, ours.text, ours.finish_reason, ours.stop_reason) == (
                    ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason), params
                if params.logprobs is not None:
                    assert len(ours.logprobs) == len(ours.token_ids)
                    for mine, theirs in zip(ours.logprobs, ref.logprobs, strict=True):
                        assert list(mine) == list(theirs)
                        for token_id in mine:
                            assert mine[token_id].rank == theirs[token_id].rank
                            assert mine[token_id].logprob == pytest.approx(theirs[token_id].logprob, abs=1e-4)
                    assert ours.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
        stats = llm.engine.get_stats()
        assert stats.spec_num_drafts > 0 and (config is NGRAM or stats.spec_num_accepted_tokens > 0)


def test_seeded_sampling_is_unchanged_by_speculation_and_the_batch(tiny_llama, make_llm) -> None:
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=42, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = prompts(1)[0]
    same = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 4,
            "disable_by_batch_size": 4}  # speculation turns off while more than 4 sequences run
    alone_plain = make_llm(tiny_llama).generate([prompt], seeded)[0].outputs[0].token_ids
    llm = make_llm(tiny_llama, speculative_config=same)
    assert llm.generate([prompt], seeded)[0].outputs[0].token_ids == alone_plain
    others = [SamplingParams(temperature=1.0, seed=None if i % 2 else i, max_tokens=i + 1, ignore_eos=True)
              for i in range(12)]
    batch = llm.generate([*prompts(12), prompt], [*others, seeded])
    assert batch[-1].outputs[0].token_ids == alone_plain
    assert llm.engine.get_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_keep_the_targets_distribution(tiny_llama, make_llm, tmp_path_factory,
                                                      method: str) -> None:
    """Chi-square on the second sampled token given the commonest first one: the first comes from the
    prefill, the second from verifying a proposal (n-gram: the prompt holds every token id, so the first
    token always occurred before; with q one-hot at a rarely likely token, this mostly tests the residual
    norm(max(0, p - q)); the 1-layer draft's q tests acceptance and residual with a real q)."""
    temperature = 0.5  # the tiny model's distributions are flat: sharpen them so one first token dominates
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, n=64)
    llm = make_llm(tiny_llama, speculative_config=spec_config(method, tiny_llama, tmp_path_factory),
                   max_num_seqs=256, seed=7)
    if method == "ngram":
        prompt = [t for t in range(llm.engine.vocab_size) if t not in llm.engine.eos_token_ids][:500]
    else:
        prompt = llm.engine.tokenize(prompts(5)[4])
    outputs = llm.generate([prompt] * 64, params)
    pairs = [tuple(c.token_ids[:2]) for o in outputs for c in o.outputs]
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts >= 0.9 * len(pairs)  # nearly every second token came from verification
    first_counts: dict[int, int] = {}
    for first, _ in pairs:
        first_counts[first] = first_counts.get(first, 0) + 1
    first = max(first_counts, key=first_counts.__getitem__)
    seconds = [second for f, second in pairs if f == first]
    assert len(seconds) >= 500, (len(seconds), len(pairs))
    assert method != "ngram" or first in prompt  # so each of these second tokens had a proposal
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [first]])).logits[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1)
    assert_distributed_as(seconds, dict(enumerate(probs.tolist())))


def test_policy_batch_size_and_per_request_opt_out(tiny_llama, make_llm) -> None:
    config = dict(NGRAM, disable_by_batch_size=2)
    llm = make_llm(tiny_llama, speculative_config=config)
    engine = llm.engine
    batch = prompts(6)
    running_when_speculating: list[int] = []
    verify = engine.speculator.verify_and_append

    def spy(step, *args, **kwargs):
        running_when_speculating.append(engine.scheduler.num_running)
        return verify(step, *args, **kwargs)

    engine.speculator.verify_and_append = spy
    lengths = [MAX_NEW if i < 2 else 4 for i in range(len(batch))]  # 4 short ones leave a tail of 2
    llm.generate(batch, [dataclasses.replace(GREEDY, max_tokens=n) for n in lengths])
    assert running_when_speculating and max(running_when_speculating) <= 2
    drafts = engine.get_stats().spec_num_drafts
    llm.generate(batch[:1], dataclasses.replace(GREEDY, speculative_decoding=False))
    assert engine.get_stats().spec_num_drafts == drafts


def test_metrics_have_vllms_spec_decode_names(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, speculative_config={"method": "draft_model", "model": str(tiny_llama),
                                                   "num_speculative_tokens": 2,
                                                   "disable_by_batch_size": ALWAYS})
    llm.generate(prompts(3), GREEDY)
    stats = llm.engine.get_stats()
    labels = llm.engine.recorder.metrics.labels

    def value(name: str, **extra: str) -> float | None:
        return REGISTRY.get_sample_value(f"batchinfer:{name}_total", {**labels, **extra})

    assert value("spec_decode_num_drafts") == stats.spec_num_drafts > 0
    assert value("spec_decode_num_draft_tokens") == stats.spec_num_draft_tokens
    assert value("spec_decode_num_accepted_tokens") == stats.spec_num_accepted_tokens
    for position, count in enumerate(stats.spec_accepted_per_position):
        assert value("spec_decode_num_accepted_tokens_per_pos", position=str(position)) == count


def test_bad_speculative_config_names_the_field(tiny_llama, make_llm) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config\.method:"):
        make_llm(tiny_llama, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^speculative_config\.model:"):
        make_llm(tiny_llama, speculative_config={"method": "draft_model", "model": "/nonexistent/draft",
                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"^speculative_config\.method: draft_model runs with"):
        make_llm(tiny_llama, tensor_parallel_size=2,
                 speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 2})


def test_constrained_rows_do_not_speculate_and_free_rows_beside_them_do(tiny_llama, make_llm) -> None:
    regex = SamplingParams(temperature=0, max_tokens=MAX_NEW, structured_outputs={"regex": "[a-z ]{5,20}"})
    batch = prompts(6)
    params = [regex if i % 2 else GREEDY for i in range(len(batch))]
    same = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "disable_by_batch_size": ALWAYS}
    llm = make_llm(tiny_llama, speculative_config=same)
    fast = checked_run(llm, batch, params)
    plain = make_llm(tiny_llama).generate(batch, params)
    assert [o.outputs[0].text for o in fast] == [o.outputs[0].text for o in plain]
    stats = llm.engine.get_stats()
    assert stats.spec_num_drafts > 0
    # Only the three free rows speculated: at most one verification per free row per step.
    assert stats.spec_num_drafts <= 3 * stats.num_steps


def test_abort_while_speculating_frees_every_block(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, speculative_config=NGRAM, num_kv_blocks=40, block_size=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts(4)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    for _ in range(6):
        engine.step()
    engine.abort("r1")
    engine.abort("r2")
    engine.block_manager.check_invariants(engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()


def test_ngram_under_tensor_parallelism_is_identical(tiny_llama, make_llm) -> None:
    """The drafts sit in token_ids while the target runs, so the TP step channel carries them unchanged."""
    batch = prompts(8)
    plain = make_llm(tiny_llama).generate(batch, GREEDY)
    llm = make_llm(tiny_llama, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        fast = llm.generate(batch, GREEDY)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.get_stats().spec_num_drafts > 0


def test_prompt_logprobs_beside_speculating_rows(tiny_llama, make_llm) -> None:
    batch = prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                             prompt_logprobs=2 if i == 5 else None) for i in range(len(batch))]
    same = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
            "disable_by_batch_size": ALWAYS}
    # A small budget: the prompt-logprobs request prefills in chunks while the others already speculate.
    llm = make_llm(tiny_llama, speculative_config=same, max_num_batched_tokens=32)
    fast = checked_run(llm, batch, params)
    plain = make_llm(tiny_llama, max_num_batched_tokens=32).generate(batch, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    ours, ref = fast[5].prompt_logprobs, plain[5].prompt_logprobs
    assert ours is not None and len(ours) == len(ref) == len(fast[5].prompt_token_ids)
    for mine, theirs in zip(ours[1:], ref[1:], strict=True):
        assert list(mine) == list(theirs)
