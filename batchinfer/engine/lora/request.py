"""LoRARequest: the adapter a request runs under, as vLLM's (lora_name, lora_int_id, lora_path).

Pure Python (no torch): the CLI and the workers build it before the engine is imported.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory served under `lora_name`; `lora_int_id` (>= 1) identifies it in the engine.

    Invariant: one id names one adapter for the engine's lifetime (the prefix cache and the loaded-adapter
    cache key on it); the engine refuses the same id with another name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name: must be a non-empty string; got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
            raise ValueError(f"lora_request.lora_int_id: must be an integer >= 1; got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path: must be a non-empty path; got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What the prefix-cache hash carries for this adapter (ARCHITECTURE.md, contract 5)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"


def parse_lora_modules(values: Iterable[str]) -> dict[str, str]:
    """NAME=PATH words (vLLM's --lora-modules) -> {name: path}; ValueError naming the bad word."""
    modules: dict[str, str] = {}
    for word in values:
        name, sep, path = word.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {word!r} is not NAME=PATH (e.g. sql=/adapters/sql-lora)")
        if name in modules and modules[name] != path:
            raise ValueError(f"--lora-modules: {name!r} is given twice ({modules[name]} and {path})")
        modules[name] = path
    return modules


def lora_requests(modules: Mapping[str, str]) -> dict[str, LoRARequest]:
    """The served adapters {name: path} as LoRARequests, ids 1, 2, ... in name order (stable per process)."""
    return {name: LoRARequest(name, i, str(modules[name])) for i, name in enumerate(sorted(modules), 1)}
