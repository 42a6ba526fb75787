"""One registry of quantization formats (layers/quantization.py): every place that offers or checks a format
asks it, so a format's name, loader, packer and kernel are known in one place (issue 30)."""

from __future__ import annotations

import typing
from pathlib import Path

import click
import pytest

from batchinfer.cli.run_cmd import run
from batchinfer.cli.worker_cmd import worker
from batchinfer.config import Settings
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.layers.quantization import FORMATS, QUANTIZATIONS, GGUFBlocks, quantization_format


def _choices(command: click.Command) -> tuple[str, ...]:
    option = next(p for p in command.params if p.name == "quantization")
    assert isinstance(option.type, click.Choice)
    return tuple(option.type.choices)


def test_the_settings_and_both_clis_offer_exactly_the_registered_formats():
    assert list(FORMATS) == [None, *QUANTIZATIONS] and QUANTIZATIONS == ("int8", "gguf")
    assert all(FORMATS[name].name == name and FORMATS[name].kernel for name in FORMATS)
    assert _choices(run) == _choices(worker) == QUANTIZATIONS
    literal = typing.get_args(Settings.model_fields["quantization"].annotation)[0]
    assert typing.get_args(literal) == QUANTIZATIONS


@pytest.mark.parametrize("value", ["int4", "INT8", ["int8"], 8])
def test_an_unknown_format_is_refused_with_the_valid_names(value: object):
    with pytest.raises(ValueError, match=r"quantization: must be None or one of int8, gguf; got "):
        quantization_format(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"quantization: must be None or one of int8, gguf; got "):
        EngineConfig(model="m", quantization=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [None, *QUANTIZATIONS])
def test_a_format_whose_weights_do_not_split_refuses_parallel_ranks(name: str | None):
    EngineConfig(model="m", quantization=name)  # one rank: every format
    if quantization_format(name).splits_across_ranks:
        EngineConfig(model="m", quantization=name, tensor_parallel_size=2)
        return
    refused = (rf"quantization={name!r} runs with tensor_parallel_size=1 and pipeline_parallel_size=1 only; "
               r"use quantization='int8' or none to split it")
    for ranks in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match=refused):
            EngineConfig(model="m", quantization=name, **ranks)


def test_the_gguf_loader_needs_a_gguf_file_and_a_draft_runs_blocks_only_when_it_is_one(tmp_path: Path):
    gguf = quantization_format("gguf")
    assert isinstance(gguf, GGUFBlocks)
    with pytest.raises(ValueError, match=r"is not a \.gguf file or an alias of one; use quantization='int8'"):
        gguf.weight_source(str(tmp_path))
    blocks = tmp_path / "draft.gguf"
    blocks.write_bytes(b"GGUF")
    assert gguf.weight_source(str(blocks)) == blocks
    assert gguf.draft_quantization(str(blocks)) == "gguf"
    assert gguf.draft_quantization(str(tmp_path)) is None  # a safetensors draft runs in the target's dtype
    assert quantization_format("int8").draft_quantization(str(tmp_path)) == "int8"
    assert quantization_format("int8").weight_source(str(blocks)) is None
    assert quantization_format(None).draft_quantization(str(blocks)) is None
