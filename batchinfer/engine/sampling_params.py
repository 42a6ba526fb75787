"""SamplingParams: per-request sampling settings with vLLM's field names and semantics.

Pure Python (no torch, imports nothing heavy): the ingest path builds one per request and stores it
with `to_dict`; the worker rebuilds it with `from_dict`. Construction is the only validation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20  # OpenAI's top_logprobs ceiling
GREEDY_TEMPERATURE_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


class SamplingParamsError(ValueError):
    """A sampling field holds a value it cannot take; str() is "field: message" (the engine's error style)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field  # the vLLM field name
        self.message = message  # the rule and the value given, without the field name


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions (vLLM names; see field comments for semantics).

    Frozen: built and validated once, then shared (ingest reuses one per distinct set of body fields).
    """

    n: int = 1  # completions per prompt; they share the prompt's KV blocks through the prefix cache
    presence_penalty: float = 0.0  # OpenAI: subtract once per token id present in the output so far
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output so far
    repetition_penalty: float = 1.0  # vLLM/CTRL: prompt+output tokens; positive /= p, negative *= p
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: smallest set whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) = all
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    seed: int | None = None  # per-request generator: same output whatever else is in the batch
    stop: str | list[str] | None = None  # stop strings (normalized to a list)
    stop_token_ids: list[int] | None = None  # token ids that end generation (normalized to a list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = until the context (max_model_len) is full
    min_tokens: int = 0  # EOS, stop token ids and stop strings are ignored before this many tokens
    logprobs: int | None = None  # None = none; N = the sampled token's logprob plus the top N
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _int_field("n", self.n, minimum=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float_field(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2]; got {value}")
        if _float_field("repetition_penalty", self.repetition_penalty) <= 0:
            raise SamplingParamsError("repetition_penalty", f"must be > 0; got {self.repetition_penalty}")
        if _float_field("temperature", self.temperature) < 0:
            raise SamplingParamsError("temperature", f"must be >= 0 (0 = greedy); got {self.temperature}")
        if not 0 < _float_field("top_p", self.top_p) <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1]; got {self.top_p}")
        _int_field("top_k", self.top_k, minimum=-1)
        if not 0 <= _float_field("min_p", self.min_p) <= 1:
            raise SamplingParamsError("min_p", f"must be in [0, 1]; got {self.min_p}")
        if self.seed is not None:
            _int_field("seed", self.seed, minimum=None)
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be true or false; got {getattr(self, name)!r}")
        if self.max_tokens is not None:
            _int_field("max_tokens", self.max_tokens, minimum=1)
        _int_field("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens",
                                      f"must be <= max_tokens ({self.max_tokens}); got {self.min_tokens}")
        if self.logprobs is not None:
            _int_field("logprobs", self.logprobs, minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise SamplingParamsError("logprobs", f"must be <= {MAX_LOGPROBS}; got {self.logprobs}")
        _normalize(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """The params `to_dict` stored, rebuilt without validating again (they were checked when first built).

        Also reads rows stored before to_dict existed: those hold the body's fields as given (a lone stop
        string, null lists, top_k -1), which construction's own normalization turns into the same object.
        """
        unknown = data.keys() - _DEFAULTS.keys()
        if unknown:
            raise TypeError(f"stored sampling params have unknown fields {sorted(unknown)}")
        params = object.__new__(cls)
        values = params.__dict__  # frozen only guards __setattr__; this is how dataclass init writes too
        values.update(_DEFAULTS)
        values.update(data)
        _normalize(values)
        return params

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults, by vLLM name: the JSON the requests table stores."""
        values = self.__dict__
        return {name: values[name] for name, default in _DEFAULTS.items() if values[name] != default}

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def seed_for_child(self, index: int) -> int | None:
        """The seed of completion `index` of an n>1 request: child 0 keeps `seed`, others derive from it."""
        if self.seed is None:
            return None
        if index == 0:
            return self.seed
        # A hash rather than seed+index, so request seed=1 child 1 is not request seed=2 child 0.
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _normalize(values: dict[str, Any]) -> None:
    """Canonical forms of already valid values, in place: stop lists always lists, top_k -1 (vLLM) is 0."""
    stop = values["stop"]
    values["stop"] = [stop] if isinstance(stop, str) else list(stop or ())
    values["stop_token_ids"] = list(values["stop_token_ids"] or ())
    if values["top_k"] == -1:
        values["top_k"] = 0


def _int_field(name: str, value: object, *, minimum: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(name, f"must be an integer; got {value!r}")
    if minimum is not None and value < minimum:
        raise SamplingParamsError(name, f"must be >= {minimum}; got {value}")
    return value


def _float_field(name: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise SamplingParamsError(name, f"must be a finite number; got {value!r}")
    return float(value)


def _check_stop(stop: object) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise SamplingParamsError("stop", f"must be a string or a list of strings; got {stop!r}")
    if any(s == "" for s in items):
        raise SamplingParamsError("stop", "stop strings must not be empty")


def _check_stop_token_ids(ids: object) -> None:
    if ids is None:
        return
    if not isinstance(ids, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise SamplingParamsError("stop_token_ids", f"must be a list of non-negative integers; got {ids!r}")


_DEFAULTS: dict[str, Any] = {field.name: field.default for field in fields(SamplingParams)}
_normalize(_DEFAULTS)
