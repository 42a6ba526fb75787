"""Which part of a decoder a pipeline stage holds: a contiguous range of layers, plus the embedding on the
first stage and the final norm and LM head on the last.

The model classes build only their stage's modules; a layer outside the range is a MissingLayer (no
parameters), so parameter names keep their global layer index and match the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    """Layers [start, end) of a model with num_layers layers; is_first / is_last say which ends it holds."""

    start: int
    end: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        """This stage embeds the tokens."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """This stage applies the final norm and the LM head."""
        return self.end == self.num_layers

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The one stage of a model that is not split."""
        return cls(0, num_layers, num_layers)


def split_layers(num_layers: int, pp_size: int, stage: int) -> PipelineStage:
    """Stage `stage` of pp_size near-equal contiguous layer ranges (earlier stages take the remainder)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {pp_size} stages need 1 <= size <= the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return PipelineStage(start, start + base + (1 if stage < extra else 0), num_layers)


class MissingLayer(nn.Module):
    """A layer another stage holds: no parameters, never called."""

    def forward(self, *args: object) -> None:
        """Never runs: the stage forward iterates over its own range only."""
        raise RuntimeError("a pipeline stage ran a layer that another stage holds")
