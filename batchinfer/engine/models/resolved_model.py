"""ResolvedModel: what EngineConfig.model names, resolved once per engine and handed to the runners.

Resolving means: the local Hugging Face directory (a GGUF or alias is converted once, see loader), its
config, the context length the engine runs with (validated against the model's position embeddings),
the tokenizer, and the EOS ids. The Engine resolves; ModelRunner and TensorParallelRunner (and through
it every worker rank) take the result, so the checks run once and every part sees the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.model_files import max_model_len_for, read_json_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ResolvedModel:
    """The model an engine runs: files, config, context length, tokenizer and EOS ids."""

    path: Path  # local HF-format directory (config.json + *.safetensors)
    hf_config: PretrainedConfig  # of `path`
    max_model_len: int  # EngineConfig.max_model_len, or the model's max_position_embeddings
    # EOS ids of the model config, generation_config.json and the tokenizer together (HF generate's set).
    eos_token_ids: frozenset[int]
    # A transformers tokenizer (see loader.load_tokenizer), read by the engine through core.tokenizer's
    # Protocol; None when resolved without one (a runner alone; TP worker ranks): only the engine decodes.
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: token ids must be below this."""
        return int(self.hf_config.vocab_size)

    def without_tokenizer(self) -> ResolvedModel:
        """The same model minus the tokenizer (what a TP worker rank is sent: it only runs the model)."""
        return ResolvedModel(self.path, self.hf_config, self.max_model_len, self.eos_token_ids)


def resolve_model(config: EngineConfig, *, with_tokenizer: bool = True) -> ResolvedModel:
    """Resolve config.model; raises ValueError naming max_model_len before any weight is loaded
    (engine.model_files.check_model makes the same checks without torch or transformers).

    with_tokenizer=False skips the tokenizer (a ModelRunner built on its own needs none), so the EOS
    ids then come from the model config and generation_config.json only.
    """
    from batchinfer.engine.model_files import load_hf_config, resolve_model_path
    from batchinfer.engine.models.loader import load_tokenizer

    path = resolve_model_path(config.model)
    hf_config = load_hf_config(path)
    model_max = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = max_model_len_for(config.max_model_len, model_max)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    eos = _eos_token_ids(path, hf_config, tokenizer)
    return ResolvedModel(path, hf_config, max_model_len, eos, tokenizer)


def _eos_token_ids(model_path: Path, hf_config: PretrainedConfig, tokenizer: object) -> frozenset[int]:
    # generation_config.json read as transformers' GenerationConfig reads its eos_token_id (int or list)
    generation = read_json_file(model_path / "generation_config.json")
    values = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None),
              generation.get("eos_token_id")]
    found: set[int] = set()
    for value in values:
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list | tuple):
            found.update(v for v in value if isinstance(v, int))
    return frozenset(found)
