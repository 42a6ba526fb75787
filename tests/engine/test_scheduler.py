"""Scheduler policy, driven directly (no model): budgets, chunked prefill, preemption, ordering, abort."""

from __future__ import annotations

import itertools
import random

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.core.block_manager import BlockManager
from batchinfer.engine.core.scheduler import Scheduler, SchedulerOutput
from batchinfer.engine.core.sequence import Sequence, SequenceStatus
from batchinfer.engine.sampling_params import SamplingParams

BS = 4
_fresh_tokens = itertools.count(1000)  # distinct prompts share no prefix unless a test says so


def make(
    num_blocks: int = 64, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64, caching: bool = True
) -> Scheduler:
    config = EngineConfig(
        model="unused",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BS,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching=caching))


def seq(
    tokens: list[int] | int,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    request_id: str = "r",
) -> Sequence:
    ids = [next(_fresh_tokens) for _ in range(tokens)] if isinstance(tokens, int) else tokens
    return Sequence(
        request_id, ids, SamplingParams(), max_tokens=max_tokens, priority=priority, arrival_time=arrival
    )


def step(sched: Scheduler) -> SchedulerOutput:
    """What the engine does around the model: advance computed tokens, 'sample' at chunk ends, finish."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if s.num_output_tokens >= s.max_tokens:
                s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    sched.free_finished()
    return out


def drain(sched: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < limit, "scheduler made no progress"
    sched.block_manager.check_invariants([])
    assert sched.block_manager.num_used_blocks == 0
    return outs


def test_running_decodes_come_first_then_waiting_prefills_fill_the_budget() -> None:
    sched = make(max_num_batched_tokens=16)
    first, second = seq(6, max_tokens=3), seq(6, max_tokens=3)
    sched.add(first)
    sched.add(second)
    out = step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(first, 6), (second, 6)]
    late = seq(20, max_tokens=2)
    sched.add(late)
    out = step(sched)
    # Two decodes (1 token each), then the newcomer takes what is left of the budget: a 14-token chunk.
    assert [(s, n) for s, n in out.scheduled] == [(first, 1), (second, 1), (late, 14)]
    out = step(sched)
    assert [(s, n) for s, n in out.scheduled] == [(first, 1), (second, 1), (late, 6)]
    assert late.num_output_tokens == 1  # sampled only when its last chunk completed
    drain(sched)


def test_token_budget_and_max_num_seqs_are_never_exceeded() -> None:
    sched = make(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(12):
        sched.add(seq(random.Random(i).randrange(1, 25), max_tokens=5))
    for out in drain(sched):
        assert out.num_batched_tokens <= 10
        assert len(out.scheduled) <= 3


def test_out_of_blocks_preempts_the_newest_and_admits_nobody() -> None:
    sched = make(num_blocks=4, max_num_batched_tokens=64)
    old, new = seq(8, max_tokens=6), seq(8, max_tokens=6)  # 2 blocks each: the pool is full
    sched.add(old)
    sched.add(new)
    step(sched)
    waiting = seq(2, max_tokens=1)
    sched.add(waiting)
    out = step(sched)  # both decode into position 8: old needs a 3rd block -> new is preempted
    assert out.preempted == [new]
    assert [s for s, _ in out.scheduled] == [old]
    assert new.status == SequenceStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_table == []
    assert waiting.status == SequenceStatus.WAITING  # nothing admitted in a preempting step
    assert sched.num_preemptions == 1 and sched.num_waiting == 2
    assert sched.preempted[0] is new  # front of the queue, ahead of `waiting`
    drain(sched)
    assert new.num_output_tokens == 6 and waiting.num_output_tokens == 1


def test_a_sequence_that_cannot_fit_preempts_itself_when_it_is_the_newest() -> None:
    sched = make(num_blocks=3, max_num_batched_tokens=64)
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 1 block, b: 1 block; both sampled
    step(sched)  # both need a 2nd block: a gets the last free one, b (newest) is preempted
    assert b.status == SequenceStatus.PREEMPTED
    drain(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8


def test_priority_then_arrival_order_for_admission() -> None:
    sched = make(max_num_seqs=1)
    late_urgent = seq(3, priority=-1, arrival=5.0, request_id="late_urgent")
    early = seq(3, priority=0, arrival=1.0, request_id="early")
    earliest = seq(3, priority=0, arrival=0.5, request_id="earliest")
    for s in (early, earliest, late_urgent):
        sched.add(s)
    admitted = []
    while sched.has_unfinished():
        for s, _ in step(sched).scheduled:
            if s.request_id not in admitted:
                admitted.append(s.request_id)
    assert admitted == ["late_urgent", "earliest", "early"]


def test_cached_prefix_does_not_count_against_the_budget() -> None:
    sched = make(max_num_batched_tokens=6)
    prefix = list(range(100, 112))  # 3 full blocks
    first = seq(prefix + [1, 2], max_tokens=1)
    sched.add(first)
    drain(sched)
    second = seq(prefix + [3, 4], max_tokens=1)
    sched.add(second)
    out = sched.schedule()
    assert out.scheduled == [(second, 2)] and second.num_cached_tokens == 12
    sched.abort(second)


def test_same_step_admissions_share_prefix_blocks() -> None:
    sched = make(max_num_batched_tokens=64)
    prefix = list(range(100, 112))
    a, b = seq(prefix + [1], max_tokens=2), seq(prefix + [2], max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(a, 13), (b, 1)]  # b reuses the blocks a fills in this very step
    assert b.block_table[:3] == a.block_table[:3]
    sched.abort(a)
    sched.abort(b)
    sched.block_manager.check_invariants([])


def test_abort_from_every_state_frees_blocks() -> None:
    sched = make(num_blocks=4, max_num_batched_tokens=64)
    running, newest, queued = seq(8, max_tokens=6), seq(8, max_tokens=6), seq(3)
    for s in (running, newest, queued):
        sched.add(s)
    step(sched)
    step(sched)  # newest gets preempted; queued still waits
    assert newest.status == SequenceStatus.PREEMPTED and queued.status == SequenceStatus.WAITING
    for s in (running, newest, queued):
        sched.abort(s)
        assert s.status == SequenceStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()
    assert sched.schedule().scheduled == []
    sched.block_manager.check_invariants([])
    assert sched.block_manager.num_used_blocks == 0


def test_heavy_random_load_finishes_everyone_without_leaks() -> None:
    rng = random.Random(3)
    sched = make(num_blocks=20, max_num_seqs=6, max_num_batched_tokens=24)
    seqs = [seq(rng.randrange(1, 40), max_tokens=rng.randrange(1, 30)) for _ in range(40)]
    for s in seqs:
        sched.add(s)
    outs = drain(sched, limit=2000)
    assert all(s.num_output_tokens == s.max_tokens for s in seqs)
    assert sched.num_preemptions > 0 and any(out.preempted for out in outs)


def test_without_prefix_caching_everything_is_computed() -> None:
    sched = make(caching=False)
    a, b = seq(list(range(12)) + [1], max_tokens=1), seq(list(range(12)) + [2], max_tokens=1)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert out.scheduled == [(a, 13), (b, 13)]
    drain(sched)
