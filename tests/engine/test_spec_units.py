"""Speculative decoding's parts on their own: the config dict, the n-gram proposer, the rejection sampler."""

from __future__ import annotations

import pytest
import torch

from batchinfer.engine.spec_decode.ngram import NgramProposer, propose_ngram
from batchinfer.engine.spec_decode.rejection import accept_greedy, accept_replay, rejection_sample
from batchinfer.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from tests.engine.spec_stats import assert_distributed_as, chi_square, chi_square_critical


def test_config_shapes_and_errors_name_the_field() -> None:
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert ngram == SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=5)
    draft = parse_speculative_config({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2})
    assert draft is not None and draft.model == "tiny" and draft.num_speculative_tokens == 2
    assert parse_speculative_config(ngram.to_dict()) == ngram
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    cases = [
        ([1], r"^speculative_config: must be a dict"),
        ({"method": "eagle", "num_speculative_tokens": 2}, r"^speculative_config\.method:"),
        ({"method": "ngram"}, r"^speculative_config\.num_speculative_tokens: is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"^speculative_config\.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": 99}, r"^speculative_config\.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
         r"^speculative_config\.prompt_lookup_min:"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"^speculative_config\.model:"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"^speculative_config\.model:"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
         r"^speculative_config\.prompt_lookup_max:"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": True},
         r"^speculative_config\.disable_by_batch_size:"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown keys \['lookahead'\]"),
    ]
    for value, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            parse_speculative_config(value)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # suffix [6, 7] occurs at 1 and 5; the latest (5) is followed by 1, 2, 6, 7
    assert propose_ngram(tokens, 3, 1, 4) == [1, 2, 6]
    # a longer suffix wins over a more recent shorter one: [9, 6, 7] ... here none, so [6, 7] again
    tokens = [1, 2, 3, 4, 0, 3, 4, 9, 1, 2, 3, 4]
    assert propose_ngram(tokens, 2, 1, 4) == [0, 3]  # [1, 2, 3, 4] at 0, not [3, 4] at 5
    assert propose_ngram(tokens, 2, 1, 2) == [9, 1]  # max_n 2: the latest [3, 4] (at 5)
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []  # the last token never occurred before
    assert propose_ngram([4, 4], 3, 2, 3) == []  # too short for min_n 2
    assert propose_ngram([7, 7, 7, 7], 3, 1, 2) == [7]  # proposals stop at the end of the tokens
    assert propose_ngram(tokens, 0, 1, 4) == []

    class Seq:
        token_ids = [1, 2, 3, 1, 2]

    assert NgramProposer(4, 1, 3).propose([Seq()], [1]) == [([3], None)]


def test_greedy_acceptance_stops_at_the_first_disagreement() -> None:
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted, plus the bonus token
    assert accept_greedy([4, 9, 6], [4, 5]) == [4, 9]  # d_2 rejected: the target's token replaces it
    assert accept_greedy([3], []) == [3]


def test_seeded_replay_draws_what_sampling_without_speculation_draws() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 50) * 2, dim=-1)
    plain = torch.Generator().manual_seed(7)
    expected = [int((probs[j] / torch.empty(50).exponential_(generator=plain)).argmax()) for j in range(4)]
    for drafts in ([expected[0], expected[1], expected[2]], [expected[0], (expected[1] + 1) % 50, 3], [9]):
        generator = torch.Generator().manual_seed(7)
        emitted = accept_replay(probs[: len(drafts) + 1], drafts, generator)
        assert emitted == expected[: len(emitted)]
        # the generator advanced once per emitted token: the next draw continues the plain stream
        after = torch.Generator().manual_seed(7)
        for _ in emitted:
            torch.empty(50).exponential_(generator=after)
        assert torch.equal(generator.get_state(), after.get_state())


def _target_and_draft(vocab: int = 12, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    return p, q


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_q", "ngram_one_hot"])
def test_rejection_sampling_keeps_the_target_distribution(one_hot: bool) -> None:
    p, q = _target_and_draft()
    generator = torch.Generator().manual_seed(11)
    draws = torch.Generator().manual_seed(12)
    first, second = [], []
    accepted = 0
    for _ in range(12000):
        if one_hot:  # an n-gram proposal: a fixed guess, q one-hot at it
            drafts, q_rows = [3, 5], None
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=draws)) for j in range(2)]
            q_rows = q
        emitted = rejection_sample(p, drafts, q_rows, generator)
        assert 1 <= len(emitted) <= 3 and emitted[: len(emitted) - 1] == drafts[: len(emitted) - 1]
        first.append(emitted[0])
        if emitted[0] == drafts[0] and len(emitted) > 1:  # d_1 accepted: position 1 is sampled from p_1
            second.append(emitted[1])
        accepted += len(emitted) - 1
    assert_distributed_as(first, dict(enumerate(p[0].tolist())))
    assert_distributed_as(second, dict(enumerate(p[1].tolist())))
    assert accepted > 0


def test_the_chi_square_check_rejects_a_wrong_distribution() -> None:
    p, q = _target_and_draft()
    generator = torch.Generator().manual_seed(5)
    wrong = [int(torch.multinomial(q[0], 1, generator=generator)) for _ in range(4000)]
    statistic, df = chi_square(wrong, dict(enumerate(p[0].tolist())))
    assert statistic > chi_square_critical(df)
    assert 29.5 < chi_square_critical(10) < 30.1  # the table: 29.59


def test_a_request_line_may_opt_out_of_speculation() -> None:
    import orjson

    from batchinfer.wire.input_line import parse_line
    from batchinfer.wire.request import LineError

    def line(value: object) -> bytes:
        body = {"messages": [{"role": "user", "content": "a"}], "speculative_decoding": value}
        return orjson.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                             "body": body})

    assert parse_line(line(False), 1).params.speculative_decoding is False
    assert parse_line(line(True), 1).params.speculative_decoding is True
    with pytest.raises(LineError, match="speculative_decoding"):
        parse_line(line("no"), 1)


def _decoding(scheduler, prompt_len: int, params, seq_id: str):
    """A sequence admitted and run to its first decode step (prompt computed, one token sampled)."""
    from batchinfer.engine.core.sequence import Sequence

    first = 1 + 100 * (ord(seq_id) - ord("a"))  # distinct prompts: no prefix-cache hits between them
    seq = Sequence(seq_id, list(range(first, first + prompt_len)), params, max_tokens=params.max_tokens or 64)
    scheduler.add(seq)
    out = scheduler.schedule()
    assert out.scheduled[-1] == (seq, prompt_len)
    seq.num_computed_tokens = prompt_len
    seq.token_ids.append(7)
    return seq


def test_the_scheduler_plans_lookahead_within_limits_and_never_preempts_for_it() -> None:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.core.block_manager import BlockManager
    from batchinfer.engine.core.scheduler import Scheduler
    from batchinfer.engine.core.sequence import Sequence
    from batchinfer.engine.sampling_params import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2}
    config = EngineConfig(model="m", block_size=4, speculative_config=spec)
    scheduler = Scheduler(config, BlockManager(64, 4), max_model_len=64)
    a = _decoding(scheduler, 8, SamplingParams(max_tokens=3), "a")  # room for 2 more tokens: 1 draft
    b = _decoding(scheduler, 8, SamplingParams(max_tokens=20, speculative_decoding=False), "b")
    out = scheduler.schedule()
    assert out.scheduled == [(a, 1), (b, 1)] and out.lookahead == [(0, 1)]
    assert len(a.block_table) * 4 >= a.num_computed_tokens + 2  # slots for its token and its draft
    assert a.block_hashes == [] or len(a.block_hashes) <= len(a.token_ids) // 4  # drafts never hashed

    _decoding(scheduler, 8, SamplingParams(max_tokens=20), "c")
    assert [row for row, _ in scheduler.schedule().lookahead] == []  # 3 running > disable_by_batch_size

    # Short of blocks: the sequences decode plainly, and speculation preempts nobody.
    tight = Scheduler(EngineConfig(model="m", block_size=4, speculative_config=spec), BlockManager(5, 4),
                      max_model_len=64)
    d, e = (Sequence(name, list(range(first, first + n)), SamplingParams(max_tokens=20), max_tokens=20)
            for name, first, n in (("d", 300, 7), ("e", 400, 11)))
    tight.add(d)
    tight.add(e)
    assert [n for _, n in tight.schedule().scheduled] == [7, 11]  # 2 + 3 blocks: the pool is full
    for seq in (d, e):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(7)
    out = tight.schedule()
    assert out.lookahead == [] and out.preempted == [] and [n for _, n in out.scheduled] == [1, 1]


def test_speculation_leaves_a_token_of_budget_for_every_later_running_sequence() -> None:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.core.block_manager import BlockManager
    from batchinfer.engine.core.scheduler import Scheduler
    from batchinfer.engine.sampling_params import SamplingParams

    # A budget of 6 tokens, 4 drafts each: the oldest sequence's drafts alone would take 5 of them.
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    config = EngineConfig(model="m", block_size=4, max_num_batched_tokens=64, speculative_config=spec)
    scheduler = Scheduler(config, BlockManager(64, 4), max_model_len=64)
    running = [_decoding(scheduler, 8, SamplingParams(max_tokens=20), name) for name in "abcd"]
    scheduler.max_num_batched_tokens = 6
    out = scheduler.schedule()
    assert [seq for seq, _ in out.scheduled] == running  # every running sequence moves this step
    assert out.lookahead == [(0, 2)]  # 6 tokens = a's 1 + 2 drafts, then 1 each for b, c and d
    assert sum(n for _, n in out.scheduled) + sum(k for _, k in out.lookahead) == 6
