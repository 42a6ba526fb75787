"""Issue 28 items 3 and 4: grammars compile on a pool fair between owners, a compilation past its time
errors its requests naming the setting, and compiled grammars are kept within a byte budget.

On the tiny tokenizer (vocab 512) a guided_choice of 2,000 50-letter strings takes ~1 s to compile and
~25 MB (xgrammar's memory_size_bytes); a small regex ~20 ms."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import pytest

from batchinfer.engine.sampling.grammars import GrammarError
from batchinfer.engine.sampling.structured import GrammarBackend
from batchinfer.engine.sampling_params import StructuredOutputsParams
from tests.fixtures.tiny_models import build_tokenizer


def _choices(count: int, seed: int) -> StructuredOutputsParams:
    rng = random.Random(seed)
    return StructuredOutputsParams(choice=["".join(rng.choices(string.ascii_letters, k=50))
                                           for _ in range(count)])


@pytest.fixture
def make_backend() -> Iterator:
    made: list[GrammarBackend] = []
    tokenizer = build_tokenizer()

    def make(**kwargs: object) -> GrammarBackend:
        backend = GrammarBackend(tokenizer, vocab_size=len(tokenizer), eos_token_ids={tokenizer.eos_token_id},
                                 max_num_seqs=4, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def test_one_owners_slow_grammars_do_not_hold_up_another_owners(make_backend) -> None:
    backend = make_backend(compile_workers=2)
    slow = [backend.compile(_choices(2000, seed), owner="owner:a") for seed in range(3)]
    quick = backend.compile(StructuredOutputsParams(regex="[a-z]+"), owner="owner:b")
    # Before: one compile thread, first come first served: b waited for all of a's (~3 s).
    done, _ = wait([quick, *slow], timeout=60, return_when=FIRST_COMPLETED)
    assert quick in done and not any(f.done() for f in slow[1:])
    assert quick.result() is not None
    for future in slow:
        assert future.result(timeout=60) is not None  # a's all compile in turn
    assert backend.num_compiled == 4


def test_a_constraint_another_owner_queued_is_not_held_behind_that_owners_backlog(make_backend) -> None:
    backend = make_backend(compile_workers=2)
    common = StructuredOutputsParams(regex="[a-z]+")
    slow = [backend.compile(_choices(2000, seed), owner="owner:a") for seed in range(3)]
    queued_by_a = backend.compile(common, owner="owner:a")  # at the back of a's queue
    quick = backend.compile(common, owner="owner:b")  # b's turn compiles it: one future for both
    assert quick is queued_by_a
    # Before: b's request shared a's queued job and waited for a's three slow grammars (~3 s).
    done, _ = wait([quick, *slow], timeout=60, return_when=FIRST_COMPLETED)
    assert quick in done and not any(f.done() for f in slow[1:])
    for future in slow:
        assert future.result(timeout=60) is not None
    assert backend.num_compiled == 4  # a's own job for it found it compiled and did not compile again


def test_a_compilation_past_its_time_errors_its_requests_and_is_not_retried(make_backend) -> None:
    backend = make_backend(compile_timeout_s=0.05)
    slow = _choices(3000, 7)
    with pytest.raises(GrammarError, match=r"^compiling the choice constraint took longer than 0.05 s "
                                           r"\(grammar_compile_timeout_seconds\); simplify it$"):
        backend.compile(slow, owner="owner:a").result(timeout=60)
    again = backend.compile(slow, owner="owner:a")
    assert again.done() and isinstance(again.exception(), GrammarError)  # remembered, not compiled again


def test_compiled_grammars_are_kept_within_the_byte_budget(make_backend) -> None:
    budget = 16 << 20
    backend = make_backend(cache_bytes=budget)
    futures = []
    for seed in range(3):  # one after the other: the least recently used is the first
        futures.append(backend.compile(_choices(600, seed)))
        futures[-1].result(timeout=60)
    sizes = [future.result().memory_size_bytes for future in futures]
    assert sum(sizes) > budget and max(sizes) < budget  # all three would not fit; each one does
    assert 0 < backend.cached_bytes <= budget
    assert backend.compile(_choices(600, 2)) is futures[2]  # the newest is kept ...
    assert backend.compile(_choices(600, 0)) is not futures[0]  # ... the oldest was let go


EXIT_DURING_COMPILE = """
import random, string
from tests.fixtures.tiny_models import build_tokenizer
from batchinfer.engine.sampling_params import StructuredOutputsParams
from batchinfer.engine.sampling.structured import GrammarBackend
tok = build_tokenizer()
backend = GrammarBackend(tok, vocab_size=len(tok), eos_token_ids={tok.eos_token_id}, max_num_seqs=4,
                         compile_timeout_s=0.05)
rng = random.Random(0)
choices = ["".join(rng.choices(string.ascii_letters, k=50)) for _ in range(3000)]
future = backend.compile(StructuredOutputsParams(choice=choices), owner="a")
print(type(future.exception(30)).__name__)  # the compilation goes on while the interpreter exits
"""


def test_a_process_exits_cleanly_while_a_dropped_compilation_still_runs(tmp_path: Path) -> None:
    """xgrammar's threads torn down under a compilation abort the process ("terminate called ...")."""
    script = tmp_path / "exit_during_compile.py"
    script.write_text(EXIT_DURING_COMPILE)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert (done.returncode, done.stdout.strip()) == (0, "GrammarError"), done.stderr[-2000:]
