"""Output constraints as xgrammar grammars: the one place a constraint's kind becomes a grammar, and the
checks a constraint passes before any request carrying it is accepted.

A constraint is (kind, value): "json" (a JSON Schema object), "json_object" (any JSON object), "regex",
"choice" (a list of strings) or "grammar" (EBNF / GBNF text, root rule `root`). `check_constraint` is what
ingest runs (through SamplingParams): it parses the constraint into an xgrammar Grammar, which needs no
tokenizer, so a bad schema, regex or grammar is a line's error instead of a worker's. The engine's backend
(structured.py) compiles the same `build_grammar` result against its tokenizer.

JSON Schema: xgrammar enforces most of the standard but silently ignores a few keywords; a schema using
one of them would be accepted and then produce output that fails validation, so those are refused here
(`UNSUPPORTED_KEYWORDS`), as are unknown keywords (usually a typo: "minimun"). Annotations pass.
One rewrite: xgrammar's rule for a string with minLength / maxLength lets raw control characters (a tab,
\x1a) into the string, which is not JSON; `xgrammar_schema` states those lengths as the equivalent
pattern `^.{min,max}$`, whose JSON-string rule keeps them out.

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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

from cachetools import LRUCache

from batchinfer.wire.json_types import JSONObject

if TYPE_CHECKING:
    from xgrammar import Grammar

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# Whitespace characters allowed between two JSON tokens when whitespace is free: room for indentation
# 10 levels deep, none for a model stuck emitting newlines (SmolLM2 does, after "[").
MAX_WHITESPACE_RUN = 40
JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's json_object mode: any JSON object

# Keywords xgrammar enforces (checked against its matcher, see tests/engine/test_structured_grammars.py).
SUPPORTED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "minLength", "maxLength", "pattern", "format", "contentEncoding",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "items", "prefixItems", "minItems", "maxItems", "uniqueItems", "unevaluatedItems",
    "properties", "required", "additionalProperties", "minProperties", "maxProperties", "propertyNames",
    "unevaluatedProperties",
})  # fmt: skip
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
    "deprecated", "readOnly", "writeOnly", "contentMediaType",
})  # fmt: skip
# Valid JSON Schema that the grammar cannot enforce: keyword -> what to do instead.
UNSUPPORTED_KEYWORDS = {
    "not": "remove it, or list the allowed values with enum / anyOf",
    "if": "remove if/then/else; use anyOf of the alternatives",
    "then": "remove if/then/else; use anyOf of the alternatives",
    "else": "remove if/then/else; use anyOf of the alternatives",
    "contains": "remove it; describe every item with items",
    "minContains": "remove it; describe every item with items",
    "maxContains": "remove it; describe every item with items",
    "patternProperties": "remove it; name the keys in properties",
    "dependentRequired": "remove it; list the keys in required",
    "dependentSchemas": "remove it",
    "dependencies": "remove it; list the keys in required",
    "additionalItems": "use prefixItems and items (JSON Schema 2020-12)",
    "nullable": "use \"type\": [\"<type>\", \"null\"] (nullable is OpenAPI, not JSON Schema)",
    "$dynamicRef": "use $ref",
    "$dynamicAnchor": "use $defs and $ref",
    "$recursiveRef": "use $ref",
}
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_MAP_KEYWORDS = ("properties", "$defs", "definitions")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYWORDS = ("items", "additionalProperties", "propertyNames", "unevaluatedItems",
                    "unevaluatedProperties")
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


def xgrammar_schema(schema: object) -> object:
    """The schema with string lengths written as patterns (see the module docstring); a copy."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for keyword in _SCHEMA_MAP_KEYWORDS:
        if isinstance(out.get(keyword), dict):
            out[keyword] = {name: xgrammar_schema(sub) for name, sub in out[keyword].items()}
    for keyword in _SCHEMA_LIST_KEYWORDS:
        if isinstance(out.get(keyword), list):
            out[keyword] = [xgrammar_schema(sub) for sub in out[keyword]]
    for keyword in _SCHEMA_KEYWORDS:
        if keyword in out:
            out[keyword] = xgrammar_schema(out[keyword])
    if ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


def schema_problem(schema: object, path: str = "#") -> str | None:
    """What makes a JSON Schema unusable as a constraint (first found, with its JSON pointer), or None."""
    if isinstance(schema, bool):  # true: anything; false: nothing (as items or additionalProperties: none)
        return None
    if not isinstance(schema, dict):
        return f"{path} must be a schema object, got {type(schema).__name__}"
    for keyword, value in schema.items():
        where = f"{path}/{keyword}"
        if keyword in UNSUPPORTED_KEYWORDS:
            return (f"unsupported keyword {keyword!r} at {path}: the grammar cannot enforce it; "
                    f"{UNSUPPORTED_KEYWORDS[keyword]}")
        if keyword not in SUPPORTED_KEYWORDS and keyword not in ANNOTATION_KEYWORDS:
            return f"unknown keyword {keyword!r} at {path} (check the spelling)"
        if keyword in _COUNT_KEYWORDS and not (isinstance(value, int) and not isinstance(value, bool)
                                               and value >= 0):
            return f"{where} must be a non-negative integer, got {value!r}"
        if keyword in _SCHEMA_LIST_KEYWORDS and (not isinstance(value, list) or not value):
            return f"{where} must be a non-empty array of schemas"
        if keyword == "type" and not (value in JSON_TYPES or (
                isinstance(value, list) and value and all(t in JSON_TYPES for t in value))):
            return f"{where} must be one of {', '.join(JSON_TYPES)} (or a list of them), got {value!r}"
    problem = _keyword_rules(schema, path)
    if problem is not None:
        return problem
    for keyword in _SCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                problem = schema_problem(sub, f"{path}/{keyword}/{name}")
                if problem is not None:
                    return problem
    for keyword in _SCHEMA_LIST_KEYWORDS:
        for i, sub in enumerate(schema.get(keyword) or ()):
            problem = schema_problem(sub, f"{path}/{keyword}/{i}")
            if problem is not None:
                return problem
    for keyword in _SCHEMA_KEYWORDS:
        if keyword in schema:
            problem = schema_problem(schema[keyword], f"{path}/{keyword}")
            if problem is not None:
                return problem
    return None


def _keyword_rules(schema: Mapping[str, object], path: str) -> str | None:
    """Rules between keywords of one schema that xgrammar would accept and then not enforce."""
    all_of = schema.get("allOf")  # a non-empty list when given (schema_problem checked it)
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{path}/allOf has {len(all_of)} schemas; merge them into one (allOf of one is fine)"
    if "multipleOf" in schema:
        step = schema["multipleOf"]
        if schema.get("type") != "integer" or not isinstance(step, int) or isinstance(step, bool) or step < 1:
            return (f"{path}/multipleOf is enforced only on \"type\": \"integer\" with a positive integer "
                    f"step, got type {schema.get('type')!r} and step {step!r}")
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    limiting = [key for key in ("pattern", "format") if key in schema]
    if lengths and limiting:
        return (f"{path}: {lengths[0]} with {limiting[0]} is not enforced; put the length in the pattern "
                "instead (e.g. \"^[a-z]{1,8}$\")")
    if schema.get("uniqueItems") not in (None, False):
        return f"unsupported keyword 'uniqueItems' at {path}: the grammar cannot enforce it; remove it"
    for keyword in ("unevaluatedItems", "unevaluatedProperties"):
        if schema.get(keyword) not in (None, False):
            return f"{path}/{keyword}: only false is supported (the grammar already forbids unlisted entries)"
    required = schema.get("required")
    properties = schema.get("properties")
    if isinstance(required, list):  # the grammar enforces required keys only among the properties
        listed = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in listed]
        if missing:
            return (f"{path}/required names {missing[0]!r}, which is not in properties; "
                    "add it to properties or drop it from required")
    return None


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
