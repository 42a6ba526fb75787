"""Output constraints as xgrammar grammars: the one place a constraint's kind becomes a grammar, and the
checks a constraint passes before any request carrying it is accepted.

A constraint is (kind, value): "json" (a JSON Schema object), "json_object" (any JSON object), "regex",
"choice" (a list of strings) or "grammar" (EBNF / GBNF text, root rule `root`). `check_constraint` is what
ingest runs (through SamplingParams): it parses the constraint into an xgrammar Grammar, which needs no
tokenizer, so a bad schema, regex or grammar is a line's error instead of a worker's. The engine's backend
(structured.py) compiles the same `build_grammar` result against its tokenizer.

JSON Schema: which keywords a schema may use, and the one rewrite xgrammar needs, are
json_schema_support.py's.

Budget (`GrammarBudget`, README "Security"): a constraint is measured before xgrammar sees it, its text
against `max_constraint_bytes` and its nesting against `max_constraint_depth` (xgrammar's schema
conversion is superlinear in depth: 250 nested arrays cost ~1 s), and its conversion runs on a helper
thread for at most `grammar_compile_timeout_seconds`. A constraint beyond any of them is the line's error,
naming the limit and its setting. The ingest's budget is a context variable (`using_budget`): the check
runs inside SamplingParams' construction, which takes no settings.

Import-light: xgrammar (which imports torch) is imported only when a constraint is checked or built.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

from cachetools import LRUCache

from batchinfer.engine.sampling.json_schema_support import schema_problem, xgrammar_schema
from batchinfer.wire.json_types import JSONObject

if TYPE_CHECKING:
    from xgrammar import Grammar

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Whitespace characters allowed between two JSON tokens when whitespace is free: room for indentation
# 10 levels deep, none for a model stuck emitting newlines (SmolLM2 does, after "[").
MAX_WHITESPACE_RUN = 40
JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's json_object mode: any JSON object

_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[08:33:58] /project/cpp/x.cc:94: "


# A checked constraint's value, by kind: json a schema object, regex / grammar a text, choice the strings,
# json_object True (StructuredOutputsParams.value).
ConstraintValue: TypeAlias = JSONObject | str | list[str] | bool


class GrammarError(ValueError):
    """A constraint that cannot become a grammar; str() says what is wrong and where, for the user."""


_Result = TypeVar("_Result")


class GrammarSettings(Protocol):
    """The part of batchinfer's Settings a GrammarBudget reads (the engine does not import them)."""

    @property
    def max_constraint_depth(self) -> int: ...
    @property
    def max_constraint_bytes(self) -> int: ...
    @property
    def grammar_compile_timeout_seconds(self) -> float: ...


@dataclass(frozen=True)
class GrammarBudget:
    """The work one constraint may cost (module docstring); the defaults are the settings' defaults."""

    max_depth: int = 64  # max_constraint_depth: JSON nesting of a schema, bracket nesting of a regex/grammar
    max_bytes: int = 1 << 20  # max_constraint_bytes: the constraint's text (a schema as compact JSON)
    timeout_s: float = 30.0  # grammar_compile_timeout_seconds: conversion at ingest, compilation in workers

    @classmethod
    def from_settings(cls, settings: GrammarSettings) -> GrammarBudget:
        """The budget batchinfer's Settings configure (duck-typed: the engine does not import them)."""
        return cls(settings.max_constraint_depth, settings.max_constraint_bytes,
                   settings.grammar_compile_timeout_seconds)


DEFAULT_GRAMMAR_BUDGET = GrammarBudget()
_BUDGET: ContextVar[GrammarBudget] = ContextVar("grammar_budget", default=DEFAULT_GRAMMAR_BUDGET)


@contextlib.contextmanager
def using_budget(budget: GrammarBudget) -> Iterator[None]:
    """Check the constraints built inside the block against `budget` (this thread / task only)."""
    token = _BUDGET.set(budget)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def check_constraint(kind: str, value: ConstraintValue, *, any_whitespace: bool = True) -> None:
    """Raise GrammarError unless `value` is a usable constraint of `kind` (shape already checked), within
    the current budget (`using_budget`)."""
    budget = _BUDGET.get()
    if kind == "json" and json_depth(value, budget.max_depth) > budget.max_depth:  # before any recursion
        raise _too_deep(kind, budget)
    text = canonical_text(kind, value)
    check_size(kind, text, budget)
    if kind == "json":
        problem = schema_problem(value)
        if problem is not None:
            raise GrammarError(problem)
    _timed_check(kind, text, any_whitespace, budget)


def check_size(kind: str, text: str, budget: GrammarBudget) -> None:
    """Raise GrammarError when the constraint's text, or a regex's / grammar's nesting, exceeds the budget."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > budget.max_bytes:
        raise GrammarError(f"the {kind} constraint is {size} bytes; at most {budget.max_bytes} are allowed "
                           "(max_constraint_bytes); shorten it")
    if kind in ("regex", "grammar") and bracket_depth(text, quoted=kind == "grammar") > budget.max_depth:
        raise _too_deep(kind, budget)


def _too_deep(kind: str, budget: GrammarBudget) -> GrammarError:
    return GrammarError(f"the {kind} constraint nests more than {budget.max_depth} levels deep "
                        "(max_constraint_depth); flatten it, or use $defs and $ref for repeated parts")


def json_depth(value: object, limit: int) -> int:
    """The nesting depth of a JSON value (objects and arrays), counted up to limit + 1 (iteratively)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def bracket_depth(text: str, *, quoted: bool) -> int:
    """The deepest nesting of (), [] and {} in a regex or grammar (escapes, and grammar strings, skipped)."""
    depth = deepest = 0
    escaped = in_string = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quoted and char == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def build_grammar(kind: str, value: ConstraintValue, *, any_whitespace: bool = True) -> Grammar:
    """The xgrammar Grammar of a constraint; raises GrammarError with xgrammar's reason, cleaned up."""
    import xgrammar as xgr

    try:
        if kind == "json" or kind == "json_object":
            schema = JSON_OBJECT_SCHEMA if kind == "json_object" else xgrammar_schema(value)
            run = MAX_WHITESPACE_RUN if any_whitespace else None
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace,
                                                max_whitespace_cnt=run)
        if kind == "regex":
            return xgr.Grammar.from_regex(_text(kind, value))
        if kind == "choice":
            if not isinstance(value, list):
                raise GrammarError(f"the choice constraint must be a list; got {type(value).__name__}")
            return xgr.Grammar.from_ebnf(choice_ebnf(value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(_text(kind, value))
    except RuntimeError as exc:
        raise GrammarError(_clean(exc)) from None
    except UnicodeDecodeError:
        # xgrammar cuts its error text at a byte count, which can split a UTF-8 character of the grammar.
        raise GrammarError(f"the {kind} constraint does not parse (xgrammar rejected it)") from None
    raise GrammarError(f"unknown constraint kind {kind!r}; use one of {', '.join(CONSTRAINT_KINDS)}")


def _text(kind: str, value: ConstraintValue) -> str:
    """A regex's or grammar's text (checked at construction: a str)."""
    if not isinstance(value, str):
        raise GrammarError(f"the {kind} constraint must be a string; got {type(value).__name__}")
    return value


def canonical_text(kind: str, value: ConstraintValue) -> str:
    """The constraint as one text: what its cache key hashes (JSON keeps the schema's key order)."""
    if kind in ("json", "choice"):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if kind == "json_object" or not isinstance(value, str):
        return ""
    return value


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF escapes too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# Verdicts of checked constraints by digest: "" (usable) or the error. Keyed by a hash, so an entry costs
# its error text, not the constraint's (a 750 KB choice list is 32 bytes here); bounded in bytes.
CHECK_CACHE_BYTES = 4 << 20
# Below this size a constraint (within the depth budget) converts in milliseconds: checked inline, no
# helper thread (a file of distinct small constraints must not pay a thread start per line).
INLINE_CHECK_BYTES = 16 << 10
_CHECKED: LRUCache[bytes, str] = LRUCache(maxsize=CHECK_CACHE_BYTES, getsizeof=lambda error: 160 + len(error))
_CHECKED_LOCK = threading.Lock()


def _timed_check(kind: str, text: str, any_whitespace: bool, budget: GrammarBudget) -> None:
    """Parse the constraint once per distinct text; a large one on a helper thread, for at most
    budget.timeout_s (a timeout is not remembered: another budget may allow it)."""
    key = hashlib.sha256(f"{kind}\0{any_whitespace}\0{text}".encode("utf-8", "surrogatepass")).digest()
    with _CHECKED_LOCK:
        verdict = _CHECKED.get(key)
    if verdict is None:
        if len(text) <= INLINE_CHECK_BYTES:
            verdict = _convert(kind, text, any_whitespace)
        else:
            verdict = _within(budget.timeout_s, _convert, kind, text, any_whitespace)
            if verdict is None:
                raise GrammarError(f"converting the {kind} constraint took longer than "
                                   f"{budget.timeout_s:g} s (grammar_compile_timeout_seconds); simplify it")
        with _CHECKED_LOCK:
            _CHECKED[key] = verdict
    if verdict:
        raise GrammarError(verdict)


def _convert(kind: str, text: str, any_whitespace: bool) -> str:
    """"" when the constraint becomes a grammar, else why not."""
    try:
        build_grammar(kind, json.loads(text) if kind in ("json", "choice") else text,
                      any_whitespace=any_whitespace)
    except GrammarError as exc:
        return str(exc)
    return ""


def _within(timeout_s: float, function: Callable[..., _Result], *args: object) -> _Result | None:
    """function(*args) on a daemon thread, or None when it takes longer than timeout_s. xgrammar releases
    the GIL while it converts; a conversion past its time finishes alone (bounded by the size budget)."""
    done: Future[_Result] = Future()

    def run() -> None:
        try:
            done.set_result(function(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            done.set_exception(exc)

    threading.Thread(target=run, name="batchinfer-grammar-check", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except FutureTimeout:
        return None


def _clean(exc: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location, first line only."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return _XGRAMMAR_LOCATION.sub("", lines[0]).strip()
