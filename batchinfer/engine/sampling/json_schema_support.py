"""Which JSON Schemas a "json" constraint may use: the keywords xgrammar enforces, and one rewrite.

xgrammar enforces most of the standard but silently ignores a few keywords; a schema using one of them
would be accepted and then produce output that fails validation, so those are refused
(`UNSUPPORTED_KEYWORDS`, each with what to write instead), as are unknown keywords (usually a typo:
"minimun"). Annotations pass. One rewrite: xgrammar's rule for a string with minLength / maxLength lets
raw control characters (a tab, \x1a) into the string, which is not JSON; `xgrammar_schema` states those
lengths as the equivalent pattern `^.{min,max}$`, whose JSON-string rule keeps them out.
grammars.py runs both before a schema becomes a grammar. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")

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
