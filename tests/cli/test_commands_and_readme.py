"""Every command answers --help and takes --json (and, where it prints and exits, prints JSON only); the
README's commands, options, settings and exit codes exist as written (issue 18)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import orjson
import pytest
from click.testing import CliRunner

from batchinfer.cli import main
from batchinfer.cli.output import EXIT_CODES
from batchinfer.config import Settings

README = Path(__file__).resolve().parents[2] / "README.md"

# Commands that serve until stopped, need a model or compile: their --json output is tested where they are
# (tests/cli/test_cli_habits.py: api, beat; tests/cli/test_run_vllm_habits.py: run;
# tests/engine/test_native_build.py: build-kernels; tests/cli/test_estimate_cli.py: estimate).
LONG_RUNNING = {"api", "worker", "beat", "scheduler", "run", "build-kernels", "estimate"}

# One printing invocation of every other command, in an order that gives each one something to act on.
SAMPLES: list[list[str]] = [
    ["config", "show"],
    ["db", "upgrade"],
    ["apikey", "create", "--name", "ci"],
    ["apikey", "list"],
    ["apikey", "revoke", "1"],
    ["submit", "{input}"],
    ["status", "batch_1"],
    ["list"],
    ["results", "batch_1", "-o", "{tmp}/out.jsonl"],
    ["cancel", "batch_1"],
    ["retry", "batch_1"],
    ["workers", "--all"],
    ["rescue"],
    ["purge"],
    ["schedule", "add", "nightly", "--cron", "0 2 * * *", "--input", "{input}"],
    ["schedule", "list"],
    ["schedule", "show", "nightly"],
    ["schedule", "pause", "nightly"],
    ["schedule", "resume", "nightly"],
    ["schedule", "run-now", "nightly"],
    ["schedule", "remove", "nightly"],
]


def _leaves(group: click.Group, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    out: dict[tuple[str, ...], click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            out |= _leaves(command, (*prefix, name))
        else:
            out[(*prefix, name)] = command
    return out


COMMANDS = _leaves(main)


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_command_has_help_and_json(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.stdout, result.output
    assert "--json" in result.stdout
    options = {opt for param in COMMANDS[path].params for opt in getattr(param, "opts", [])}
    assert "--json" in options


def test_every_printing_command_prints_json_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "fresh"))
    monkeypatch.setenv("BATCHINFER_DEFAULT_MODEL", "no-worker-serves-this")
    (tmp_path / "in.jsonl").write_bytes(b'{"prompt": "x", "max_tokens": 2}\n')
    covered = {_resolve(["batchinfer", *sample])[0] for sample in SAMPLES}
    assert covered == {command for path, command in COMMANDS.items() if path[0] not in LONG_RUNNING}
    for sample in SAMPLES:
        args = [word.format(input=tmp_path / "in.jsonl", tmp=tmp_path) for word in sample]
        result = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
        assert result.exit_code == 0, (args, result.output)
        lines = result.stdout.splitlines()
        assert lines or sample[0] in ("workers",), args  # `workers` may list nobody
        for line in lines:
            assert isinstance(orjson.loads(line), dict), (args, line)
        assert result.stderr == "", (args, result.stderr)  # under --json stderr carries errors only


# --- the README ------------------------------------------------------------------------------------

def _readme_commands() -> list[list[str]]:
    """Every `batchinfer ...` command line of the README's ```bash blocks, as argv lists."""
    text = README.read_text()
    commands: list[list[str]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if not words or words[0] != "batchinfer":
                continue
            segments = " ".join(shlex.quote(w) for w in words).split(" '|' ")  # `a | b`: alternatives
            first = shlex.split(segments[0])
            commands.append(first)
            for alternative in segments[1:]:  # `schedule list | show NAME`: siblings of `list`
                commands.append([*first[:-1], *shlex.split(alternative)])
    return commands


def _resolve(argv: list[str]) -> tuple[click.Command, list[str]]:
    command: click.Command = main
    args = argv[1:]
    while isinstance(command, click.Group):
        assert args and args[0] in command.commands, f"{' '.join(argv)}: unknown command {args[:1]}"
        command, args = command.commands[args[0]], args[1:]
    return command, args


def test_readme_commands_and_options_exist_as_written() -> None:
    commands = _readme_commands()
    assert len(commands) >= 20  # the parser found the README's commands
    for argv in commands:
        command, args = _resolve(argv)
        try:  # parse exactly as the shell would pass them: unknown options, missing arguments fail
            command.make_context(argv[1], list(args), resilient_parsing=False)
        except click.exceptions.Exit:
            pass
        except click.UsageError as exc:
            pytest.fail(f"README: `{' '.join(argv)}`: {exc.format_message()}")
    seen = {tuple(argv[1:3]) for argv in commands}
    assert ("schedule", "run-now") in seen and ("apikey", "create") in seen and ("run", "-i") in seen


def test_readme_exit_codes_are_the_cli_exit_codes() -> None:
    from batchinfer.cli.jobs import exit_code_for
    from batchinfer.store.statuses import JobStatus
    from batchinfer.wire.batch import BatchObject, RequestCounts

    text = README.read_text()
    paragraph = re.search(r"Exit codes: (.*?)\n\n", text, flags=re.S)
    assert paragraph, "README: the 'Exit codes:' paragraph is missing"
    stated = {int(code) for code in re.findall(r"`(\d)`", paragraph.group(1))}
    assert stated == set(EXIT_CODES)

    def batch(status: str, failed: int = 0) -> BatchObject:
        return BatchObject(id="batch_1", endpoint=None, input_file_id=None, completion_window="24h",
                           created_at=0, status=JobStatus(status),
                           request_counts=RequestCounts(total=2, completed=2 - failed, failed=failed))

    assert [exit_code_for(batch("completed")), exit_code_for(batch("completed", 1)),
            exit_code_for(batch("failed")), exit_code_for(batch("cancelled")),
            exit_code_for(batch("expired"))] == [0, 3, 4, 5, 6]
    for code, meaning in EXIT_CODES.items():  # the words match too, loosely
        assert f"`{code}`" in paragraph.group(1), meaning


def test_readme_settings_exist() -> None:
    table = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names = [name for row in re.findall(r"^\| `([^|]+)\|", table, flags=re.M)
             for name in re.findall(r"([a-z][a-z0-9_]*)`", row)]
    assert len(names) >= 15
    assert set(names) <= set(Settings.model_fields), set(names) - set(Settings.model_fields)
