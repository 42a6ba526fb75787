"""`celery -A workers.celery_app worker|beat`: the process's Celery app, with batchinfer's tasks registered.

The app is built on first access to `app` (it reads Settings), never at import. The app's configuration
lives in workers.app, the task bodies in workers.tasks.
"""

from __future__ import annotations

from celery import Celery

from batchinfer.engine.native.threads import configure_openmp_env
from workers.app import get_app
from workers.tasks import register_tasks

# `celery -A workers.celery_app worker` starts here: the engine's OpenMP defaults before torch is imported.
configure_openmp_env()


def worker_app() -> Celery:
    """The process's Celery app with the task bodies registered: what a worker or beat runs."""
    return register_tasks(get_app())


def __getattr__(name: str) -> Celery:
    # `celery -A workers.celery_app` looks up `app`; build it only then.
    if name == "app":
        return worker_app()
    raise AttributeError(name)
