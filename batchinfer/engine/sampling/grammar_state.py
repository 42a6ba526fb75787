"""GrammarState: the grammar side of one constrained sequence (structured.py compiles and drives it).

A module of its own, importing xgrammar for annotations only, so that a Sequence can name the type of its
`grammar` field without importing the grammar backend (which imports the engine's Sequence).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarMatcher


class GrammarState:
    """The grammar side of one constrained sequence: its compiled grammar (a future) and matcher."""

    __slots__ = ("compiled", "matcher", "num_accepted")

    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self.compiled = compiled
        self.matcher: GrammarMatcher | None = None  # made when the compile is done (GrammarBackend.start)
        self.num_accepted = 0  # output tokens the matcher has accepted

    @property
    def ready(self) -> bool:
        """True once the grammar finished compiling (successfully or not)."""
        return self.compiled.done()
