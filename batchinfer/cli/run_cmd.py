"""`batchinfer run`: a whole job in this process (submit, infer, export), no broker or server needed.

It takes the file as an argument or the way `vllm run-batch` users type it
(`batchinfer run -i in.jsonl -o out.jsonl --model M`), and `--errors-in-output` writes the error lines
into the results file, in input order, as vLLM does (by default they go to a file of their own).
vLLM's engine flags (`--dtype`, `--kv-cache-dtype`, `--max-model-len`, `--tensor-parallel-size`,
`--pipeline-parallel-size`, `--quantization`) set the engine's knobs, and `--served-model-name NAME` lets
lines whose body.model is NAME run on the model; a line naming any other model errors alone
(`model_not_found`), as vLLM answers it.
`--lora-modules NAME=PATH` serves PEFT LoRA adapters beside the model (cli/lora_options.py): a line whose
body.model is NAME runs under that adapter, in shards of its own.

The model, the device and the engine knobs are checked before the job exists (one line, exit 1); an
engine that still cannot start fails its job (exit 4) rather than leaving it in_progress for its window.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import orjson

from batchinfer.cli.engine_flags import (
    engine_overrides,
    float32_matmul_precision_option,
    kv_cache_dtype_option,
)
from batchinfer.cli.jobs import _metadata, _print_batch, _with_submit_options, exit_code_for
from batchinfer.cli.lora_options import check_adapters, lora_options, with_lora_settings
from batchinfer.cli.output import EXIT_FAILED, dumps, fail, input_file, json_option
from batchinfer.cli.progress import JobProgress
from batchinfer.cli.result_files import default_errors_path, write_error_lines, write_lines
from batchinfer.engine.layers.quantization import QUANTIZATIONS

if TYPE_CHECKING:
    from batchinfer.engine_kwargs import EngineKwargs

logger = logging.getLogger("batchinfer.cli")


@click.command()
@click.argument("file", required=False, type=click.Path(path_type=Path))  # checked by input_file: exit 1
@click.option("--input", "-i", "--input-file", "input_path", type=click.Path(path_type=Path),
              default=None, help="The input JSONL file (instead of FILE, as `vllm run-batch -i`).")
@click.option("--output", "-o", "--output-file", type=click.Path(dir_okay=False, path_type=Path),
              required=True, help="Where the results go (OpenAI batch output lines).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where error lines go (default: OUTPUT with .errors before the suffix).")
@click.option("--errors-in-output", is_flag=True,
              help="Write error lines into OUTPUT too, in input order (as `vllm run-batch` does).")
@_with_submit_options
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: settings.device).")
@click.option("--dtype", default=None, help="auto, float32, bfloat16, float16 (vLLM's half, float too; "
              "default: settings.dtype).")
@kv_cache_dtype_option
@float32_matmul_precision_option
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Context length (default: the model's).")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=None,
              help="Ranks each layer is split across (default: settings.tensor_parallel_size).")
@click.option("--pipeline-parallel-size", "-pp", type=click.IntRange(min=1), default=None,
              help="Stages of layers (default: settings.pipeline_parallel_size).")
@click.option("--quantization", type=click.Choice(list(QUANTIZATIONS)), default=None,
              help="int8 or gguf weights on CPU (default: settings.quantization).")
@click.option("--served-model-name", multiple=True, metavar="NAME",
              help="Another name of the model: lines whose body.model is NAME run on it (repeatable).")
@lora_options
@click.option("--show", type=int, default=0, help="Print the first N results when done.")
@json_option("Print the final batch object as JSON.")
def run(file: Path | None, input_path: Path | None, output: Path, errors: Path | None, errors_in_output: bool,
        model: str | None, shard_size: int | None, priority: int, metadata: tuple[str, ...],
        idempotency_key: str | None, on_invalid: str, completion_window: str | None,
        max_total_tokens: int | None, result_cache: str | None, device: str | None,
        dtype: str | None, kv_cache_dtype: str | None, float32_matmul_precision: str | None,
        max_model_len: int | None,
        tensor_parallel_size: int | None, pipeline_parallel_size: int | None, quantization: str | None,
        served_model_name: tuple[str, ...],
        lora_modules: tuple[str, ...], max_loras: int | None, max_lora_rank: int | None,
        max_cpu_loras: int | None,
        show: int, as_json: bool) -> None:
    """Run a JSONL file end to end in this process: submit, infer, export (no broker needed)."""
    from batchinfer.cli.backend import BackendError, LocalBackend
    from batchinfer.cli.context import cli_settings
    from workers.lazy_engine import EngineStartError
    from workers.process import make_runner, retire_runner, run_job

    if file is not None and input_path is not None and file != input_path:
        fail(f"two input files given ({file} and -i {input_path}): give one")
    source = file or input_path
    if source is None:
        fail("no input file: give FILE or -i/--input FILE")
    if errors_in_output and errors is not None:
        fail("--errors-in-output writes the errors into OUTPUT: drop --errors, or drop --errors-in-output")
    input_file(source)
    settings = with_lora_settings(cli_settings(), lora_modules=lora_modules, max_loras=max_loras,
                                  max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
    model = model or settings.default_model
    overrides = engine_overrides(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                 float32_matmul_precision=float32_matmul_precision,
                                 max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                                 pipeline_parallel_size=pipeline_parallel_size, quantization=quantization)
    if not as_json:
        click.echo(f"loading {model} ...", err=True)
    engine_kwargs = settings.engine_kwargs() | overrides
    _check_engine(model, engine_kwargs)
    check_adapters(settings, model, engine_kwargs, served_model_name)
    backend = LocalBackend(settings)
    try:
        batch = backend.submit(source, model=model, shard_size=shard_size, priority=priority,
                               metadata=_metadata(metadata), idempotency_key=idempotency_key,
                               on_invalid=on_invalid, completion_window=completion_window,
                               max_total_tokens=max_total_tokens, result_cache=result_cache,
                               served_names=frozenset(served_model_name),
                               adapter_names=frozenset(settings.lora_modules))
    except BackendError as exc:
        fail(str(exc))
    if batch.status == "in_progress":
        if not as_json:
            click.echo(f"{batch.id}: {batch.request_counts.total} requests", err=True)
        try:
            # The engine loads on the first line the result cache cannot serve: none, no model loaded.
            runner = make_runner(model=model, settings=settings, lazy=True, **overrides)
        except Exception as exc:  # e.g. unreadable weights: the job fails, with the reason, not in_progress
            logger.debug("the engine could not start", exc_info=True)
            message = _startup_failure(exc)
            backend.fail_unstarted(batch.id, message)
            fail(f"{batch.id} failed: {message}", code=EXIT_FAILED)
        counts = batch.request_counts
        with JobProgress(total=counts.total, done=counts.completed + counts.failed,
                         enabled=not as_json, label=batch.id) as bar:
            if not as_json:  # tokens/s and ETA as `status` shows them, from the runner's heartbeats
                bar.follow(lambda: backend.get(batch.id))
            try:
                run_job(job_id=int(batch.id.removeprefix("batch_")), runner=runner,
                        on_progress=bar.advance)
            except EngineStartError as exc:  # built at its first miss, and it could not start
                logger.debug("the engine could not start", exc_info=True)
                runner.hand_back()
                message = _startup_failure(exc.__cause__ or exc)
                backend.fail_unstarted(batch.id, message)
                fail(f"{batch.id} failed: {message}", code=EXIT_FAILED)
            finally:  # no longer a live worker once its job is done (`workers`, the dashboard)
                retire_runner(runner)
        batch = backend.get(batch.id)
    if errors_in_output:
        written, failed, errors = write_lines(backend.results(batch.id, "all"), output), 0, None
    else:
        errors = errors or default_errors_path(output)
        written = write_lines(backend.results(batch.id, "output"), output)
        failed = write_error_lines(backend.results(batch.id, "errors"), errors)  # none: no file
    if as_json:
        click.echo(dumps(batch))
    else:
        _print_batch(batch, False)
        click.echo(f"results: {output} ({written} lines)"
                   + (f"; errors: {errors} ({failed} lines)" if failed else ""))
        _show(output, show)
    sys.exit(exit_code_for(batch))


def _check_engine(model: str, engine_kwargs: EngineKwargs) -> None:
    """Exit 1 with one line unless `model` resolves here and the engine knobs are valid for it (cheap:
    the model's config is read, no weight is loaded)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.model_files import check_model

    try:
        config = EngineConfig(model=model, **engine_kwargs)
        config.resolved_device()  # DeviceUnavailableError: a CUDA device this torch or machine lacks
        # ModelNotFoundError; max_model_len vs the model (no torch: hits need none)
        check_model(config.model, max_model_len=config.max_model_len)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc))


def _startup_failure(exc: BaseException) -> str:
    """One line saying why the engine could not start."""
    from batchinfer.cli.failures import describe_failure

    detail = " ".join(str(exc).split())[:300]
    return describe_failure(exc) or f"the engine could not start: {type(exc).__name__}: {detail}"


def _show(path: Path, count: int) -> None:
    if count <= 0 or not path.exists():
        return
    with path.open("rb") as lines:
        for _, raw in zip(range(count), lines, strict=False):
            line = orjson.loads(raw)
            if line.get("response") is None:  # an error line (--errors-in-output)
                click.echo(f"--- {line['custom_id']} (error {line['error']['code']})")
                click.echo(line["error"]["message"])
                continue
            body = line["response"]["body"]
            choice = body["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            tokens = body["usage"]["completion_tokens"]
            click.echo(f"--- {line['custom_id']} ({choice['finish_reason']}, {tokens} tokens)")
            click.echo(text.strip())
