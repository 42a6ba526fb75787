"""Engine errors that callers outside the engine tell apart (import-light: no torch).

RankFailedError: a rank of a parallel engine (tensor or pipeline parallel) died or stopped answering.
No request is to blame and the engine cannot run another step, so a worker hands its shards back and
exits instead of isolating a culprit request (workers/runner.py).
"""

from __future__ import annotations


class RankFailedError(RuntimeError):
    """A rank of a parallel engine died or stopped answering: the engine cannot run another step."""
