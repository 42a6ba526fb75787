"""`batchinfer apikey create --weight` (issue 32): the owner's fair share, shown by `apikey list`; a weight
that is not above 0 (or past the maximum) is one error line naming the option."""

from __future__ import annotations

from pathlib import Path

import orjson
from click.testing import CliRunner

from batchinfer.cli import main


def test_a_key_carries_its_weight_and_a_bad_one_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHINFER_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    refused = runner.invoke(main, ["apikey", "create", "--name", "team", "--weight", "0"])
    assert refused.exit_code == 1 and "--weight: weight must be above 0" in refused.output
    created = runner.invoke(main, ["apikey", "create", "--name", "team", "--weight", "2.5", "--json"])
    assert created.exit_code == 0 and orjson.loads(created.stdout)["weight"] == 2.5
    listed = runner.invoke(main, ["apikey", "list"]).stdout.splitlines()
    assert listed[0].split()[3] == "WEIGHT" and listed[1].split()[3] == "2.5"
