"""The worker's side of the result cache (issue 31): keys, hits served before the engine, dedup, provenance.

A deterministic request (greedy, or with a `seed`) of a job whose `result_cache` is `use` is looked up in
the job database (store/result_cache.py) before it reaches the engine; a hit becomes its result row at
once. A cacheable success's row carries its body (`result_body`, a BodyRef): the store keeps the body
once per key and the row only references it, in the transaction that writes the row (store/results.py).
Identical requests of one job held by this worker are computed once: the first is the primary, the
others wait for it (their ids stay outstanding in their shard, so no shard completes before they are
written) and get a copy of its row. What keeps "every custom_id exactly once" (ARCHITECTURE.md,
contract 7): a copy is written only by its own shard's lease, like any result; a waiter whose primary is
aborted (its shard released or lost) or fails runs itself; a twin in a shard of another worker either finds
the body stored (a `dedup` hit) or computes it again.

The key is the sha256 of: ENGINE_NUMERICS_VERSION, the served model name and the model's fingerprint
(its weight files, tokenizer, chat template and config: every file of the model directory, hashed once
and cached beside the model cache), the adapter's name and fingerprint, the resolved dtype, the
quantization, the KV cache dtype (when not `auto`) (these from the model's identity,
workers/model_identity.py), the endpoint, the request's canonical form (messages or prompt and its
options: chat template arguments, echo; with the fingerprint they determine the prompt token ids after
the chat template; truncation is a sampling field), every sampling and output field
(`SamplingParams.to_dict`) and the scope (the owner, unless `prefix_cache_scope = "global"`).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import orjson
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.config import Settings
from batchinfer.store import result_cache as cache_store
from batchinfer.store.shards import PendingRequest, ShardLease
from batchinfer.wire.result_row import ROW_OWN_FIELDS, BodyRef, ResultRow, ResultSource, RowBody, SuccessRow
from workers.model_identity import ModelIdentity

# The LRU bound is enforced (a SUM over the bodies) after this many seconds or 1/100 of the bound written.
EVICT_INTERVAL_S = 10.0


def is_deterministic(request: PendingRequest) -> bool:
    """Greedy or seeded: the same inputs give the same output, so a stored one may stand in for it."""
    return request.params.is_greedy or request.params.seed is not None


def request_key(identity: ModelIdentity, request: PendingRequest, *, scope: str) -> str | None:
    """The cache key of `request` (module docstring), or None when it may not be cached."""
    if request.endpoint == "embeddings" or not is_deterministic(request):
        return None
    canonical = {**identity.key_fields(), "endpoint": request.endpoint, "messages": request.messages,
                 "prompt": request.prompt, "options": request.options or {},
                 "params": request.params.to_dict(), "scope": scope}
    return hashlib.sha256(orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS)).hexdigest()


def cache_scope(settings: Settings, owner: str) -> str:
    """Whose earlier results a request may see: its owner's (a hit is an oracle), or everyone's."""
    return "global" if settings.prefix_cache_scope == "global" else f"owner:{owner}"


def prefix_cache_salt(settings: Settings, owner: str) -> str | None:
    """What salts a request's prefix-cache blocks (contract 10): its result-cache scope, none when global."""
    scope = cache_scope(settings, owner)
    return None if scope == "global" else scope


@dataclass
class _Primary:
    """A request computing a key for its job in this worker, and the identical ones waiting for it."""

    engine_id: str
    shard_id: int
    job_id: int
    seed: int | None
    waiters: list[tuple[int, PendingRequest]]


@dataclass(frozen=True)
class _Body:
    """A body this worker can serve for a key: the result row (parsed) and its stored form."""

    row: RowBody
    ref: BodyRef


@dataclass
class Plan:
    """What to do with a claimed shard's pending requests: rows already known, requests to run."""

    served: list[SuccessRow]
    run: list[PendingRequest]
    waiting: list[PendingRequest]  # their ids stay outstanding until their primary's row is copied


class ResultCache:
    """One runner's result cache: plans claimed shards, annotates rows, fans them out, stores bodies."""

    def __init__(self, *, sessions: sessionmaker[Session], settings: Settings,
                 identity_of: Callable[[str], ModelIdentity],
                 on_served: Callable[[str], None] | None = None) -> None:
        self.sessions = sessions
        self._on_served = on_served or (lambda source: None)  # WorkerMetrics.result_cache_served
        self.settings = settings
        self._identity_of = identity_of  # lease.model -> ModelIdentity (computed once per served name)
        self._identities: dict[str, ModelIdentity] = {}
        self._modes: dict[int, str] = {}
        self._primaries: dict[tuple[int, str], _Primary] = {}  # (job id, key) -> primary
        self._by_engine_id: dict[str, tuple[int, str]] = {}
        self._keys: dict[str, str | None] = {}  # engine id -> key, for every request planned and running
        # bodies computed here since the last write: a later shard of the job is served them (dedup)
        self._fresh: dict[int, dict[str, _Body]] = defaultdict(dict)
        self.hits = self.dedups = 0
        self._unchecked_bytes = 0  # computed since the bound was last enforced
        self._evict_after = 0.0  # monotonic time the bound is enforced at the latest

    def identity(self, lease: ShardLease) -> ModelIdentity:
        if lease.model not in self._identities:
            self._identities[lease.model] = self._identity_of(lease.model)
        return self._identities[lease.model]

    def mode(self, job_id: int) -> str:
        if job_id not in self._modes:
            with self.sessions() as session:
                self._modes[job_id] = cache_store.job_mode(session, job_id=job_id)
        return self._modes[job_id]

    def plan(self, lease: ShardLease, pending: list[PendingRequest]) -> Plan:
        """Rows for the hits, the primaries to run, the duplicates that wait for a primary."""
        mode = self.mode(lease.job_id)
        identity = self.identity(lease)
        keys: dict[int, str | None] = {}
        for request in pending:
            key = None if mode == "off" else request_key(identity, request, scope=cache_scope(self.settings,
                                                                                              lease.owner))
            keys[request.request_id] = key
            self._keys[str(request.request_id)] = key
        found: dict[str, cache_store.CachedBody] = {}
        wanted = {key for key in keys.values() if key is not None}
        if mode != "off" and wanted:
            with self.sessions() as session:
                found = cache_store.lookup(session, keys=wanted)
            if mode == "refresh":  # computed again: only what this job itself computed already counts
                found = {key: body for key, body in found.items() if body.computed_in == lease.job_id}
        plan = Plan([], [], [])
        fresh = self._fresh.get(lease.job_id, {})
        for request in pending:
            key = keys[request.request_id]
            if key is not None and key in fresh:  # computed by this job here, maybe not written yet
                plan.served.append(self._row(fresh[key], request, identity, "dedup"))
                continue
            if key is not None and key in found:
                cached = found[key]
                source: ResultSource = "dedup" if cached.computed_in == lease.job_id else "hit"
                body = _Body(cached.row, BodyRef(key, cached.body, cached.computed_in))
                plan.served.append(self._row(body, request, identity, source))
                continue
            if key is not None and (lease.job_id, key) in self._primaries:
                self._primaries[(lease.job_id, key)].waiters.append((lease.shard_id, request))
                plan.waiting.append(request)
                continue
            if key is not None:
                primary = _Primary(str(request.request_id), lease.shard_id, lease.job_id,
                                   request.params.seed, [])
                self._primaries[(lease.job_id, key)] = primary
                self._by_engine_id[primary.engine_id] = (lease.job_id, key)
            plan.run.append(request)
        return plan

    def finished(self, lease: ShardLease, request: PendingRequest, row: SuccessRow
                 ) -> list[tuple[int, SuccessRow]]:
        """The computed row of `request`, with provenance, and copies for its waiters: (shard id, row)."""
        engine_id = str(request.request_id)
        key = self._keys.pop(engine_id, None)
        identity = self.identity(lease)
        if key is None:
            return [(lease.shard_id, self._uncached(row, request, identity, lease.job_id))]
        computed = body_of(row)
        body = _Body(computed, BodyRef(key, orjson.dumps(computed), lease.job_id))
        self._fresh[lease.job_id][key] = body
        self._unchecked_bytes += len(body.ref.body)
        out = [(lease.shard_id, self._row(body, request, identity, "miss"))]
        primary = self._pop_primary(engine_id)
        for shard_id, waiter in primary.waiters if primary is not None else []:
            self._keys.pop(str(waiter.request_id), None)
            out.append((shard_id, self._row(body, waiter, identity, "dedup")))
        return out

    def fresh_row(self, lease: ShardLease, row: ResultRow) -> ResultRow:
        """A row computed outside the cache (an embeddings line), with its provenance (an error row has none:
        the store records only its code and message)."""
        self._keys.pop(str(row["request_id"]), None)
        if "error" in row:
            return row
        return {**row, "provenance": self.identity(lease).provenance(seed=None, source="miss",
                                                                     computed_in=lease.job_id)}

    def failed(self, engine_id: str) -> list[tuple[int, PendingRequest]]:
        """`engine_id` errored or was aborted: its waiters must run themselves (no key: no more waiting)."""
        self._keys.pop(engine_id, None)
        primary = self._pop_primary(engine_id)
        if primary is None:
            return []
        for _, waiter in primary.waiters:
            self._keys[str(waiter.request_id)] = None
        return list(primary.waiters)

    def forget_shard(self, shard_id: int) -> list[tuple[int, PendingRequest]]:
        """The shard is no longer held: its primaries' waiters in other shards run themselves; its own
        waiters are dropped (the shard's pending rows run again wherever it is claimed next)."""
        orphans: list[tuple[int, PendingRequest]] = []
        for job_key, primary in list(self._primaries.items()):
            primary.waiters = [(s, r) for s, r in primary.waiters if s != shard_id]
            if primary.shard_id == shard_id:
                del self._primaries[job_key]
                self._by_engine_id.pop(primary.engine_id, None)
                orphans.extend(primary.waiters)
        for _, waiter in orphans:
            self._keys[str(waiter.request_id)] = None
        return orphans

    def discard(self, engine_id: str) -> None:
        """`engine_id` was aborted with its shard (forget_shard has seen to its twins)."""
        self._keys.pop(engine_id, None)

    def reset(self) -> None:
        """Every shard went back (hand_back): nothing planned survives."""
        self._primaries.clear()
        self._by_engine_id.clear()
        self._keys.clear()

    def written(self) -> None:
        """Rows were written (their bodies with them): forget the fresh bodies (the database serves them
        now) and, every EVICT_INTERVAL_S or hundredth of the bound computed, evict beyond the bound."""
        self._fresh.clear()
        bound = self.settings.result_cache_max_bytes
        if not self._unchecked_bytes or (time.monotonic() < self._evict_after
                                         and self._unchecked_bytes < bound / 100):
            return
        with self.sessions() as session:
            cache_store.evict(session, max_bytes=bound)
        self._unchecked_bytes, self._evict_after = 0, time.monotonic() + EVICT_INTERVAL_S

    def _pop_primary(self, engine_id: str) -> _Primary | None:
        job_key = self._by_engine_id.pop(engine_id, None)
        return None if job_key is None else self._primaries.pop(job_key, None)

    def _row(self, body: _Body, request: PendingRequest, identity: ModelIdentity,
             source: ResultSource) -> SuccessRow:
        """`request`'s row of a cacheable body; it carries the body to store by reference unless the body
        could never be kept (larger than the whole cache, or the cache is off: 0 bytes)."""
        if source == "hit":
            self.hits += 1
        elif source == "dedup":
            self.dedups += 1
        self._on_served(source)
        keep = 0 < len(body.ref.body) <= self.settings.result_cache_max_bytes
        return {**body.row, "request_id": request.request_id, "result_body": body.ref if keep else None,
                "provenance": identity.provenance(seed=request.params.seed, source=source,
                                                  computed_in=body.ref.computed_in)}

    def _uncached(self, row: SuccessRow, request: PendingRequest, identity: ModelIdentity,
                  job_id: int) -> SuccessRow:
        """A computed row no other request may share (not deterministic, or the job's cache is off)."""
        self._on_served("miss")
        return {**row, "provenance": identity.provenance(seed=request.params.seed, source="miss",
                                                         computed_in=job_id)}


def body_of(row: SuccessRow) -> RowBody:
    """A result row less what belongs to one request: what the cache stores and copies."""
    # cast: the checker cannot follow a comprehension over a TypedDict's keys; RowBody is SuccessRow less
    # exactly ROW_OWN_FIELDS (wire/result_row.py)
    return cast(RowBody, {name: value for name, value in row.items() if name not in ROW_OWN_FIELDS})
