"""Logprob: one token's log-probability at one position (vLLM's Logprob).

A module of its own so that a Sequence (which collects them) and the outputs (which hand them back) can
both name it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token at one position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
