"""What a file will cost before it is submitted (`batchinfer estimate`): tokens, output, seconds, and why.

- The file is read as ingest reads it (iter_lines, parse_line, the request budget): the same line errors.
- Prompt tokens come from the model's own tokenizer and chat template (the worker's prompt, exactly);
  `cached_prompt_tokens` are the tokens a prompt shares with another of the file, in whole KV blocks (what
  the prefix cache serves: the sum of adjacent common prefixes of the sorted prompts).
- `expected_output_tokens`: the caps (n x max_tokens, or the context left) scaled by the share of their
  caps that this deployment's finished requests of the model used; before any history, the caps.
- `expected_seconds`: decode steps at the pace this deployment's finished jobs of the model ran. A job of R
  requests on W live workers runs about R/W at once (at most max_num_seqs), so it needs about
  output / (W x concurrency) steps; a step's time is measured per finished job and grows with the square
  root of the concurrency (between a GPU's flat step time and a CPU's linear one: within 25% of either
  for a concurrency 1.5 times the measured one), plus the mean wait for idle polling workers to look
  (no broker). None before a finished job of the model.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import BinaryIO

import orjson
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from batchinfer.config import Settings
from batchinfer.store.db import end_transaction
from batchinfer.store.ingest import MAX_LISTED_ERRORS, IngestLimits, iter_lines
from batchinfer.store.models import Job, JobStatus, Request, RequestStatus, Shard, request_id_for, utcnow
from batchinfer.store.workers import list_workers
from batchinfer.wire.batch import Estimate  # the object is part of the Batch object: defined with it
from batchinfer.wire.input_line import parse_line
from batchinfer.wire.request import Endpoint, LineError, NormalizedRequest

HISTORY_JOBS = 20  # the most recent finished jobs of the model the rates come from
HISTORY_REQUESTS = 5000  # the most recent finished requests the output share comes from
STEP_TIME_EXPONENT = 0.5  # a decode step's time ~ concurrency ** this (see the module docstring)
POLL_MAX_BACKOFF_S = 5.0  # an idle broker-less worker's longest wait between polls (workers.process)

Tokenize = Callable[[NormalizedRequest], list[int]]
# (session, the file's requests) -> (requests the result cache would serve, or None; what that rests on):
# workers/result_cache_forecast.py, which keys them as the workers do.
CacheHits = Callable[[Session, list[NormalizedRequest]], tuple[int | None, str]]


@dataclass
class FileRead:
    """The valid requests of a file and its line errors, as ingest would record them."""

    requests: list[NormalizedRequest] = field(default_factory=list)
    invalid: int = 0
    errors: list[dict[str, str | int | None]] = field(default_factory=list)  # the first MAX_LISTED_ERRORS


@dataclass(frozen=True)
class History:
    """What this deployment's finished work of a model says: output share of the caps, and step pace."""

    output_share: float | None  # completion tokens / caps of finished requests; None: no history
    share_requests: int
    step_seconds: float | None  # seconds per decode step at concurrency 1 (scaled by STEP_TIME_EXPONENT)
    rate_jobs: int


def read_file(stream: BinaryIO, limits: IngestLimits) -> FileRead:
    """Read a JSONL stream as ingest does (same checks, same messages), without storing anything."""
    out = FileRead()
    for line_number, content, problem in iter_lines(stream, limits.max_line_bytes):
        try:
            if problem is not None:
                raise LineError(problem + ("; remove it" if problem == "blank" else ""),
                                code="blank_line" if problem == "blank" else "line_too_long")
            request = parse_line(content, line_number, max_metadata_bytes=limits.max_metadata_bytes,
                                 constraint_budget=limits.constraint_budget)
            if limits.budget is not None:
                limits.budget.check(request)
        except LineError as exc:
            out.invalid += 1
            if len(out.errors) < MAX_LISTED_ERRORS:
                out.errors.append({"code": exc.code, "message": f"line {line_number}: {exc.message}",
                                   "line": line_number, "param": exc.param})
            continue
        out.requests.append(request)
    return out


def cap_of(request: NormalizedRequest, prompt_len: int, context: int | None) -> int:
    """The most tokens a request may generate: n x max_tokens (or x the context its prompt leaves)."""
    if request.endpoint == Endpoint.EMBEDDINGS:
        return 0
    params = request.params
    limit = params.max_tokens if params.max_tokens is not None else max((context or 0) - prompt_len, 0)
    return params.n * limit


def shared_prefix_tokens(prompts: Iterable[list[int]], *, block_size: int) -> int:
    """Tokens the prefix cache serves: each prompt's longest common prefix with its neighbour in sorted
    order (the trie's shared tokens), in whole blocks."""
    ordered = sorted(tuple(prompt) for prompt in prompts)
    shared = 0
    for before, after in zip(ordered, ordered[1:], strict=False):
        common = 0
        for a, b in zip(before, after, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(after) - 1)  # the last token is always computed
        shared += common // block_size * block_size
    return shared


def model_history(session: Session, *, model: str, max_num_seqs: int) -> History:
    """The output share and step pace of this deployment's recent finished jobs of `model`."""
    jobs = session.scalars(select(Job).where(Job.model == model, Job.status == JobStatus.COMPLETED,
                                             Job.completion_tokens > 0)
                           .order_by(Job.id.desc()).limit(HISTORY_JOBS)).all()
    used = capped = counted = 0
    step_samples: list[float] = []
    for job in jobs:
        if counted < HISTORY_REQUESTS:
            rows = session.execute(
                select(Request.completion_tokens, Request.payload)
                .where(Request.id.between(request_id_for(job.id, 0), request_id_for(job.id + 1, 0) - 1),
                       Request.status == RequestStatus.SUCCEEDED)
                .limit(HISTORY_REQUESTS - counted)).all()
            for completion, payload in rows:
                params = orjson.loads(payload).get("params", {}) if payload else {}
                if params.get("max_tokens") is None:
                    continue  # its cap depended on the prompt: not a share of a known cap
                used += completion or 0
                capped += params["max_tokens"] * params.get("n", 1)
                counted += 1
        started, workers = session.execute(
            select(func.min(Shard.started_at), func.count(func.distinct(Shard.lease_owner)))
            .where(Shard.job_id == job.id)).one()
        if started is None or job.completed_at is None:
            continue
        seconds = (job.completed_at - started).total_seconds()
        per_worker = max(job.completed_requests, 1) / max(workers, 1)
        concurrency = min(per_worker, max_num_seqs)
        steps = job.completion_tokens / max(workers, 1) / concurrency
        if seconds > 0 and steps > 0:
            step_samples.append(seconds / steps / concurrency ** STEP_TIME_EXPONENT)
    end_transaction(session)
    share = used / capped if capped else None
    step = sorted(step_samples)[len(step_samples) // 2] if step_samples else None  # the median
    return History(output_share=share, share_requests=counted, step_seconds=step, rate_jobs=len(step_samples))


def live_workers_of(session: Session, *, model: str, now: datetime | None = None) -> tuple[int, float]:
    """Live workers serving `model` (or an adapter named so), and the seconds a job submitted now waits on
    average before idle polling workers look (0 when one is busy: it claims as soon as it has room)."""
    now = now or utcnow()
    serving = [worker for worker in list_workers(session, now=now)
               if worker.model == model or model in (worker.info or {}).get("lora_adapters", ())]
    if not serving or any(worker.shard_ids for worker in serving):
        return len(serving), 0.0
    # An idle worker's poll interval doubles from 0.2 s up to POLL_MAX_BACKOFF_S: after t idle seconds it
    # is about t (each wait is the sum of the earlier ones), so a job arriving now waits half of that.
    waits = []
    for worker in serving:
        idle_since = max(worker.started_at.timestamp(), float((worker.info or {}).get("generated_at") or 0))
        waits.append(min(POLL_MAX_BACKOFF_S, max(now.timestamp() - idle_since, 0.2)) / 2)
    return len(serving), min(waits)


def expected_run(session: Session, *, model: str, requests: int, max_output: int, max_num_seqs: int,
                 polling: bool, basis: list[str]) -> tuple[int, float | None, int]:
    """(expected output tokens, expected seconds, live workers) of `requests` whose caps add up to
    `max_output`, from this deployment's history and live workers; appends what they rest on to `basis`."""
    history = model_history(session, model=model, max_num_seqs=max_num_seqs)
    workers, poll_wait = live_workers_of(session, model=model)
    if history.output_share is None:
        expected_output = max_output
        basis.append(f"assumption: no finished request of {model} with max_tokens yet, so every request is "
                     "taken to use its whole max_tokens (an upper bound)")
    else:
        expected_output = round(max_output * min(history.output_share, 1.0))
        basis.append(f"output: finished requests of {model} used {history.output_share:.0%} of their "
                     f"max_tokens ({history.share_requests} requests)")
    seconds = None
    if history.step_seconds is None:
        basis.append(f"seconds: unknown until a job of {model} has finished on this deployment")
    elif workers == 0:
        basis.append(f"seconds: unknown, no live worker serves {model} now")
    elif requests:
        concurrency = min(requests / workers, max_num_seqs)
        steps = expected_output / workers / max(concurrency, 1)
        seconds = steps * history.step_seconds * max(concurrency, 1) ** STEP_TIME_EXPONENT
        basis.append(f"seconds: decode steps at the pace of {history.rate_jobs} finished job(s) of {model}, "
                     f"{requests} requests over {workers} live worker(s)")
        if polling and poll_wait:
            seconds += poll_wait
            basis.append(f"seconds: + {poll_wait:.1f} s until an idle polling worker looks for work")
        seconds = round(seconds, 1)
    return expected_output, seconds, workers


def estimate(session: Session, *, model: str, read: FileRead, tokenize: Tokenize, context: int | None,
             block_size: int, max_num_seqs: int, polling: bool = False,
             cache_hits: CacheHits | None = None) -> Estimate:
    """The estimate of a read file on `model` with this deployment's history and live workers."""
    prompts = [tokenize(request) for request in read.requests]
    caps = [cap_of(request, len(prompt), context)
            for request, prompt in zip(read.requests, prompts, strict=True)]
    basis = [f"prompt tokens: {model}'s tokenizer and chat template; cached: prompts' shared prefixes "
             f"in whole {block_size}-token KV blocks"]
    max_output = sum(caps)
    expected_output, seconds, workers = expected_run(
        session, model=model, requests=len(read.requests), max_output=max_output, max_num_seqs=max_num_seqs,
        polling=polling, basis=basis)
    hits = None
    if cache_hits is not None:
        hits, why = cache_hits(session, read.requests)
        basis.append(why)
    return Estimate(model=model, requests=len(read.requests), invalid_lines=read.invalid,
                    prompt_tokens=sum(map(len, prompts)),
                    cached_prompt_tokens=shared_prefix_tokens(prompts, block_size=block_size),
                    max_output_tokens=max_output, expected_output_tokens=expected_output,
                    expected_seconds=seconds, live_workers=workers, basis=basis, errors=read.errors,
                    result_cache_hits=hits)


def from_counts(session: Session, *, model: str, requests: int, invalid: int, max_output: int, uncapped: int,
                settings: Settings) -> Estimate:
    """The estimate made at submit from what ingest counted (requests, the sum of their caps), without
    tokenizing the file again: prompt tokens are not counted, and requests without max_tokens (whose cap is
    the context their prompt leaves) are left out of the output figures, as the basis says."""
    basis = ["made at submit from ingest's counts: prompt tokens not counted (`batchinfer estimate FILE` "
             "tokenizes the file)"]
    if uncapped:
        basis.append(f"output: {uncapped} request(s) without max_tokens left out (their cap is the context "
                     "their prompt leaves)")
    expected_output, seconds, workers = expected_run(
        session, model=model, requests=requests, max_output=max_output, max_num_seqs=settings.max_num_seqs,
        polling=not settings.broker_url, basis=basis)
    return Estimate(model=model, requests=requests, invalid_lines=invalid, prompt_tokens=None,
                    cached_prompt_tokens=None, max_output_tokens=max_output,
                    expected_output_tokens=expected_output, expected_seconds=seconds, live_workers=workers,
                    basis=basis)


@functools.lru_cache(maxsize=4)
def model_tokenizer(model: str) -> tuple[Tokenize, int | None]:
    """The worker's prompt of a request as token ids (its tokenizer and chat template, as workers/runner.py
    builds it) and the model's context length; loads no weights. ValueError/OSError for an unknown model."""
    from batchinfer.engine.model_files import load_hf_config, resolve_model_path
    from batchinfer.engine.models.loader import load_tokenizer

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    context = getattr(load_hf_config(path), "max_position_embeddings", None)

    def tokenize(request: NormalizedRequest) -> list[int]:
        if request.messages is not None:
            options = request.options or {}
            text = tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=options.get("add_generation_prompt", True),
                tokenize=False, **options.get("chat_template_kwargs", {}))
            return list(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(request.prompt, str):
            return list(tokenizer.encode(request.prompt, add_special_tokens=True))
        return list(request.prompt or [])  # token ids as given; embeddings inputs are not counted

    return tokenize, context


def estimate_file(session: Session, *, path: str | os.PathLike[str], model: str, settings: Settings,
                  cache_hits: CacheHits | None = None) -> Estimate:
    """`batchinfer estimate` / POST /v1/batches/estimate: read, tokenize and estimate the file at `path`."""
    tokenize, context = model_tokenizer(model)
    with open(path, "rb") as stream:
        read = read_file(stream, IngestLimits.from_settings(settings, model))
    return estimate(session, model=model, read=read, tokenize=tokenize, context=context,
                    block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                    polling=not settings.broker_url, cache_hits=cache_hits)


def describe(value: object) -> str:
    """A figure for the text output."""
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "unknown" if value is None else str(value)

