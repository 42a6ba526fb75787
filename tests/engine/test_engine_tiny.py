"""The engine end to end on tiny random Llama / Qwen2 models, against Hugging Face transformers (fp32).

Greedy outputs must equal transformers' greedy generate token for token. Random tiny models can produce
near-ties; where a sequence first diverges, the two competing tokens' logits (from transformers) must be
within 1e-4 of each other, and divergences must stay rare.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path

import pytest
import torch

from batchinfer.engine import LLM, SamplingParams
from tests.fixtures.tiny_models import training_sentences

MAX_NEW = 10
NEAR_TIE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)



def mixed_prompts(count: int = 36) -> list[str]:
    """Prompts of 1 to ~90 tokens; some share a long prefix."""
    rng = random.Random(0)
    sentences = training_sentences(200, seed=5)
    prompts = [" ".join(rng.sample(sentences, rng.randint(1, 6))) for _ in range(count - 6)]
    prompts += [prompts[0] + " and then " + s for s in sentences[:4]] + ["Number", "the"]
    return prompts


@functools.cache
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: always MAX_NEW tokens
    return model


@functools.cache
def hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: the new tokens and the logits it chose them from."""
    out = hf_model(path).generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.stack(out.logits)[:, 0]


def assert_matches_transformers(path: Path, outputs, max_new: int = MAX_NEW) -> int:
    """Every output equals transformers' greedy tokens up to a near-tie; returns how many match fully."""
    exact = 0
    for out in outputs:
        ours = out.outputs[0].token_ids
        ref, logits = hf_greedy(str(path), tuple(out.prompt_token_ids), max_new)
        assert len(ours) == len(ref) == max_new
        diverge = next((k for k, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        if diverge is None:
            exact += 1
            continue
        gap = abs(logits[diverge, ours[diverge]] - logits[diverge, ref[diverge]]).item()
        assert gap < NEAR_TIE, (
            f"{out.request_id}: token {diverge} differs ({ours[diverge]} vs {ref[diverge]}), gap {gap}"
        )
    assert exact >= len(outputs) - 2, f"only {exact}/{len(outputs)} exact: near-ties should be rare"
    return exact


MODELS = ["tiny_llama", "tiny_qwen2"]
SCENARIOS = {
    "roomy": {},
    "preempting": {"num_kv_blocks": 20, "block_size": 8},  # 160 token slots for ~36 sequences
    "chunked": {"max_num_batched_tokens": 24},  # prompts up to ~90 tokens take several steps
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("model", MODELS)
def test_greedy_batch_equals_transformers(request, make_llm, model: str, scenario: str) -> None:
    path = request.getfixturevalue(model)
    llm = make_llm(path, **SCENARIOS[scenario])
    chunks: list[tuple[int, int, int]] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        chunks.extend((s.num_computed_tokens, n, s.num_tokens) for s, n in out.scheduled)
        return out

    llm.engine.scheduler.schedule = spy
    prompts = mixed_prompts()
    outputs = llm.generate(prompts, GREEDY)
    assert len(outputs) >= 32 and [o.prompt for o in outputs] == prompts
    assert_matches_transformers(path, outputs)
    stats = llm.engine.get_stats()
    assert stats.generation_tokens == MAX_NEW * len(prompts)
    if scenario == "preempting":
        assert stats.num_preemptions > 0
    if scenario == "chunked":
        partial = [c for c in chunks if c[0] + c[1] < c[2]]  # a chunk that stops short of the end
        assert partial and all(c[1] <= 24 for c in chunks)


def test_seeded_sampling_is_batch_invariant(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    prompt = "The queue answers every request"
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, seed=None if i % 2 else i, max_tokens=12, ignore_eos=True)
        for i in range(31)
    ]
    prompts = mixed_prompts(31)
    batch = llm.generate([*prompts[:15], prompt, *prompts[15:]], [*others[:15], seeded, *others[15:]])
    assert batch[15].outputs[0].token_ids == alone
    # Child 0 of an n=3 request keeps the request's seed, so it matches too; siblings differ.
    family = llm.generate([prompt], dataclasses.replace(seeded, n=3))[0]
    assert [c.index for c in family.outputs] == [0, 1, 2]
    assert family.outputs[0].token_ids == alone
    assert len({tuple(c.token_ids) for c in family.outputs}) == 3


def test_stop_token_ids_stop_strings_eos_and_length(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    prompt = "the cat reads many tokens"
    free_run = llm.generate([prompt], GREEDY)[0].outputs[0]
    tokens, text = free_run.token_ids, free_run.text
    assert free_run.finish_reason == "length" and len(tokens) == MAX_NEW

    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_id]))[
        0
    ]
    done = out.outputs[0]
    assert done.finish_reason == "stop" and done.stop_reason == stop_id
    assert done.token_ids == tokens[: first + 1]  # the stop token is kept in the ids ...
    tokenizer = llm.get_tokenizer()
    assert done.text == tokenizer.decode(tokens[:first], skip_special_tokens=True)  # ... not in the text

    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop_str)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop_str]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str and out.text == text[:cut]
    kept = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[stop_str], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop_str)]

    # EOS: pretend the model's EOS is the token greedy decoding produces third.
    llm.engine.eos_token_ids = {tokens[2]}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == tokens[: tokens.index(tokens[2]) + 1]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == tokens  # ignore_eos

    # min_tokens masks the stop token for the first 3 tokens.
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=MAX_NEW, min_tokens=3, ignore_eos=True, stop_token_ids=[tokens[0]]
        ),
    )[0].outputs[0]
    assert tokens[0] not in out.token_ids[:3]
    assert out.finish_reason == "length" or out.token_ids[-1] == tokens[0]


def test_context_limit_finishes_with_length(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_model_len=24)
    prompt_ids = llm.engine.tokenize("the cat reads many tokens quickly every night")
    out = llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt_ids) + len(out.outputs[0].token_ids) == 24


def test_bad_requests_raise_naming_the_field_and_the_engine_carries_on(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_model_len=64, num_kv_blocks=3)
    engine = llm.engine
    engine.add_request("good", "the cat reads", SamplingParams(temperature=0, max_tokens=4))
    cases = [
        (list(range(3, 70)), SamplingParams(), r"^prompt:"),
        ("the cat reads", SamplingParams(max_tokens=63), r"^max_tokens:.*max_model_len"),
        ("the cat reads", SamplingParams(max_tokens=50), r"^max_tokens:.*KV cache"),
        ("the cat reads", SamplingParams(stop_token_ids=[engine.vocab_size]), r"^stop_token_ids:"),
        ([engine.vocab_size + 5], SamplingParams(), r"^prompt:"),
        ([], SamplingParams(), r"^prompt:"),
        (None, SamplingParams(), r"^prompt:"),
    ]
    for i, (prompt, params, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-{i}", prompt, params)
    with pytest.raises(ValueError, match=r"^request_id:"):
        engine.add_request("good", "again", SamplingParams())
    assert engine.get_num_unfinished() == 1
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt:"):
        llm.generate(["fine", list(range(3, 70))], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"^max_num_seqz: unknown engine option"):
        LLM(str(tiny_llama), max_num_seqz=3)
    with pytest.raises(ValueError, match=r"^max_model_len: 1024 exceeds"):
        LLM(str(tiny_llama), device="cpu", max_model_len=1024)  # the tiny models know 512 positions


def test_abort_frees_blocks_from_any_state(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name in ("a", "b", "c"):
        engine.add_request(name, f"{name} the cat reads many tokens", params)
    engine.step()
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 1
    aborted = engine.abort("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 2
    assert engine.abort("c").outputs[0].token_ids == []  # never started
    assert engine.abort("unknown") is None
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["b"] and outputs[0].outputs[0].finish_reason == "length"


def test_logprobs_match_transformers(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    out = llm.generate(
        ["the model caches blocks"], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    )[0]
    completion = out.outputs[0]
    ref_tokens, ref_logits = hf_greedy(str(tiny_llama), tuple(out.prompt_token_ids), 5)
    assert completion.token_ids == ref_tokens
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
    total = 0.0
    for k, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert entry[token].rank == 1 and len(entry) == 2  # greedy: the sampled token is the top one
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(ref_logprobs[k, token_id].item(), abs=1e-4)
            assert logprob.decoded_token == llm.get_tokenizer().decode([token_id])
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_chat_applies_the_template(tiny_qwen2, make_llm) -> None:
    llm = make_llm(tiny_qwen2)
    conversations = [
        [{"role": "user", "content": "the cat reads"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a dog writes"}],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    for conversation, out in zip(conversations, outputs, strict=True):
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
        assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert_matches_transformers(tiny_qwen2, outputs, max_new=6)
    single = llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_incremental_outputs_and_stats(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.engine
    engine.add_request(
        "s", "the queue sorts", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), priority=1
    )
    engine.add_request("t", "a worker counts", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen: dict[str, list[int]] = {"s": [], "t": []}
    finished = []
    while engine.has_unfinished():
        for out in engine.step(include_unfinished=True):
            seen[out.request_id].append(len(out.outputs[0].token_ids))
            if out.finished:
                finished.append(out)
    assert seen == {"s": [1, 2, 3, 4, 5, 6], "t": [1, 2, 3]}
    assert [o.request_id for o in finished] == ["t", "s"]
    metrics = finished[1].metrics
    assert (
        metrics.arrival_time
        <= metrics.first_scheduled_time
        <= metrics.first_token_time
        <= metrics.finished_time
    )
    stats = engine.get_stats()
    prompt_tokens = sum(o.num_prompt_tokens for o in finished)
    assert stats.prompt_tokens == prompt_tokens and stats.generation_tokens == 9
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
