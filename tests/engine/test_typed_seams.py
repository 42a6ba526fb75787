"""The engine's typed seams (#30): the Protocols name what their callers really pass, and the checks that
replaced `Any` keep the old behaviour."""

from __future__ import annotations

import pytest

from batchinfer.engine.core.sequence import Sequence
from batchinfer.engine.logprob import Logprob
from batchinfer.engine.outputs import Logprob as OutputsLogprob
from batchinfer.engine.sampling.grammar_state import GrammarState
from batchinfer.engine.sampling.grammars import GrammarError, build_grammar, canonical_text
from batchinfer.engine.sampling.sampled_row import SampledRow
from batchinfer.engine.sampling.structured import GrammarState as StructuredGrammarState
from batchinfer.engine.sampling_params import SamplingParams
from batchinfer.engine.spec_decode.verify import PositionView

ROW_MEMBERS = [name for name in vars(SampledRow) if not name.startswith("_")]


def test_sequences_and_position_views_are_sampled_rows() -> None:
    seq = Sequence("r", [1, 2, 3], SamplingParams(bad_words=["x"]), max_tokens=4)
    seq.token_ids.append(7)
    view = PositionView(seq, [8, 9])
    assert ROW_MEMBERS  # the Protocol's read-only properties
    for row in (seq, view):
        for name in ROW_MEMBERS:
            getattr(row, name)
    assert view.output_token_ids == [7, 8, 9] and view.num_output_tokens == 3


def test_moved_types_keep_their_old_import_paths() -> None:
    assert OutputsLogprob is Logprob
    assert StructuredGrammarState is GrammarState


def test_a_value_of_the_wrong_type_is_a_grammar_error_not_a_crash() -> None:
    for kind in ("regex", "grammar", "choice"):
        with pytest.raises(GrammarError, match=f"the {kind} constraint must be"):
            build_grammar(kind, {"type": "object"})


def test_canonical_text_of_each_kind() -> None:
    assert canonical_text("json", {"b": 1, "a": [1]}) == '{"b":1,"a":[1]}'
    assert canonical_text("choice", ["x", "y"]) == '["x","y"]'
    assert canonical_text("regex", "a+") == "a+"
    assert canonical_text("json_object", True) == ""


def test_stored_structured_outputs_are_json() -> None:
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]}, logit_bias={5: 1.5})
    assert params.to_dict() == {"structured_outputs": {"choice": ["a", "b"]}, "logit_bias": {"5": 1.5}}
    assert SamplingParams.from_dict(params.to_dict()) == params
