"""`batchinfer estimate FILE`: what a file will cost on this deployment before it is submitted."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import click

from batchinfer.cli.output import emit, fail, input_file, json_option

FIGURES = ("requests", "invalid_lines", "prompt_tokens", "cached_prompt_tokens", "max_output_tokens",
           "expected_output_tokens", "result_cache_hits", "expected_seconds", "live_workers")


@click.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--model", "-m", default=None,
              help="Model name, alias or path (default: settings.default_model).")
@json_option("Print the estimate as one JSON object.")
def estimate(file: Path, model: str | None, as_json: bool) -> None:
    """Estimate a JSONL file before submitting it: tokens, expected output and seconds on this deployment."""
    from batchinfer.cli.backend import prepare_database
    from batchinfer.cli.context import cli_settings
    from batchinfer.store import LOCAL_OWNER
    from batchinfer.store.db import session_factory
    from batchinfer.store.estimate import describe, estimate_file, model_tokenizer
    from workers.result_cache_forecast import cache_hits

    input_file(file)
    settings = cli_settings()
    model = model or settings.default_model
    try:
        model_tokenizer(model)  # loaded once (cached): an unknown model is one line naming the option
    except (ValueError, OSError) as exc:
        fail(f"--model: {exc}")
    with session_factory(prepare_database(settings, migrate=True))() as session:
        result = estimate_file(session, path=file, model=model, settings=settings, cache_hits=partial(
            cache_hits, model=model, owner=LOCAL_OWNER, settings=settings))
    figures = result.as_dict()
    lines = [f"{name:24} {describe(figures[name])}" for name in FIGURES]
    lines += [f"basis: {line}" for line in result.basis]
    lines += [f"error: {error.message}" for error in result.errors]
    emit(figures, "\n".join(lines))
