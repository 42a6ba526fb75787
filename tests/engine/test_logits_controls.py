"""allowed_token_ids, bad_words, logit_bias (logits_controls.py) in the sampler and the engine, and
truncate_prompt_tokens: each against what it promises; rows without them stay bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine import SamplingParams
from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.sampling.logits_controls import bad_words_token_ids
from batchinfer.engine.sampling.sampler import Sampler

VOCAB = 12
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _seq(params: SamplingParams, output: list[int] | None = None) -> Sequence:
    seq = Sequence("r", [0, 1, 2], params, max_tokens=8)
    seq.token_ids.extend(output or [])
    return seq


def test_controls_change_only_the_rows_asking_and_leave_the_logits_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    top = int(logits[1].argmax())
    plain = SamplingParams(temperature=0.0)
    seqs = [_seq(plain), _seq(SamplingParams(temperature=0.0, logit_bias={top: -100})),
            _seq(SamplingParams(temperature=0.0, allowed_token_ids=[4, 9])), _seq(plain)]
    given = logits.clone()
    out = Sampler()(logits, seqs, {VOCAB - 1})
    assert torch.equal(logits, given)  # the caller's logits are not touched
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[3] == int(logits[3].argmax())
    assert out.token_ids[1] != top
    assert out.token_ids[2] == (4 if logits[2, 4] >= logits[2, 9] else 9)
    boosted = Sampler()(logits[:1], [_seq(SamplingParams(temperature=0.0, logit_bias={7: 100}))], set())
    assert boosted.token_ids == [7]


def test_bad_words_token_ids_follow_vllm() -> None:
    class Tokenizer:  # "the" is two tokens, " the" one; "dog" and " dog" one each
        table = {"the": [1, 2], " the": [3], "dog": [4], " dog": [5], "big dog": [6, 5], " big dog": [7, 5]}

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            return self.table[text]

    # vLLM keeps the spaced form only when it is as long as the plain one and starts differently
    assert bad_words_token_ids(Tokenizer(), ["the", " dog", "big dog"]) == [[1, 2], [4], [5], [6, 5], [7, 5]]


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0  # token 5 is the argmax unless banned
    params = SamplingParams(temperature=0.0, bad_words=["x"])
    after_prefix, elsewhere = _seq(params, output=[3, 4]), _seq(params, output=[4, 3])
    for seq in (after_prefix, elsewhere):
        seq.bad_words_token_ids = [[3, 4, 5]]
    out = Sampler()(logits, [after_prefix, elsewhere], set())
    assert out.token_ids[0] != 5 and out.token_ids[1] == 5


def test_no_control_asked_is_bit_identical_with_random_sampling() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    first = Sampler(seed=1)(logits, [_seq(params) for _ in range(3)], set())
    with_inert = SamplingParams(temperature=0.9, top_p=0.9, seed=5, logit_bias={})  # {} asks nothing
    assert not with_inert.has_logits_controls
    second = Sampler(seed=1)(logits, [_seq(with_inert) for _ in range(3)], set())
    assert first.token_ids == second.token_ids


def test_engine_honours_bad_words_allowed_ids_bias_and_truncation(make_llm, tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    tokenizer = llm.get_tokenizer()
    prompt = "the cat sat on the mat and the dog"
    free = llm.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0]
    # a generated token that is a whole word on its own (as given, no leading space): banning it must work
    words = [tokenizer.decode([t]) for t in free.token_ids]
    banned = next(w for w, t in zip(words, free.token_ids, strict=True)
                  if w.strip() == w and w and bad_words_token_ids(tokenizer, [w])[0] == [t])
    no_bad = llm.generate([prompt], SamplingParams(**GREEDY, bad_words=[banned]))[0].outputs[0]
    assert tokenizer.encode(banned, add_special_tokens=False)[0] not in no_bad.token_ids
    assert no_bad.token_ids != free.token_ids
    allowed = sorted(set(free.token_ids))[:1] + [7, 8]
    only = llm.generate([prompt], SamplingParams(**GREEDY, allowed_token_ids=allowed))[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)
    forced = llm.generate([prompt], SamplingParams(**GREEDY, logit_bias={9: 100}))[0].outputs[0]
    assert forced.token_ids == [9] * 8
    full = llm.generate([prompt], SamplingParams(**GREEDY))[0]
    cut = llm.generate([prompt], SamplingParams(**GREEDY, truncate_prompt_tokens=3))[0]
    assert cut.prompt_token_ids == full.prompt_token_ids[-3:]
    assert free.token_ids == full.outputs[0].token_ids  # the controls left no state behind


def test_engine_refuses_token_ids_outside_the_vocabulary(make_llm, tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=r"^logit_bias: \[\d+\] outside the vocabulary"):
        llm.engine.add_request("a", "hi", SamplingParams(logit_bias={vocab: 1}))
    with pytest.raises(ValueError, match=r"^allowed_token_ids: \[\d+\] outside the vocabulary"):
        llm.engine.add_request("b", "hi", SamplingParams(allowed_token_ids=[vocab + 3]))
