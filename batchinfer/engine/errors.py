"""Engine errors that callers outside the engine tell apart (import-light: no torch).

RankFailedError: a rank of a parallel engine (tensor or pipeline parallel) died or stopped answering.
No request is to blame and the engine cannot run another step, so a worker hands its shards back and
exits instead of isolating a culprit request (workers/runner.py).

ModelNotFoundError and DeviceUnavailableError: what the user typed names no model here, or a device this
process lacks; the CLI prints them as one line (exit 1) before any job is created.
"""

from __future__ import annotations


class RankFailedError(RuntimeError):
    """A rank of a parallel engine died or stopped answering: the engine cannot run another step."""


class ModelNotFoundError(FileNotFoundError):
    """The model name is neither a local model, a known alias, nor in the local Hugging Face cache."""


class DeviceUnavailableError(ValueError):
    """The device asked for is not in this process: a CUDA device with a CPU build of torch, or no GPU."""
