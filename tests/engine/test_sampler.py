"""Sampler: each logits processor against a plain per-row reference, seeded batch invariance, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.sampling.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p
from batchinfer.engine.sampling_params import SamplingParams

VOCAB = 12
EOS = 11


def known_logits(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def make_seq(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Sequence:
    seq = Sequence("r", prompt or [0, 1, 2], params, max_tokens=params.max_tokens or 64)
    for token in output or []:
        seq.token_ids.append(token)
    return seq


def softmax(row: list[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    exps = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


# --- reference computations, one row at a time, in plain Python --------------------------------------


def ref_penalties(row, prompt, output, presence, frequency, repetition):
    out = []
    for token, x in enumerate(row):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        out.append(x - frequency * count - presence * (count > 0))
    return out


def ref_top_k(row, k):
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else -math.inf for x in row]


def ref_top_p(row, p):
    probs = softmax(row)
    order = sorted(range(len(row)), key=lambda t: -probs[t])
    kept, mass = set(), 0.0
    for token in order:
        if mass < p:  # kept while the tokens ranked above it hold less than p
            kept.add(token)
        mass += probs[token]
    return [x if t in kept else -math.inf for t, x in enumerate(row)]


def ref_min_p(row, min_p):
    probs = softmax(row)
    return [x if probs[t] >= min_p * max(probs) else -math.inf for t, x in enumerate(row)]


def assert_rows_equal(actual: torch.Tensor, expected: list[list[float]]) -> None:
    for got, want in zip(actual.tolist(), expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a == b == -math.inf) or a == pytest.approx(b, abs=1e-5), (got, want)


# --- the processors ----------------------------------------------------------------------------------


def test_penalties_match_reference() -> None:
    logits = known_logits()
    prompts = [[0, 1, 2], [3, 3], [5], [7, 8]]
    outputs = [[2, 2, 4], [], [5, 5, 5, 6], [9]]
    presence, frequency, repetition = [0.5, -0.3, 1.5, 0.0], [0.2, 1.0, 0.0, -0.7], [1.3, 1.0, 0.8, 2.0]
    got = apply_penalties(
        logits.clone(),
        prompts,
        outputs,
        presence=torch.tensor(presence),
        frequency=torch.tensor(frequency),
        repetition=torch.tensor(repetition),
    )
    expected = [
        ref_penalties(row, prompts[i], outputs[i], presence[i], frequency[i], repetition[i])
        for i, row in enumerate(logits.tolist())
    ]
    assert_rows_equal(got, expected)


@pytest.mark.parametrize("kind", ["presence", "frequency", "repetition"])
def test_each_penalty_alone_moves_only_the_tokens_it_should(kind: str) -> None:
    logits = known_logits(1, seed=3)
    prompt, output = [1], [4, 4, 6]
    values = {"presence": 0.0, "frequency": 0.0, "repetition": 1.0}
    values[kind] = 1.7 if kind == "repetition" else 0.9
    got = apply_penalties(
        logits.clone(),
        [prompt],
        [output],
        **{name: torch.tensor([value]) for name, value in values.items()},
    )
    changed = {t for t in range(VOCAB) if abs(got[0, t] - logits[0, t]) > 1e-6}
    assert changed == ({1, 4, 6} if kind == "repetition" else {4, 6})
    assert_rows_equal(got, [ref_penalties(logits[0].tolist(), prompt, output, **values)])


def test_top_k_matches_reference() -> None:
    logits = known_logits()
    ks = [1, 3, VOCAB, 5]
    got = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.ones(4))
    assert_rows_equal(got, [ref_top_k(row, k) for row, k in zip(logits.tolist(), ks, strict=True)])


def test_top_p_matches_reference() -> None:
    logits = known_logits()
    ps = [0.3, 0.75, 1.0, 0.9]
    got = apply_top_k_top_p(logits.clone(), torch.full((4,), VOCAB), torch.tensor(ps))
    assert_rows_equal(got, [ref_top_p(row, p) for row, p in zip(logits.tolist(), ps, strict=True)])


def test_top_k_then_top_p_matches_reference() -> None:
    logits = known_logits(seed=5)
    got = apply_top_k_top_p(logits.clone(), torch.tensor([4, 4, 4, 4]), torch.full((4,), 0.6))
    assert_rows_equal(got, [ref_top_p(ref_top_k(row, 4), 0.6) for row in logits.tolist()])


def test_min_p_matches_reference() -> None:
    logits = known_logits()
    min_ps = [0.0, 0.1, 0.5, 1.0]
    got = apply_min_p(logits.clone(), torch.tensor(min_ps))
    assert_rows_equal(got, [ref_min_p(row, m) for row, m in zip(logits.tolist(), min_ps, strict=True)])


# --- the whole pass ----------------------------------------------------------------------------------


def expected_seeded_token(row: list[float], seed: int) -> int:
    """The exponential race with the request's own generator, on the reference-processed row."""
    probs = torch.tensor(softmax(row))
    noise = torch.empty(VOCAB).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((probs / noise).argmax())


def test_full_pass_equals_reference_pipeline_for_seeded_rows() -> None:
    logits = known_logits(6, seed=11)
    params = [
        SamplingParams(temperature=0.7, top_k=3, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, seed=2),
        SamplingParams(temperature=1.0, min_p=0.2, seed=3),
        SamplingParams(
            temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.4, seed=4
        ),
        SamplingParams(temperature=0.0, repetition_penalty=3.0),  # greedy on penalized logits
        SamplingParams(temperature=1.0, top_k=5, top_p=0.7, min_p=0.05, seed=6),
    ]
    seqs = [make_seq(p, prompt=[0, 1], output=[4, 4, 9]) for p in params]
    untouched = logits.clone()
    got = Sampler(seed=0)(logits, seqs, {EOS}).token_ids
    assert torch.equal(logits, untouched)  # the caller's logits are not modified
    for i, (p, row) in enumerate(zip(params, logits.tolist(), strict=True)):
        row = ref_penalties(
            row, [0, 1], [4, 4, 9], p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        )
        if p.is_greedy:
            assert got[i] == max(range(VOCAB), key=row.__getitem__)
            continue
        row = [x / p.temperature for x in row]
        if p.min_p:
            row = ref_min_p(row, p.min_p)
        if p.top_k:
            row = ref_top_k(row, p.top_k)
        if p.top_p < 1:
            row = ref_top_p(row, p.top_p)
        assert got[i] == expected_seeded_token(row, p.seed), i


def test_samples_stay_inside_the_filtered_set_and_cover_it() -> None:
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0, 1.0, 0.5, -3.0, 0.1, 0.2, 0.3]])
    sampler = Sampler(seed=0)
    seen = set()
    for _ in range(300):
        seen.add(sampler(logits, [make_seq(SamplingParams(top_k=3))], {EOS}).token_ids[0])
    assert seen == {0, 1, 2}


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)]))
    sampler = Sampler(seed=0)
    draws = 3000
    counts = torch.zeros(VOCAB)
    rows = logits.expand(draws, VOCAB)
    tokens = sampler(rows, [make_seq(SamplingParams()) for _ in range(draws)], {EOS}).token_ids
    counts.index_add_(0, torch.tensor(tokens), torch.ones(draws))
    assert counts[:3].tolist() == pytest.approx([1500, 900, 600], abs=120)


def test_seeded_rows_are_batch_invariant() -> None:
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(32, VOCAB, generator=generator) for _ in range(20)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    alone, sampler = make_seq(params), Sampler(seed=0)
    tokens_alone = [sampler(step[17:18], [alone], {EOS}).token_ids[0] for step in steps]

    batch = [make_seq(SamplingParams(temperature=1.0, seed=None if i % 2 else i)) for i in range(32)]
    batch[17] = make_seq(params)
    sampler = Sampler(seed=99)  # a different shared generator changes nothing for the seeded row
    tokens_batched = [sampler(step, batch, {EOS}).token_ids[17] for step in steps]
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 1  # really sampling, not a constant


def test_greedy_is_argmax_and_ignores_other_rows() -> None:
    logits = known_logits(5)
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(5)]
    assert Sampler()(logits, seqs, {EOS}).token_ids == logits.argmax(dim=1).tolist()


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 3], logits[0, 5] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    early = make_seq(params, output=[1])
    assert Sampler()(logits, [early], {EOS}).token_ids == [5]
    done = make_seq(params, output=[1, 2])
    assert Sampler()(logits, [done], {EOS}).token_ids == [EOS]
    ignoring = make_seq(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), output=[1])
    assert Sampler()(logits, [ignoring], {EOS}).token_ids == [EOS]  # ignore_eos: EOS is an ordinary token


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = known_logits(2, seed=4)
    seqs = [
        make_seq(SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=9)),
        make_seq(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler()(logits, seqs, {EOS})
    raw = torch.log_softmax(logits, dim=-1)
    for i, figures in enumerate(out.logprobs):
        token = out.token_ids[i]
        assert figures.logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert figures.rank == int((raw[i] > raw[i, token]).sum()) + 1
        top = raw[i].topk(seqs[i].params.logprobs)
        assert figures.top_token_ids == top.indices.tolist()
        assert figures.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top_token_ids == []
    assert Sampler()(logits, [make_seq(SamplingParams())] * 2, {EOS}).logprobs == [None, None]
