"""Constraints as grammars: what a constraint must be to be accepted, and that what is accepted is enforced.

Every JSON Schema keyword grammars.py lets through is checked against xgrammar's matcher with an instance
`jsonschema` accepts and one it rejects: the grammar must agree on both, so a keyword xgrammar stops
enforcing fails here rather than in someone's batch. Refused keywords and malformed constraints raise
SamplingParamsError naming the field and, for schemas, where in the schema.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from batchinfer.engine.sampling.grammars import build_grammar
from batchinfer.engine.sampling.json_schema_support import (
    ANNOTATION_KEYWORDS,
    SUPPORTED_KEYWORDS,
    UNSUPPORTED_KEYWORDS,
    schema_problem,
)
from batchinfer.engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tests.fixtures.tiny_models import build_tokenizer


@functools.cache
def compiler():
    import xgrammar as xgr

    tokenizer = build_tokenizer()
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def grammar_accepts(kind: str, value, text: str, *, any_whitespace: bool = True) -> bool:
    """True when the whole of `text` is a complete match of the constraint's grammar."""
    import xgrammar as xgr

    compiled = compiler().compile_grammar(build_grammar(kind, value, any_whitespace=any_whitespace))
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


# keyword -> (schema using it, an instance it allows, one it forbids)
ENFORCED = {
    "type": ({"type": ["string", "null"]}, "null", "1"),
    "enum": ({"enum": ["a", 1, None]}, "1", "2"),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "null", '"s"'),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 3}]}, "3", "4"),
    "$ref": ({"$defs": {"d": {"type": "integer"}}, "$ref": "#/$defs/d"}, "5", '"5"'),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"abd"'),
    "format": ({"type": "string", "format": "date"}, '"2024-05-17"', '"tomorrow"'),
    "minimum": ({"type": "integer", "minimum": 3}, "3", "2"),
    "maximum": ({"type": "number", "maximum": 1.5}, "1.5", "1.6"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, "1", "0"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "4", "5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "9", "10"),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1,2]", '[1,"2"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', "[1]"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1,2]"),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', '{"a":"1"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 '{"a":1}', "{}"),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}},
                             '{"k":1}', '{"k":"v"}'),
    "minProperties": ({"type": "object", "additionalProperties": True, "minProperties": 1}, '{"a":1}', "{}"),
    "maxProperties": ({"type": "object", "additionalProperties": True, "maxProperties": 1},
                      '{"a":1}', '{"a":1,"b":2}'),
    "propertyNames": ({"type": "object", "additionalProperties": True, "propertyNames": {"pattern": "^a"}},
                      '{"a":1}', '{"b":1}'),
}


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_every_allowed_keyword_is_enforced_by_the_grammar(keyword: str) -> None:
    schema, allowed, forbidden = ENFORCED[keyword]
    assert schema_problem(schema) is None
    formats = jsonschema.FormatChecker()
    jsonschema.validate(json.loads(allowed), schema, format_checker=formats)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(forbidden), schema, format_checker=formats)
    assert grammar_accepts("json", schema, allowed)
    assert not grammar_accepts("json", schema, forbidden)


def test_the_keyword_lists_cover_the_enforced_table() -> None:
    untested = SUPPORTED_KEYWORDS - ENFORCED.keys() - {
        "$defs", "definitions", "contentEncoding", "uniqueItems", "unevaluatedItems", "unevaluatedProperties"}
    assert not untested, f"add a row to ENFORCED for {sorted(untested)}"
    assert not SUPPORTED_KEYWORDS & UNSUPPORTED_KEYWORDS.keys()
    assert not ANNOTATION_KEYWORDS & (SUPPORTED_KEYWORDS | UNSUPPORTED_KEYWORDS.keys())


def test_bounded_strings_never_hold_raw_control_characters() -> None:
    """xgrammar's own minLength/maxLength rule lets a raw tab into the string; ours is rewritten."""
    schema = {"type": "string", "maxLength": 4}
    assert grammar_accepts("json", schema, '"ab"')
    assert not grammar_accepts("json", schema, '"a\tb"')
    assert not grammar_accepts("json", schema, '"a\x1ab"')


def test_json_object_mode_is_any_object_and_whitespace_can_be_disabled() -> None:
    assert grammar_accepts("json_object", True, '{"a": [1, {"b": null}]}')
    assert not grammar_accepts("json_object", True, "[1]")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert grammar_accepts("json", schema, '{ "a" : 1 }')
    assert not grammar_accepts("json", schema, '{ "a" : 1 }', any_whitespace=False)


def test_choice_and_regex_and_grammar() -> None:
    choices = ['say "hi"', "naïve", "back\\slash", ""]
    for choice in choices:
        assert grammar_accepts("choice", choices, choice)
    assert not grammar_accepts("choice", choices, "say hi")
    assert grammar_accepts("regex", r"\d{3}-[a-z]{2}", "123-ab")
    assert not grammar_accepts("regex", r"\d{3}-[a-z]{2}", "12-ab")
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+'
    assert grammar_accepts("grammar", grammar, "(1,23)")
    assert not grammar_accepts("grammar", grammar, "(1,)")


REFUSED = [
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "'uniqueItems' at #"),
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}},
     "structured_outputs.json", "unsupported keyword 'not' at #/properties/a"),
    ({"json": {"properties": {"tags": {"type": "array", "contains": {"const": 1}}}}},
     "structured_outputs.json", "'contains' at #/properties/tags"),
    ({"json": {"type": "object", "properties": {"a": {"minimun": 1}}}}, "structured_outputs.json",
     "unknown keyword 'minimun' at #/properties/a (check the spelling)"),
    ({"json": {"type": "strng"}}, "structured_outputs.json", "#/type must be one of string"),
    ({"json": {"type": "array", "minItems": -1}}, "structured_outputs.json", "non-negative integer"),
    ({"json": {"type": "array", "minItems": 3, "maxItems": 1}}, "structured_outputs.json", "minItems"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "structured_outputs.json", "minimum"),
    ({"json": {"type": "number", "multipleOf": 0.5}}, "structured_outputs.json", "multipleOf"),
    ({"json": {"allOf": [{"type": "string"}, {"maxLength": 2}]}}, "structured_outputs.json", "merge them"),
    ({"json": {"type": "string", "pattern": "^a+$", "maxLength": 3}}, "structured_outputs.json",
     "put the length in the pattern"),
    ({"json": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}, "structured_outputs.json",
     "required names 'b'"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json", "missing"),
    ({"json": "{not json"}, "structured_outputs.json", "is not valid JSON text"),
    ({"json": [1]}, "structured_outputs.json", "must be a JSON Schema object"),
    ({"regex": "(?=a)b"}, "structured_outputs.regex", "Lookahead is not supported"),
    ({"regex": "(ab"}, "structured_outputs.regex", "parenthesis is not closed"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice", "non-empty list of strings"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar", 'Rule "missing" is not defined'),
    ({"json": {}, "regex": "a"}, "structured_outputs.regex", "give exactly one of"),
    ({}, "structured_outputs.json", "give exactly one of"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace",
     "true or false"),
    ({"jsn": {}}, "structured_outputs.jsn", "unknown field"),
]


@pytest.mark.parametrize(("constraint", "field", "fragment"), REFUSED)
def test_bad_constraints_raise_naming_the_field_and_the_place(constraint, field, fragment) -> None:
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(structured_outputs=constraint)
    assert caught.value.field == field
    assert fragment in caught.value.message
    assert "/project/cpp" not in caught.value.message  # xgrammar's source location is cleaned off


def test_constraints_exclude_ignore_eos_and_min_tokens() -> None:
    with pytest.raises(SamplingParamsError, match="ignore_eos: cannot be combined"):
        SamplingParams(structured_outputs={"json_object": True}, ignore_eos=True)
    with pytest.raises(SamplingParamsError, match="min_tokens: cannot be combined"):
        SamplingParams(structured_outputs={"regex": "a+"}, min_tokens=2)


def test_params_survive_to_dict_and_from_dict() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    for constraint in ({"json": schema, "disable_any_whitespace": True}, {"json_object": True},
                       {"regex": "[a-z]+"}, {"choice": ["x", "y"]}, {"grammar": 'root ::= "a"'}):
        params = SamplingParams(temperature=0.0, structured_outputs=constraint)
        stored = json.loads(json.dumps(params.to_dict()))  # through the database's JSON
        assert stored["structured_outputs"] == constraint
        again = SamplingParams.from_dict(stored)
        assert again == params
        assert again.structured_outputs.cache_key == params.structured_outputs.cache_key
    text = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    assert text.structured_outputs.json == schema  # a schema's JSON text becomes its object
    assert SamplingParams(temperature=0.5).to_dict() == {"temperature": 0.5}  # unconstrained: nothing more


def test_equal_constraints_share_a_cache_key_and_key_order_matters() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {}, "y": {}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {}, "y": {}}}')
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"y": {}, "x": {}}})
    assert a.cache_key == b.cache_key
    assert a.cache_key != reordered.cache_key  # property order is the output's order
    assert a.cache_key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).cache_key
