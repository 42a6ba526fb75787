"""No top-level package of this repository shadows an installed distribution's module of the same name.

Why: the repository root is on sys.path in tests, and `pip install -e .` installs our top-level packages
beside everyone else's. A top-level `kernels/` once hid Hugging Face's `kernels`, which transformers 5.25
imports on `import transformers`: every test that built a model failed at collection in CI.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUR_DISTRIBUTION = "batchinfer"


def test_our_top_level_packages_are_ours_alone() -> None:
    # tests/ is only on sys.path under pytest, never installed; a dependency shipping a stray `tests`
    # package would fail here without harming anyone.
    ours = sorted(path.name for path in REPO.iterdir()
                  if (path / "__init__.py").is_file() and path.name != "tests")
    assert "batchinfer" in ours
    providers = importlib.metadata.packages_distributions()
    clashes = {name: others for name in ours
               if (others := sorted(set(providers.get(name, [])) - {OUR_DISTRIBUTION}))}
    assert clashes == {}, (f"these folders at the repository root hide installed distributions' modules of "
                           f"the same name: {clashes}; move them under batchinfer/")
