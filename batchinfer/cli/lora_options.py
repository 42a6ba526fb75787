"""The LoRA flags of `batchinfer run` and `batchinfer worker`, as vLLM spells them.

`--lora-modules NAME=PATH` is repeatable and, as vLLM's nargs='+', also takes several NAME=PATH words after
one flag (`--lora-modules a1=/x a2=/y`): the following words of that form are taken until one is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from batchinfer.config import Settings
from batchinfer.engine_kwargs import EngineKwargs

_Command = TypeVar("_Command", bound=Callable[..., object])


class _PairsOption(click.Option):
    """A multiple option whose flag also takes every following NAME=PATH word (vLLM's nargs='+')."""

    # Any: click's parser (_OptionParser) and its options are private, untyped internals patched here
    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        for opt in self.opts:
            parsed = parser._long_opt.get(opt) or parser._short_opt.get(opt)
            if parsed is None:
                continue
            take_one = parsed.process

            def process(value: Any, state: Any, take_one: Callable[[Any, Any], None] = take_one) -> None:
                take_one(value, state)
                while state.rargs and "=" in state.rargs[0] and not state.rargs[0].startswith("-"):
                    take_one(state.rargs.pop(0), state)

            parsed.process = process


def lora_options(command: _Command) -> _Command:
    """Add --lora-modules, --max-loras, --max-lora-rank and --max-cpu-loras to a command."""
    options = [
        click.option("--lora-modules", "lora_modules", cls=_PairsOption, multiple=True, metavar="NAME=PATH",
                     help="Serve the PEFT LoRA adapter at PATH as NAME: lines whose body.model is NAME run "
                          "under it (repeatable; several NAME=PATH after one flag too).", expose_value=True),
        click.option("--max-loras", type=click.IntRange(min=1), default=None,
                     help="LoRA adapters in one engine step (default: settings.max_loras, 4)."),
        click.option("--max-lora-rank", type=click.IntRange(min=1), default=None,
                     help="The largest adapter rank accepted (default: settings.max_lora_rank, 16)."),
        click.option("--max-cpu-loras", type=click.IntRange(min=1), default=None,
                     help="LoRA adapters kept loaded, least recently used evicted (default: max_loras)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def with_lora_settings(settings: Settings, *, lora_modules: tuple[str, ...], max_loras: int | None,
                       max_lora_rank: int | None, max_cpu_loras: int | None) -> Settings:
    """`settings` with the command line's LoRA flags applied (they win); a bad NAME=PATH fails (exit 1)."""
    from batchinfer.cli.output import fail
    from batchinfer.engine.lora.request import parse_lora_modules

    try:
        modules = {**settings.lora_modules, **parse_lora_modules(lora_modules)}
    except ValueError as exc:
        fail(str(exc))
    update: dict[str, object] = {"lora_modules": modules}
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                        ("max_cpu_loras", max_cpu_loras)):
        if value is not None:
            update[name] = value
    return settings.model_copy(update=update)


def check_adapters(settings: Settings, model: str, engine_kwargs: EngineKwargs,
                   aliases: tuple[str, ...] = ()) -> None:
    """Exit 1 with one line unless every served adapter loads on `model` (files, options, rank, shapes) and
    is named apart from the model (`aliases`: its other names): checked before any job exists, as the model
    and the engine knobs are (no engine is built)."""
    if not settings.lora_modules:
        return
    from batchinfer.cli.output import fail

    clash = sorted(set(settings.lora_modules) & {model, *aliases})
    if clash:
        fail(f"--lora-modules: {clash[0]!r} is already the model's name; give the adapter another name")
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.lora.adapter import load_adapter
    from batchinfer.engine.models.resolved_model import resolve_model

    try:
        config = EngineConfig(model=model, **engine_kwargs)
        hf_config = resolve_model(config, with_tokenizer=False).hf_config
    except (ValueError, FileNotFoundError):
        return  # the model's own check says why, in its words
    for name, path in settings.lora_modules.items():
        try:
            load_adapter(name, path, hf_config=hf_config, max_lora_rank=config.max_lora_rank,
                         dtype=config.resolved_dtype())
        except ValueError as exc:
            fail(f"--lora-modules {name}={path}: {exc}")
