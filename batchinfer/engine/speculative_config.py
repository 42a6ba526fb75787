"""SpeculativeConfig: the `speculative_config` dict of EngineConfig and the worker settings, validated.

Two shapes (vLLM's keys):

  {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
  {"method": "draft_model", "model": "<name or path>", "num_speculative_tokens": k}

plus, for either, `disable_by_batch_size` (vLLM's speculative_disable_by_batch_size): a step whose running
batch holds more sequences than this does not speculate. Errors name the field as
`speculative_config.<key>`, in the engine's "field: message" style.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # beyond this, verification chunks cost more than rejected tokens can repay
DEFAULT_PROMPT_LOOKUP_MIN = 2  # a 1-token match proposes too often on prose to pay off
DEFAULT_PROMPT_LOOKUP_MAX = 5  # longer keys propose less often but are accepted more (bench/speculative.py)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # above this the step is compute-bound: extra verified tokens cost time
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate: the proposer, k tokens per step, and when the engine turns speculation off."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None  # the draft model (method draft_model); shares the target's tokenizer
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def to_dict(self) -> dict[str, object]:
        """The fields as a plain dict (what parse_speculative_config reads back)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


def _field(key: str) -> str:
    return f"speculative_config.{key}"


def _positive_int(data: Mapping[str, object], key: str, default: int | None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"{_field(key)}: is required")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{_field(key)}: must be an integer >= 1; got {value!r}")
    return value


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict (or one already built); None for None or an empty dict."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config: must be a dict (a JSON object); got {type(value).__name__}")
    if not value:
        return None
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown}; known: {', '.join(_KEYS)}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"{_field('method')}: must be one of {', '.join(METHODS)}; got {method!r}")
    k = _positive_int(value, "num_speculative_tokens", None)
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{_field('num_speculative_tokens')}: must be <= {MAX_SPECULATIVE_TOKENS}; got {k}")
    disable = _positive_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if method == "ngram":
        if value.get("model") is not None:
            raise ValueError(f"{_field('model')}: only for method draft_model (ngram needs no model)")
        lookup_min = _positive_int(value, "prompt_lookup_min", DEFAULT_PROMPT_LOOKUP_MIN)
        lookup_max = _positive_int(value, "prompt_lookup_max", max(lookup_min, DEFAULT_PROMPT_LOOKUP_MAX))
        if lookup_min > lookup_max:
            raise ValueError(f"{_field('prompt_lookup_min')}: must be <= prompt_lookup_max ({lookup_max}); "
                             f"got {lookup_min}")
        return SpeculativeConfig(method, k, lookup_min, lookup_max, None, disable)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in value:
            raise ValueError(f"{_field(key)}: only for method ngram")
    model = value.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"{_field('model')}: method draft_model needs the draft model's name or path")
    return SpeculativeConfig(method, k, model=model, disable_by_batch_size=disable)
