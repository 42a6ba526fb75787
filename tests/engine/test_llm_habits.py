"""vLLM's offline habits on batchinfer's LLM: the top-level imports, prompt dicts, a progress bar on stderr by
default, LLM.embed with vLLM's output shape, StructuredOutputsParams exported (issue 29 item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batchinfer
from batchinfer import (
    LLM,
    EmbeddingRequestOutput,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    TokensPrompt,
)
from batchinfer.engine import llm as engine_llm
from batchinfer.engine import sampling_params

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_top_level_names_are_the_engine_classes_and_cost_no_torch_until_used() -> None:
    assert LLM is engine_llm.LLM and SamplingParams is sampling_params.SamplingParams
    assert StructuredOutputsParams is sampling_params.StructuredOutputsParams
    assert set(batchinfer.__all__) >= {"LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput"}
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        batchinfer.Nope  # noqa: B018
    probe = "import sys, batchinfer; assert 'torch' not in sys.modules; print(batchinfer.__version__)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60).returncode == 0


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    with LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=4) as llm:
        yield llm


def test_prompt_dicts_equal_plain_prompts(llm: LLM) -> None:
    text = "the cat reads the book"
    ids = llm.get_tokenizer()(text).input_ids
    plain = llm.generate([text, ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, TokensPrompt(prompt_token_ids=ids)], GREEDY, use_tqdm=False)
    single = llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert [o.prompt for o in dicts] == [text, None] and isinstance(dicts[0], RequestOutput)


@pytest.mark.parametrize(("prompt", "says"), [
    ({"prompt": "x", "multi_modal_data": {}}, r"prompts\[1\]: multi_modal_data: not supported by batchinfer"),
    ({"prompt_token_ids": "1 2"}, r"prompts\[1\]: prompt_token_ids: must be a list of token ids"),
    ({"text": "x"}, r"prompts\[1\]: text: not supported"),
    (3.5, r"prompts\[1\]: must be a string, a list of token ids"),
])
def test_bad_prompt_dicts_name_the_prompt_and_field(llm: LLM, prompt: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        llm.generate(["fine", prompt], GREEDY)
    assert not llm.engine.has_unfinished()


def test_progress_bar_on_stderr_by_default(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["one", "two"], GREEDY)
    shown = capsys.readouterr()
    assert "Processed prompts" in shown.err and "2/2" in shown.err and shown.out == ""
    llm.generate(["one"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_embed_returns_vllm_outputs(llm: LLM) -> None:
    texts = ["a document about cats", {"prompt": "another one"}]
    outputs = llm.embed(texts, use_tqdm=False)
    expected, _ = llm.engine.embed(["a document about cats", "another one"])
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outputs]), torch.tensor(expected))
    assert outputs[0].outputs.hidden_size == len(expected[0])
    assert outputs[1].prompt_token_ids == llm.get_tokenizer()("another one").input_ids
    with pytest.raises(ValueError, match=r"prompts\[0\]: \d+ tokens exceed the model's context"):
        llm.embed([[5] * 100_000], use_tqdm=False)


def test_structured_outputs_params_from_the_top(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0].text in {"yes", "no"}
