"""Incremental detokenization on a real byte-level BPE tokenizer, and stop strings."""

from __future__ import annotations

import pytest

from batchinfer.engine.core.detokenizer import IncrementalDetokenizer
from batchinfer.engine.sampling_params import SamplingParams
from tests.fixtures.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def stream(tokenizer, prompt: str, output: str, params: SamplingParams, *, min_tokens_reached: bool = True):
    """Feed `output`'s tokens one by one; returns (detokenizer, pieces emitted, stop string, tokens used)."""
    prompt_ids = tokenizer.encode(prompt)
    output_ids = tokenizer.encode(output)
    detok = IncrementalDetokenizer(tokenizer, len(prompt_ids), params)
    ids = list(prompt_ids)
    pieces = []
    for used, token in enumerate(output_ids, start=1):
        ids.append(token)
        before = detok.output_text
        stop = detok.update(ids, stop_terminated=False, check_stop=min_tokens_reached)
        pieces.append(detok.output_text[len(before) :])
        if stop is not None:
            return detok, pieces, stop, used
    return detok, pieces, None, len(output_ids)


@pytest.mark.parametrize(
    "text",
    [
        " the cat reads many tokens quickly.",
        " héllo wörld, naïve café",
        " 你好，世界 🎉 emoji ✓ done",
        "Number 42! The GPU sorts blocks of memory",
    ],
)
def test_incremental_text_equals_full_decode_and_never_shows_broken_chars(tokenizer, text: str) -> None:
    detok, pieces, stop, _ = stream(tokenizer, "The queue answers", text, SamplingParams())
    assert stop is None
    assert "".join(pieces) == detok.output_text == text
    assert all("\ufffd" not in piece for piece in pieces)
    if any(ord(c) > 127 for c in text):
        assert any(piece == "" for piece in pieces)  # a multi-byte char was held back a token


def test_special_tokens_are_skipped_or_kept(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.encode("hi")
    for skip, expected in ((True, " done"), (False, " done<|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, len(prompt), SamplingParams(skip_special_tokens=skip))
        ids = list(prompt)
        for token in [*tokenizer.encode(" done"), eos]:
            ids.append(token)
            detok.update(ids, stop_terminated=False, check_stop=True)
        assert detok.output_text == expected


def test_stop_terminated_token_text_is_left_out(tokenizer) -> None:
    prompt = tokenizer.encode("hi")
    detok = IncrementalDetokenizer(tokenizer, len(prompt), SamplingParams(stop_token_ids=[5]))
    ids = [*prompt, *tokenizer.encode(" the cat")]
    for end in range(len(prompt) + 1, len(ids) + 1):
        detok.update(ids[:end], stop_terminated=False, check_stop=True)
    detok.update([*ids, tokenizer.encode(" dog")[0]], stop_terminated=True, check_stop=True)
    assert detok.output_text == " the cat"


def test_stop_string_cuts_the_text(tokenizer) -> None:
    params = SamplingParams(stop=["many", "zzz"])
    detok, _, stop, used = stream(tokenizer, "x", " the cat reads many tokens quickly.", params)
    assert stop == "many" and detok.output_text == " the cat reads "
    assert used < len(tokenizer.encode(" the cat reads many tokens quickly."))


def test_stop_string_kept_when_asked(tokenizer) -> None:
    params = SamplingParams(stop=["reads"], include_stop_str_in_output=True)
    detok, _, stop, _ = stream(tokenizer, "x", " the cat reads many tokens", params)
    assert stop == "reads" and detok.output_text == " the cat reads"


def test_earliest_stop_string_wins_and_spanning_tokens_match(tokenizer) -> None:
    params = SamplingParams(stop=["tokens", "at re"])  # "at re" spans the tokens of "cat" and "reads"
    detok, _, stop, _ = stream(tokenizer, "x", " the cat reads many tokens", params)
    assert stop == "at re" and detok.output_text == " the c"


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    params = SamplingParams(stop=["cat"])
    detok, _, stop, _ = stream(tokenizer, "x", " the cat reads", params, min_tokens_reached=False)
    assert stop is None and detok.output_text == " the cat reads"


def test_running_text_holds_back_a_possible_stop_string_prefix(tokenizer) -> None:
    params = SamplingParams(stop=["reads many"])
    detok, _, stop, _ = stream(tokenizer, "x", " the cat reads", params)
    assert stop is None
    assert detok.output_text == " the cat reads"
    assert detok.text(finished=False) == " the cat reads"[: -len("reads many") + 1]
    assert detok.text(finished=True) == " the cat reads"
