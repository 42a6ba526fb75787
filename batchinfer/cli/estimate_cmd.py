"""`batchinfer estimate FILE`: what a file will cost on this deployment before it is submitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from batchinfer.cli.output import emit, fail, input_file, json_option

FIGURES = ("requests", "invalid_lines", "prompt_tokens", "cached_prompt_tokens", "max_output_tokens",
           "expected_output_tokens", "expected_seconds", "live_workers")


def _tokenizer(model: str) -> tuple[Any, int | None]:
    """The model's tokenizer (chat template included) and its context length, without loading weights."""
    from batchinfer.engine.loader import load_hf_config, load_tokenizer, resolve_model_path

    try:
        path = resolve_model_path(model)
    except (ValueError, OSError) as exc:
        fail(f"--model: {exc}")
    config = load_hf_config(path)
    return load_tokenizer(path), getattr(config, "max_position_embeddings", None)


def _tokenize_with(tokenizer: Any):  # noqa: ANN202 - a Tokenize (store.estimate)
    """The worker's prompt of a request, as token ids (workers/runner.py builds it the same way)."""

    def tokenize(request: Any) -> list[int]:
        if request.messages is not None:
            options = request.options or {}
            text = tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=options.get("add_generation_prompt", True),
                tokenize=False, **options.get("chat_template_kwargs", {}))
            return list(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(request.prompt, str):
            return list(tokenizer.encode(request.prompt, add_special_tokens=True))
        return list(request.prompt or [])  # token ids as given; embeddings inputs are not counted

    return tokenize


@click.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--model", "-m", default=None,
              help="Model name, alias or path (default: settings.default_model).")
@json_option("Print the estimate as one JSON object.")
def estimate(file: Path, model: str | None, as_json: bool) -> None:
    """Estimate a JSONL file before submitting it: tokens, expected output and seconds on this deployment."""
    from batchinfer.cli.backend import prepare_database
    from batchinfer.cli.context import cli_settings
    from batchinfer.store.db import session_factory
    from batchinfer.store.estimate import describe, read_file
    from batchinfer.store.estimate import estimate as estimate_file
    from batchinfer.store.ingest import IngestLimits

    input_file(file)
    settings = cli_settings()
    model = model or settings.default_model
    tokenizer, context = _tokenizer(model)
    with file.open("rb") as stream:
        read = read_file(stream, IngestLimits.from_settings(settings, model))
    with session_factory(prepare_database(settings, migrate=True))() as session:
        result = estimate_file(session, model=model, read=read, tokenize=_tokenize_with(tokenizer),
                               context=context, block_size=settings.block_size,
                               max_num_seqs=settings.max_num_seqs)
    figures = result.as_dict()
    lines = [f"{name:24} {describe(figures[name])}" for name in FIGURES]
    lines += [f"basis: {line}" for line in result.basis]
    lines += [f"error: {error['message']}" for error in result.errors]
    emit(figures, "\n".join(lines))
