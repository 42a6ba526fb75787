"""A plain script (no `if __name__ == "__main__":` guard) that builds a parallel LLM runs as vLLM's users
expect: its ranks start without re-running the script, it prints its output and exits 0, in bounded time.
And a rank that dies while starting fails the start at once instead of leaving rank 0 at the rendezvous."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchinfer.engine.errors import RankFailedError
from batchinfer.engine.parallel.rank_processes import spawn_rank, wait_started

pytestmark = pytest.mark.integration  # subprocesses

SCRIPT = """\
from batchinfer import LLM, SamplingParams

print("script body ran", flush=True)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
llm = LLM({model!r}, device="cpu", dtype="float32", {option}=2)
print(len(llm.generate(["the cat reads"], params)[0].outputs[0].token_ids), "tokens", flush=True)
"""


@pytest.mark.parametrize("option", ["pipeline_parallel_size", "tensor_parallel_size"])
def test_plain_script_with_a_parallel_llm_runs_and_exits(tiny_llama: Path, tmp_path: Path,
                                                          option: str) -> None:
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT.format(model=str(tiny_llama), option=option))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["script body ran", "4 tokens"]  # the ranks never re-ran it
    assert "bootstrapping" not in done.stderr


def _exit_at_once(code: int) -> None:
    raise SystemExit(code)


class _DiesWhenUnpickled:
    """An argument the child cannot take: unpickling it ends the child before its target runs."""

    def __reduce__(self) -> tuple:
        return (_exit_at_once, (3,))


def test_rank_that_dies_while_starting_fails_the_start_at_once() -> None:
    begin = time.monotonic()
    ranks = [spawn_rank("doomed-rank", print, (_DiesWhenUnpickled(),))]
    says = r"test start: doomed-rank \(exit code 3\) exited while starting"
    with pytest.raises(RankFailedError, match=says):
        wait_started(ranks, what="test start")
    assert time.monotonic() - begin < 60
