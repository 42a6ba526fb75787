"""GET /metrics: the process's Prometheus registry (engine metrics, API counters) plus job metrics read
from the database at scrape time (batchinfer.store.stats, cheap by construction).

A batch's model is tenant text, so the per-model gauges are bounded: a model is its own label only when
it is known (api.known_models: default, allow-list, served by a live worker), else "other". Without a
metrics_token the endpoint is open and those gauges are aggregated (model="all"): an anonymous scrape
learns no model names; with the token it must authenticate and gets them per known model.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchinfer.api.errors import APIError
from batchinfer.api.known_models import known_models, model_label
from batchinfer.config import Settings
from batchinfer.engine.metrics import PREFIX
from batchinfer.store.models import JobStatus, ShardStatus
from batchinfer.store.result_cache import cache_size
from batchinfer.store.serialize import jobs_at_risk
from batchinfer.store.stats import job_totals_by_status, open_shards_by_model

API_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Process-wide families in the default registry (prometheus_client forbids registering a name twice).
API_LATENCY = Histogram(f"{PREFIX}api_request_duration_seconds", "API request latency by route.",
                        ["route", "method", "status"], buckets=API_LATENCY_BUCKETS)
UPLOADED_BYTES = Counter(f"{PREFIX}api_uploaded_bytes", "Bytes of input files uploaded.")
INGESTED_REQUESTS = Counter(f"{PREFIX}api_ingested_requests",
                            "Request lines ingested by batches created over the API.")
EXPORTED_LINES = Counter(f"{PREFIX}api_exported_lines", "Result lines served by /v1/files/{id}/content.",
                         ["kind"])
EXPORTED_BYTES = Counter(f"{PREFIX}api_exported_bytes", "Result bytes served by /v1/files/{id}/content.",
                         ["kind"])

# Where the requests a job has not finished stand, by the job's status.
_UNFINISHED_REQUEST_STATUS: dict[str, str] = {
    JobStatus.VALIDATING: "pending",
    JobStatus.IN_PROGRESS: "pending",
    JobStatus.FINALIZING: "pending",
    JobStatus.CANCELLING: "pending",
    JobStatus.CANCELLED: "canceled",
    JobStatus.EXPIRED: "expired",
    JobStatus.FAILED: "errored",
    JobStatus.COMPLETED: "errored",
}


class JobsCollector(Collector):
    """Job, request and queue gauges computed from the database at scrape time."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings) -> None:
        self.session_factory = session_factory
        self.settings = settings
        self.per_model = bool(settings.metrics_token and settings.metrics_token.get_secret_value())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Run the scrape-time queries and yield the gauges."""
        jobs = GaugeMetricFamily(f"{PREFIX}jobs", "Jobs by status.", labels=["status"])
        requests = GaugeMetricFamily(f"{PREFIX}job_requests",
                                     "Requests of all jobs by status (job counters).", labels=["status"])
        queue = GaugeMetricFamily(f"{PREFIX}queue_depth", "Shards available to claim, by model.",
                                  labels=["model"])
        running = GaugeMetricFamily(f"{PREFIX}shards_running", "Shards leased by a worker, by model.",
                                    labels=["model"])
        cache_bytes = GaugeMetricFamily(f"{PREFIX}result_cache_bytes",
                                        "Bytes of result bodies the result cache holds (bodies "
                                        "batches reference are kept beyond result_cache_max_bytes).")
        cache_bodies = GaugeMetricFamily(f"{PREFIX}result_cache_bodies",
                                         "Result bodies the result cache holds.")
        at_risk = GaugeMetricFamily(f"{PREFIX}jobs_at_risk", "Running jobs whose predicted finish falls "
                                    "after their deadline (progress.at_risk).")
        with self.session_factory() as session:
            at_risk.add_metric([], jobs_at_risk(session))
            bodies, size = cache_size(session)
            by_status = job_totals_by_status(session)
            shards = open_shards_by_model(session)
            known = known_models(session, self.settings) if self.per_model else frozenset()
        request_totals = dict.fromkeys(("pending", "succeeded", "errored", "canceled", "expired"), 0)
        job_counts = dict.fromkeys((str(s) for s in JobStatus), 0)
        for row in by_status:
            job_counts[str(row.status)] = job_counts.get(str(row.status), 0) + row.jobs
            request_totals["succeeded"] += row.completed_requests
            request_totals["errored"] += row.failed_requests
            unfinished = row.total_requests - row.completed_requests - row.failed_requests
            bucket = _UNFINISHED_REQUEST_STATUS.get(row.status, "pending")
            request_totals[bucket] += max(unfinished, 0)
        for status, count in job_counts.items():
            jobs.add_metric([status], count)
        for status, count in request_totals.items():
            requests.add_metric([status], count)
        by_label: dict[tuple[bool, str], int] = {}  # known model names, or one bounded label
        for status, model, count in shards:
            key = (status == ShardStatus.AVAILABLE, model_label(model, known) if self.per_model else "all")
            by_label[key] = by_label.get(key, 0) + count
        for (available, label), count in by_label.items():
            (queue if available else running).add_metric([label], count)
        cache_bytes.add_metric([], size)
        cache_bodies.add_metric([], bodies)
        yield from (jobs, requests, queue, running, cache_bytes, cache_bodies, at_risk)


def jobs_registry(session_factory: sessionmaker[Session], settings: Settings) -> CollectorRegistry:
    """A registry holding one app's DB collector (kept apart from the process-wide default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobsCollector(session_factory, settings))
    return registry


router = APIRouter(tags=["operations"])


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """Prometheus exposition: process metrics, then job metrics from the database.

    With settings.metrics_token set, the scrape must send `Authorization: Bearer <metrics_token>` (401).
    """
    token = request.app.state.settings.metrics_token
    if token is not None and token.get_secret_value():
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(),
                                                                    token.get_secret_value().encode()):
            raise APIError(401, "/metrics needs 'Authorization: Bearer <metrics_token>' (the metrics_token "
                           "setting).", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    body = generate_latest(REGISTRY) + generate_latest(request.app.state.jobs_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


class LatencyMiddleware:
    """Observes every HTTP request's latency by route template (not raw path), method and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            elapsed = time.perf_counter() - start
            API_LATENCY.labels(path, scope.get("method", ""), str(status)).observe(elapsed)
