"""prompt_logprobs (vLLM's field) against a transformers forward over the prompt, through chunked prefill,
preemption and a warm prefix cache."""

from __future__ import annotations

import functools

import pytest
import torch

from batchinfer.engine import SamplingParams
from tests.fixtures.tiny_models import training_sentences

TOP = 3


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference(path: str, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: row p predicts token p + 1."""
    with torch.inference_mode():
        logits = _hf(path)(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(path: str, output, top: int = TOP) -> None:
    entries = output.prompt_logprobs
    ids = output.prompt_token_ids
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    ref = _reference(path, ids)
    for p in range(1, len(ids)):
        entry = entries[p]
        token = ids[p]
        assert token in entry and len(entry) in (top, top + 1)  # the prompt token, plus the top N
        assert entry[token].logprob == pytest.approx(ref[p - 1, token].item(), abs=1e-4)
        assert entry[token].rank == int((ref[p - 1] > ref[p - 1, token]).sum()) + 1
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != token or lp.rank <= top)
        assert [tid for _, tid in ranked][:top] == ref[p - 1].topk(top).indices.tolist()


def _prompts() -> list[str]:
    sentences = training_sentences(60, seed=11)
    return [" ".join(sentences[i : i + 1 + i % 7]) for i in range(0, 24, 3)]


def test_prompt_logprobs_match_transformers_through_chunked_prefill(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, max_num_batched_tokens=16)  # long prompts run in several chunks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(_prompts(), params)
    assert max(len(o.prompt_token_ids) for o in outputs) > 32
    for output in outputs:
        _check(str(tiny_llama), output)
        assert output.outputs[0].logprobs is None  # sample logprobs were not asked for


def test_prompt_logprobs_bypass_a_warm_prefix_cache_and_leave_it_warm(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama)
    prompt = " ".join(training_sentences(8, seed=3))
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain)
    asked = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                  prompt_logprobs=0))[0]
    assert asked.num_cached_tokens == 0  # every position's logits were computed
    _check(str(tiny_llama), asked, top=0)
    assert llm.generate([prompt], plain)[0].num_cached_tokens > 0
    assert llm.generate([prompt], plain)[0].prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_and_n(tiny_llama, make_llm) -> None:
    llm = make_llm(tiny_llama, num_kv_blocks=30, block_size=4, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(_prompts()[:5], params)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        _check(str(tiny_llama), output, top=1)
        assert len(output.outputs) == 2


def test_prompt_logprobs_are_bounded_like_logprobs() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert SamplingParams.from_dict(SamplingParams(prompt_logprobs=2).to_dict()).prompt_logprobs == 2


def test_prompt_logprobs_through_the_tensor_parallel_step_channel(tiny_llama) -> None:
    from batchinfer.engine import LLM

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", tensor_parallel_size=2,
              max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
        for output in llm.generate(_prompts()[:3], params):
            _check(str(tiny_llama), output, top=2)
    finally:
        llm.close()
