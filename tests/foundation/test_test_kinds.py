"""Every test of the tree carries exactly one kind: unit, integration or acceptance (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.foundation.kinds_report import PREFIX

REPO = Path(__file__).resolve().parents[2]
THIS_TEST = "tests/foundation/test_test_kinds.py::test_every_collected_test_has_exactly_one_kind"


def test_every_collected_test_has_exactly_one_kind() -> None:
    # The whole tree, collected in a fresh process: this session may have collected only a part of it.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-p", "tests.foundation.kinds_report"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    kinds_by_test: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith(PREFIX):
            kinds, node_id = line.removeprefix(PREFIX).split("\t", 1)
            kinds_by_test[node_id] = [kind for kind in kinds.split(",") if kind]
    wrong = {node_id: kinds for node_id, kinds in kinds_by_test.items() if len(kinds) != 1}
    assert not wrong, f"tests without exactly one kind marker: {wrong}"
    counts = {kind: sum(kinds == [kind] for kinds in kinds_by_test.values())
              for kind in ("unit", "integration")}
    assert min(counts.values()) > 0, counts
    assert kinds_by_test[THIS_TEST] == ["integration"]  # it runs a subprocess
