"""SamplingParams: per-request sampling settings with vLLM's field names and semantics.

Pure Python (no torch, imports nothing heavy): the ingest path builds one per request and stores it
with `to_dict`; the worker rebuilds it with `from_dict`. Construction is the only validation.

An output constraint (structured output: JSON Schema, JSON object, regex, choice, grammar) is a
StructuredOutputsParams in `structured_outputs`; constructing one parses the constraint into a grammar
(grammars.py, which imports xgrammar only then), so a bad schema fails where the request is built.
"""

from __future__ import annotations

import hashlib
import json as _json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from batchinfer.engine.sampling.grammars import (
    CONSTRAINT_KINDS,
    ConstraintValue,
    GrammarError,
    canonical_text,
    check_constraint,
)
from batchinfer.wire.json_types import JSONObject

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
    # vLLM: per prompt token (the first gets None), its logprob plus the top N, from the raw logits; the
    # prompt is then computed in full (no prefix-cache hit) so that every position's logits exist.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as vLLM: only slow (Python) tokenizers decode differently
    # Logits controls (vLLM; sampler.py skips them when no row of the step asks):
    bad_words: list[str] | None = None  # words never generated (vLLM: with and without a leading space)
    allowed_token_ids: list[int] | None = None  # only these token ids may be sampled
    logit_bias: dict[int, float] | None = None  # OpenAI: token id -> bias in [-100, 100] added to the logit
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # The output must match this constraint; ends with "stop" at the grammar's end (a dict of its fields
    # is accepted too). Not with ignore_eos or min_tokens: the grammar alone decides where output ends.
    structured_outputs: StructuredOutputsParams | None = None
    # False opts this request out of speculative decoding (engine speculative_config); output is the same
    # either way (speculation is exact), only its speed differs.
    speculative_decoding: bool = True

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
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be true or false; got {getattr(self, name)!r}")
        if self.max_tokens is not None:
            _int_field("max_tokens", self.max_tokens, minimum=1)
        _int_field("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens",
                                      f"must be <= max_tokens ({self.max_tokens}); got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_field(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise SamplingParamsError(name, f"must be <= {MAX_LOGPROBS}; got {value}")
        _check_logits_controls(self)
        if self.structured_outputs is not None:
            self.__dict__["structured_outputs"] = _check_structured_outputs(self)
        _normalize(self.__dict__)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SamplingParams:
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

    def to_dict(self) -> JSONObject:
        """The fields that differ from the defaults, by vLLM name: the JSON the requests table stores."""
        values = self.__dict__
        out: JSONObject = {
            name: values[name] for name, default in _DEFAULTS.items() if values[name] != default
        }
        if "structured_outputs" in out:
            out["structured_outputs"] = values["structured_outputs"].to_dict()
        if "logit_bias" in out:  # JSON object keys are strings; _normalize reads them back as ints
            out["logit_bias"] = {str(token_id): bias for token_id, bias in values["logit_bias"].items()}
        return out

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_logits_controls(self) -> bool:
        """True when bad_words, allowed_token_ids or logit_bias change the logits."""
        return bool(self.bad_words or self.allowed_token_ids is not None or self.logit_bias)

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


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams): exactly one of json, regex, choice, grammar
    and json_object. Construction checks it, parsing it into a grammar; a bad one raises SamplingParamsError
    naming the field (`json`, `regex`, ...) and, for a schema, the JSON pointer of the problem.
    """

    json: JSONObject | None = None  # a JSON Schema object (a JSON text of one is parsed)
    regex: str | None = None  # xgrammar's dialect: no lookaround, no backreferences, no named groups
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF) text with a `root` rule
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    disable_any_whitespace: bool = False  # JSON kinds: no free whitespace between tokens (vLLM's flag)

    def __post_init__(self) -> None:
        given = [kind for kind in CONSTRAINT_KINDS if _is_set(self.__dict__[kind])]
        if len(given) != 1:
            names = ", ".join(CONSTRAINT_KINDS)
            raise SamplingParamsError(given[1] if given else "json",
                                      f"give exactly one of {names}; got {', '.join(given) or 'none'}")
        kind = given[0]
        self.__dict__[kind] = value = _constraint_value(kind, self.__dict__[kind])
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError("disable_any_whitespace",
                                      f"must be true or false; got {self.disable_any_whitespace!r}")
        try:
            check_constraint(kind, value, any_whitespace=not self.disable_any_whitespace)
        except GrammarError as exc:
            raise SamplingParamsError(kind, str(exc)) from None

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(kind for kind in CONSTRAINT_KINDS if _is_set(self.__dict__[kind]))

    @property
    def value(self) -> ConstraintValue:
        """The constraint: the schema, the regex, the choices, the grammar text (True for json_object)."""
        return self.__dict__[self.kind]

    @cached_property
    def cache_key(self) -> str:
        """A hash naming the compiled grammar: equal constraints share one compilation."""
        kind = self.kind
        text = f"{kind}\0{self.disable_any_whitespace}\0{canonical_text(kind, self.value)}"
        return hashlib.sha256(text.encode()).hexdigest()

    def to_dict(self) -> JSONObject:
        """The fields that are set: what the requests table stores inside the sampling params."""
        values = self.__dict__  # each field a JSON value: a schema object, a text, strings or a flag
        return {name: values[name] for name in _STRUCTURED_DEFAULTS if _is_set(values[name])}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> StructuredOutputsParams:
        """What `to_dict` stored, rebuilt without checking again (it was checked when first built)."""
        params = object.__new__(cls)
        params.__dict__.update(_STRUCTURED_DEFAULTS)
        params.__dict__.update(data)
        return params


def _is_set(value: object) -> bool:
    """A constraint field counts as given unless None or False (identity: 0 or {} are given, and wrong)."""
    return value is not None and value is not False


def _constraint_value(kind: str, value: object) -> ConstraintValue:
    """The constraint's canonical value after the shape checks: a schema text is parsed to its object."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as exc:
                raise SamplingParamsError("json", f"is not valid JSON text ({exc})") from None
        if not isinstance(value, dict):
            raise SamplingParamsError("json", f"must be a JSON Schema object; got {type(value).__name__}")
        return value
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise SamplingParamsError(kind, f"must be a non-empty string; got {value!r:.80}")
        return value
    if kind == "choice":
        if not isinstance(value, list | tuple) or not value or not all(isinstance(c, str) for c in value):
            raise SamplingParamsError("choice", f"must be a non-empty list of strings; got {value!r:.80}")
        return list(value)
    if value is not True:
        raise SamplingParamsError("json_object", f"must be true or false; got {value!r}")
    return True


def _check_structured_outputs(params: SamplingParams) -> StructuredOutputsParams:
    """The request's constraint as a StructuredOutputsParams, checked together with the other fields."""
    constraint = params.structured_outputs
    if isinstance(constraint, Mapping):
        unknown = sorted(constraint.keys() - _STRUCTURED_DEFAULTS.keys())
        if unknown:
            raise SamplingParamsError(f"structured_outputs.{unknown[0]}",
                                      f"unknown field; use {', '.join(_STRUCTURED_DEFAULTS)}")
        try:
            constraint = StructuredOutputsParams(**constraint)
        except SamplingParamsError as exc:
            raise SamplingParamsError(f"structured_outputs.{exc.field}", exc.message) from None
    elif not isinstance(constraint, StructuredOutputsParams):
        raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams or an object of "
                                  f"its fields; got {type(constraint).__name__}")
    if params.ignore_eos:
        raise SamplingParamsError("ignore_eos", "cannot be combined with a structured output constraint: "
                                  "the grammar's end finishes the output; remove ignore_eos")
    if params.min_tokens:
        raise SamplingParamsError("min_tokens", "cannot be combined with a structured output constraint: "
                                  "the grammar decides where the output ends; remove min_tokens")
    return constraint


def _normalize(values: dict[str, Any]) -> None:
    """Canonical forms of already valid values, in place: stop lists always lists, top_k -1 (vLLM) is 0,
    a stored constraint (a dict) its StructuredOutputsParams."""
    stop = values["stop"]
    values["stop"] = [stop] if isinstance(stop, str) else list(stop or ())
    values["stop_token_ids"] = list(values["stop_token_ids"] or ())
    if values["top_k"] == -1:
        values["top_k"] = 0
    if isinstance(values["structured_outputs"], Mapping):
        values["structured_outputs"] = StructuredOutputsParams.from_dict(values["structured_outputs"])
    if values["logit_bias"]:
        values["logit_bias"] = {int(token_id): float(bias) for token_id, bias in values["logit_bias"].items()}
    if values["bad_words"] is not None:
        values["bad_words"] = list(values["bad_words"])
    if values["allowed_token_ids"] is not None:
        values["allowed_token_ids"] = list(values["allowed_token_ids"])


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


def _check_logits_controls(params: SamplingParams) -> None:
    """bad_words, allowed_token_ids, logit_bias and truncate_prompt_tokens (vLLM / OpenAI rules)."""
    words = params.bad_words
    if words is not None and (not isinstance(words, list | tuple)
                              or not all(isinstance(w, str) and w.strip() for w in words)):
        raise SamplingParamsError("bad_words", f"must be a list of non-empty strings; got {words!r:.80}")
    allowed = params.allowed_token_ids
    if allowed is not None and (not isinstance(allowed, list | tuple) or not allowed or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in allowed)):
        raise SamplingParamsError("allowed_token_ids",
                                  f"must be a non-empty list of non-negative integers; got {allowed!r:.80}")
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise SamplingParamsError("logit_bias",
                                      f"must be an object of token id -> bias; got {bias!r:.80}")
        for token_id, value in bias.items():
            if not (isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0
                    or isinstance(token_id, str) and token_id.isdecimal()):
                raise SamplingParamsError("logit_bias",
                                          f"keys must be token ids (\"50256\"); got {token_id!r}")
            number = _float_field(f"logit_bias[{token_id!r}]", value)
            if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias[{token_id!r}]",
                                          f"must be in [-100, 100]; got {value}")
    if params.truncate_prompt_tokens is not None:
        _int_field("truncate_prompt_tokens", params.truncate_prompt_tokens, minimum=1)


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


_DEFAULTS: dict[str, object] = {field.name: field.default for field in fields(SamplingParams)}
_normalize(_DEFAULTS)
_STRUCTURED_DEFAULTS: dict[str, object] = {
    field.name: field.default for field in fields(StructuredOutputsParams)
}
