"""Which model each line of a job runs on: its `body.model` when a worker serves it, else the job's model.

"Served" is the worker registry at ingest (workers.served_models: live workers' models) plus the job's
default model. With no live worker registered, a line's model is accepted as given: its shards wait for
a worker of that model (or expire with the job) rather than every line being refused. A line naming a
model that is not served errors alone with code `model_not_found`, naming the models served.

A job run in one process (`batchinfer run`) serves only its model, under that name and its
`--served-model-name`s (vLLM's flag), and its `--lora-modules` adapters: a line naming one of the names
runs on the job's model, one naming an adapter runs under it (in shards of that adapter's name, as a
worker's served adapters are models of the registry), any other is `model_not_found` (as vLLM answers
that request, listing the served names), whatever workers are live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from batchinfer.store.workers import served_models
from batchinfer.wire.request import LineError

if TYPE_CHECKING:
    import numpy as np

MODEL_NOT_FOUND = "model_not_found"


@dataclass
class ModelRouting:
    """The job's models: the default, what is served, and the lines that run on another model."""

    default: str  # the job's model: lines without body.model (or naming it) run on it
    served: frozenset[str] | None  # models a line may name; None: no live worker at ingest, any name goes
    line_models: dict[int, str] = field(default_factory=dict)  # line number -> model, off-default lines only
    aliases: frozenset[str] = frozenset()  # other names of the default model (vLLM's --served-model-name)

    @classmethod
    def at_ingest(cls, session: Session, *, default: str, served_names: frozenset[str] | None = None,
                  adapter_names: frozenset[str] = frozenset()) -> ModelRouting:
        """The routing of a job of `default` submitted now: from the worker registry, or, when
        `served_names` is given (a job run in this process), only `default` under those names and the
        LoRA adapters of `adapter_names` (each line naming one runs in that adapter's shards)."""
        if served_names is not None:
            return cls(default, served_names | adapter_names | {default}, aliases=served_names)
        served = served_models(session)
        return cls(default, frozenset(served) | {default} if served else None)

    def route(self, model: str | None, line_number: int, *, custom_id: str | None = None) -> None:
        """Record the model of a line; raises LineError (model_not_found) when no worker serves it."""
        if model is None or model == self.default or model in self.aliases:
            return
        if self.served is not None and model not in self.served:
            names = ", ".join(sorted(self.served))
            raise LineError(f"body.model: model {model!r} is not served; served models: {names} (use one of "
                            "them, or leave model out to use the job's model)", code=MODEL_NOT_FOUND,
                            param="body.model", custom_id=custom_id)
        self.line_models[line_number] = model

    def split(self, ordered_lines: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The shard plan's lines (in shard order) grouped by model, each group in that order."""
        if not self.line_models:
            return [(self.default, ordered_lines)]
        import numpy as np

        names = sorted(set(self.line_models.values()))
        index = {name: i + 1 for i, name in enumerate(names)}  # 0 is the default model
        routed = np.fromiter(self.line_models, dtype=np.uint32, count=len(self.line_models))
        codes = np.fromiter((index[m] for m in self.line_models.values()), dtype=np.uint32,
                            count=len(self.line_models))
        order = np.argsort(routed)
        position = np.searchsorted(routed[order], ordered_lines)
        position = np.minimum(position, len(routed) - 1)
        hit = routed[order][position] == ordered_lines
        line_codes = np.where(hit, codes[order][position], 0)
        groups = [(self.default, ordered_lines[line_codes == 0])]
        groups += [(name, ordered_lines[line_codes == index[name]]) for name in names]
        return [(name, lines) for name, lines in groups if len(lines)]
