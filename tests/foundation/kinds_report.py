"""A pytest plugin for tests/foundation/test_test_kinds.py: after collection, print each test's kinds."""

from __future__ import annotations

import pytest

from tests.conftest import TEST_KINDS

PREFIX = "test-kinds:"


def pytest_collection_finish(session: pytest.Session) -> None:
    """One line per collected test: the prefix, its distinct kinds (comma-separated), a tab, its node id."""
    for item in session.items:
        kinds = dict.fromkeys(mark.name for mark in item.iter_markers() if mark.name in TEST_KINDS)
        print(f"{PREFIX}{','.join(kinds)}\t{item.nodeid}")
