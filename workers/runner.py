"""ShardRunner: the bridge between the job store and the one long-lived engine of a worker process.

It claims shards, feeds their pending requests into the engine, and writes finished requests back in
small batches fenced by each shard's lease token. It keeps several shards in flight (claiming the next
one before the current one drains) so the running batch never empties at a shard boundary. The same
code serves the local mode (`batchinfer run`, `batchinfer worker` without a broker) and Celery tasks.

Ordering rules that keep "every custom_id exactly once" true (ARCHITECTURE.md, contract 7):
- a result is written before its shard is completed; complete_shard errors whatever is still pending;
- a shard whose lease is lost or whose job stopped is aborted in the engine and released, never completed;
- after a crash nothing of ours is trusted: the rescuer returns the shard and only pending requests rerun.

A long engine call never costs the held shards their leases: a LeaseKeeper thread (lease_keeper.py)
extends them while the loop is inside one. Embedding lines run between steps, at most a step's token
budget (max_num_batched_tokens, at least one input) per loop turn, so generation keeps moving beside them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from batchinfer.config import Settings
from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.lora.request import LoRARequest, lora_requests
from batchinfer.store import shards as shard_store
from batchinfer.store import workers as worker_store
from batchinfer.store.errors import LeaseLost
from batchinfer.store.models import JOB_TERMINAL_STATUSES, ShardStatus
from batchinfer.store.result_files import record_result_sizes_in_background
from batchinfer.store.shards import PendingRequest, ShardLease
from batchinfer.wire.result_row import ResultRow, SuccessRow
from workers.embedding_queue import EmbeddingQueue
from workers.engine_prompts import engine_prompt, prompt_text
from workers.lease_keeper import LeaseKeeper
from workers.metrics import WorkerMetrics, inflight_report
from workers.model_identity import runner_identity
from workers.result_cache import ResultCache, prefix_cache_salt
from workers.result_rows import error_row, result_row

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine
    from batchinfer.engine.outputs import RequestOutput

logger = logging.getLogger("batchinfer.workers")

# How often a held shard's lease is extended and its job checked for cancel/expiry, at most.
MAX_CHECK_INTERVAL_S = 2.0
# After a claim found nothing, wait this long before asking the database again (per runner loop).
CLAIM_BACKOFF_S = 1.0
# How often the worker table hears from a busy worker (`batchinfer workers`).
WORKER_HEARTBEAT_S = 10.0


@dataclass
class _Flight:
    """One shard this worker holds: its lease, the engine requests still out, results not yet written."""

    lease: ShardLease
    outstanding: set[str] = field(default_factory=set)
    buffered: list[ResultRow] = field(default_factory=list)
    last_check: float = field(default_factory=time.monotonic)


@dataclass
class _Submitted:
    """What the runner remembers of a request it gave the engine (enough to re-add it alone)."""

    shard_id: int
    request: PendingRequest
    prompt: str | list[int]
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # an adapter shard's request's adapter, None for the model's


@dataclass
class RunStats:
    """What one `work()` call did."""

    shards_completed: int = 0
    shards_released: int = 0
    requests_finished: int = 0
    requests_errored: int = 0
    generation_tokens: int = 0


ProgressCallback = Callable[[int, int], None]  # (requests finished now, tokens generated now)


class ShardRunner:
    """Runs shards of one model on one engine; see the module docstring for the guarantees."""

    def __init__(self, *, engine: Engine, sessions: sessionmaker[Session], model: str, worker_id: str,
                 settings: Settings, max_shards_in_flight: int = 4,
                 metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else WorkerMetrics.for_engine(engine)
        self.sessions = sessions
        self.model = model
        self.adapters = lora_requests(settings.lora_modules)  # served LoRA adapter name -> LoRARequest
        self.worker_id = worker_id
        self.settings = settings
        self.max_shards_in_flight = max(2, max_shards_in_flight)
        self._flights: dict[int, _Flight] = {}
        self._submitted: dict[str, _Submitted] = {}
        self._embeddings = EmbeddingQueue(engine, model)  # run between steps, within a step's budget
        self._cache = ResultCache(  # the engine's config read when a shard is planned (a lazy engine's grows)
            sessions=sessions, settings=settings, on_served=self.metrics.result_cache_served,
            identity_of=lambda served: runner_identity(self.engine.config, served, model=model,
                                                       adapters=self.adapters))
        self._last_flush = time.monotonic()
        self._next_claim_at = 0.0
        self._last_worker_beat = time.monotonic()
        self._check_interval = min(MAX_CHECK_INTERVAL_S, settings.lease_seconds / 3)
        self._keeper = LeaseKeeper(sessions=sessions, worker_id=worker_id,
                                   lease_seconds=settings.lease_seconds, interval_s=self._check_interval)

    # --- the loop ------------------------------------------------------------------------------------

    def work(self, *, first_shard_id: int | None = None, job_id: int | None = None,
             stop: threading.Event | None = None, on_progress: ProgressCallback | None = None) -> RunStats:
        """Claim and run shards (only `job_id`'s when given) until none is left or `stop` is set."""
        stop = stop or threading.Event()
        self._keeper.start()
        try:
            return self._work(first_shard_id, job_id, stop, on_progress)
        finally:
            self._keeper.stop()

    def _work(self, first_shard_id: int | None, job_id: int | None, stop: threading.Event,
              on_progress: ProgressCallback | None) -> RunStats:
        stats = RunStats()
        self._next_claim_at = 0.0
        if first_shard_id is not None:
            self._claim(shard_id=first_shard_id)
        while True:
            if not stop.is_set():
                self._top_up(job_id)
            elif self._flights:
                self._release_all(stats)
            if not self._flights and (stop.is_set() or not self._top_up(job_id, force=True)):
                break
            self._keeper.publish([flight.lease for flight in self._flights.values()])
            try:
                try:
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                except RankFailedError:
                    raise
                except Exception as exc:  # one bad request must not take the worker down
                    logger.exception("engine step failed; isolating the culprit")
                    outputs = self._isolate_failure(exc)
            except RankFailedError:  # no request is to blame and no step can run: shards back now, exit
                logger.exception("a rank of the parallel engine failed; handing the shards back")
                self.hand_back()
                raise
            self._run_embeddings(stats)
            tokens = 0
            for output in outputs:
                tokens += self._collect(output, stats)
            stats.generation_tokens += tokens
            if on_progress is not None and (outputs or tokens):
                on_progress(len(outputs), tokens)
            self._maybe_flush(force=False)
            self._check_leases(stats)
            self._complete_drained(stats)
        self._maybe_flush(force=True)
        return stats

    def _top_up(self, job_id: int | None, *, force: bool = False) -> bool:
        """Claim another shard when fewer than two are held or the engine is about to run dry."""
        now = time.monotonic()
        if not force and now < self._next_claim_at:
            return False
        claimed = False
        while len(self._flights) < self.max_shards_in_flight and (
            len(self._flights) < 2 or self.engine.get_num_unfinished() < self.engine.config.max_num_seqs
        ):
            if not self._claim(job_id=job_id):
                self._next_claim_at = now + CLAIM_BACKOFF_S
                break
            claimed = True
        return claimed

    # --- claiming and feeding ------------------------------------------------------------------------

    def _claim(self, *, shard_id: int | None = None, job_id: int | None = None) -> bool:
        with self.sessions() as session:
            if shard_id is None and job_id is not None:
                candidates = shard_store.list_shards(session, job_id=job_id, status=ShardStatus.AVAILABLE)
                lease = None
                for shard in candidates:  # one job in this process: all its shards, whatever their model
                    lease = shard_store.claim_shard(session, worker_id=self.worker_id, shard_id=shard.id,
                                                    lease_seconds=self.settings.lease_seconds)
                    if lease is not None:
                        break
            else:
                lease = None
                for name in (self.model, *self.adapters):  # the model's shards, then each adapter's
                    lease = shard_store.claim_shard(session, worker_id=self.worker_id, model=name,
                                                    shard_id=shard_id,
                                                    lease_seconds=self.settings.lease_seconds)
                    if lease is not None:
                        break
            if lease is None:
                return False
            pending = shard_store.pending_requests(session, shard_id=lease.shard_id)
        flight = _Flight(lease=lease)
        self._flights[lease.shard_id] = flight
        self.metrics.shard_claimed()
        logger.info("claimed shard %s of job %s (%d pending)", lease.shard_id, lease.job_id, len(pending))
        plan = self._cache.plan(lease, pending)  # hits served here, duplicates wait for their twin
        flight.buffered.extend(plan.served)
        flight.outstanding.update(str(request.request_id) for request in plan.waiting)
        for request in plan.run:
            self._submit(flight, request)
        return True

    def _resubmit(self, orphans: list[tuple[int, PendingRequest]]) -> None:
        """Duplicates whose twin will not finish here run themselves (their ids are still outstanding)."""
        for shard_id, request in orphans:
            flight = self._flights.get(shard_id)
            if flight is not None:
                self._submit(flight, request)

    def _deliver(self, rows: Iterable[tuple[int, ResultRow]]) -> None:
        """Result rows (shard id, row) of held shards' requests: buffered for writing, no longer out."""
        for shard_id, row in rows:
            flight = self._flights.get(shard_id)
            if flight is not None:
                flight.buffered.append(row)
                flight.outstanding.discard(str(row["request_id"]))

    def _submit(self, flight: _Flight, request: PendingRequest) -> None:
        engine_id = str(request.request_id)
        if request.endpoint == "embeddings":  # a plain forward per input, outside the generation batch
            flight.outstanding.add(engine_id)
            self._embeddings.add(flight.lease.shard_id, request)
            return
        try:  # request.params was validated at ingest; the engine still checks it against this model
            prompt = engine_prompt(self.engine, request)
            salt = prefix_cache_salt(self.settings, flight.lease.owner)
            lora = self.adapters.get(flight.lease.model)  # a shard of lines naming a served adapter
            self.engine.add_request(engine_id, prompt, request.params, cache_salt=salt, lora_request=lora)
        except (ValueError, TypeError) as exc:
            self._deliver([(flight.lease.shard_id, error_row(request, "invalid_request", str(exc)))])
            self._resubmit(self._cache.failed(engine_id))
            return
        flight.outstanding.add(engine_id)
        self._submitted[engine_id] = _Submitted(flight.lease.shard_id, request, prompt, salt, lora)

    def _run_embeddings(self, stats: RunStats) -> None:
        for done in self._embeddings.run(self._still_outstanding):
            lease = self._flights[done.shard_id].lease
            self._deliver([(done.shard_id, self._cache.fresh_row(lease, done.row))])
            stats.requests_finished += 1

    def _still_outstanding(self, shard_id: int, engine_id: str) -> bool:
        flight = self._flights.get(shard_id)
        return flight is not None and engine_id in flight.outstanding

    # --- results -------------------------------------------------------------------------------------

    def _collect(self, output: RequestOutput, stats: RunStats) -> int:
        submitted = self._submitted.pop(output.request_id, None)
        if submitted is None:
            return 0
        flight = self._flights.get(submitted.shard_id)
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if flight is None:
            return tokens
        flight.outstanding.discard(output.request_id)
        if output.error is not None:  # it never ran: its grammar failed to compile (or took too long)
            flight.buffered.append(error_row(submitted.request, "invalid_request", output.error))
            stats.requests_finished += 1
            self._resubmit(self._cache.failed(output.request_id))
            return tokens
        echo = (submitted.request.options or {}).get("echo")
        echo_text = prompt_text(self.engine, submitted.prompt) if echo else ""
        result = result_row(submitted.request, output, echo_text)
        model = flight.lease.model if flight.lease.model in self.adapters else self.model
        row: SuccessRow = {**result, "model": model}  # a line's body.model may route it here
        self._deliver(self._cache.finished(flight.lease, submitted.request, row))  # + its twins' copies
        stats.requests_finished += 1
        return tokens

    def _maybe_flush(self, *, force: bool) -> None:
        buffered = sum(len(f.buffered) for f in self._flights.values())
        if not buffered:
            return
        interval_passed = (time.monotonic() - self._last_flush) * 1000 >= self.settings.write_interval_ms
        if not (force or interval_passed or buffered >= self.settings.write_batch_size):
            return
        for shard_id, flight in list(self._flights.items()):
            if flight.buffered:
                self._flush(shard_id, flight)
        self._last_flush = time.monotonic()

    def _flush(self, shard_id: int, flight: _Flight) -> bool:
        results, flight.buffered = flight.buffered, []
        try:
            with self.sessions() as session, self.metrics.timed_write(len(results)):
                shard_store.write_results(session, shard_id=shard_id, lease_token=flight.lease.lease_token,
                                          results=results)
        except LeaseLost:
            self.metrics.lease_lost()
            logger.warning("lease of shard %s lost; dropping it", shard_id)
            self._drop(shard_id)
            return False
        self._cache.written()  # their bodies are in the database now; the cache's bound is kept
        return True

    # --- leases, cancel, completion ------------------------------------------------------------------

    def _check_leases(self, stats: RunStats) -> None:
        now = time.monotonic()
        if now - self._last_worker_beat >= WORKER_HEARTBEAT_S:
            self._last_worker_beat = now
            with self.sessions() as session:
                worker_store.worker_heartbeat(session, worker_id=self.worker_id,
                                              info=self.metrics.heartbeat_info())
        for shard_id, flight in list(self._flights.items()):
            if now - flight.last_check < self._check_interval:
                continue
            flight.last_check = now
            with self.sessions() as session:  # with the tokens generated so far: honest progress
                alive = shard_store.heartbeat(session, shard_id=shard_id,
                                              lease_token=flight.lease.lease_token,
                                              lease_seconds=self.settings.lease_seconds,
                                              inflight=inflight_report(
                                                  self.engine, flight.outstanding,
                                                  steps_per_second=self.metrics.steps_per_second()))
            if not alive:  # job cancelled or expired, or the lease went to someone else
                logger.info("shard %s stopped (job no longer in progress or lease lost)", shard_id)
                self._abort_requests(flight)
                if flight.buffered:
                    self._flush(shard_id, flight)
                self._release(shard_id, flight, stats)

    def _complete_drained(self, stats: RunStats) -> None:
        for shard_id, flight in list(self._flights.items()):
            if flight.outstanding:
                continue
            if flight.buffered and not self._flush(shard_id, flight):
                continue
            try:
                with self.sessions() as session:
                    status = shard_store.complete_shard(session, shard_id=shard_id,
                                                        lease_token=flight.lease.lease_token)
                logger.info("completed shard %s (job now %s)", shard_id, status)
                if status in JOB_TERMINAL_STATUSES:  # its output / error files exist now: size them once
                    record_result_sizes_in_background(self.sessions, job_id=flight.lease.job_id)
                stats.shards_completed += 1
                self.metrics.shard_completed()
            except LeaseLost:
                self.metrics.lease_lost()
                logger.warning("lease of shard %s lost before completion", shard_id)
            self._flights.pop(shard_id, None)
            self._cache.forget_shard(shard_id)

    def hand_back(self) -> RunStats:
        """Abort what is in flight, write what finished, release every shard (after a database outage broke
        the loop: workers.process.work_through_outages); results lost with a failed write run again."""
        stats = RunStats()
        self._release_all(stats)
        for engine_id in self._submitted:  # requests whose shard was already dropped
            self.engine.abort(engine_id)
        self._submitted.clear()
        self._cache.reset()
        return stats

    def _release_all(self, stats: RunStats) -> None:
        """Shutdown: abort what is in flight, keep what finished, hand the shards back."""
        for shard_id, flight in list(self._flights.items()):
            self._abort_requests(flight)
            if flight.buffered:
                self._flush(shard_id, flight)
            if shard_id in self._flights:
                self._release(shard_id, flight, stats)

    def _release(self, shard_id: int, flight: _Flight, stats: RunStats) -> None:
        with self.sessions() as session:
            if shard_store.release_shard(session, shard_id=shard_id, lease_token=flight.lease.lease_token):
                logger.info("released shard %s (its finished results kept)", shard_id)
        stats.shards_released += 1
        self.metrics.shard_released()
        self._flights.pop(shard_id, None)

    def _abort_requests(self, flight: _Flight) -> None:
        orphans = self._cache.forget_shard(flight.lease.shard_id)  # twins elsewhere waiting on these
        for engine_id in list(flight.outstanding):
            self.engine.abort(engine_id)
            self._submitted.pop(engine_id, None)
            self._cache.discard(engine_id)
        flight.outstanding.clear()
        self._resubmit(orphans)

    def _drop(self, shard_id: int) -> None:
        flight = self._flights.pop(shard_id, None)
        if flight is not None:
            self._abort_requests(flight)

    # --- failure isolation ---------------------------------------------------------------------------

    def _isolate_failure(self, exc: Exception) -> list[RequestOutput]:
        """A step raised: rerun every in-flight request alone, so only the one(s) that raise are errored."""
        suspects = list(self._submitted.items())
        for engine_id, _ in suspects:
            self.engine.abort(engine_id)
        finished: list[RequestOutput] = []
        for engine_id, submitted in suspects:
            try:
                self.engine.add_request(engine_id, submitted.prompt, submitted.request.params,
                                        cache_salt=submitted.cache_salt, lora_request=submitted.lora_request)
                while self.engine.has_unfinished():
                    finished.extend(o for o in self.engine.step() if o.request_id == engine_id)
            except RankFailedError:
                raise
            except Exception as solo_exc:  # this request is the culprit
                self.engine.abort(engine_id)
                self._submitted.pop(engine_id, None)
                message = f"the engine failed on this request: {solo_exc}"
                failed = [(submitted.shard_id, submitted.request), *self._cache.failed(engine_id)]
                self._deliver((shard_id, error_row(request, "engine_error", message))  # twins fail alike
                              for shard_id, request in failed)
        logger.info("isolated engine failure (%s): %d requests re-run alone", exc, len(suspects))
        return finished
