"""The resource budget of one request, checked at ingest (README "Security"; ARCHITECTURE.md contract 8).

Each sampling field is bounded alone by SamplingParams; this bounds their products, which is what a
request costs a worker:

- KV cache: n x (prompt + max_tokens) tokens must fit `max_request_kv_tokens`. Prompt tokens are
  estimated without the tokenizer (token ids counted, text at PROMPT_BYTES_PER_TOKEN bytes a token, a
  low estimate: the worker still checks each sequence exactly against the model). A request without
  max_tokens counts the whole context (its model's max_position_embeddings, when known).
- Logprobs: n x max_tokens x (1 + top_logprobs) entries, for a request that asks for logprobs, must fit
  `max_request_logprobs` (each entry is a JSON object of the result line).
- Stop strings: at most `max_stop_sequences` (the engine's matching cost per token does not grow with
  the list, engine/sampling/stop_matcher.py, but each string is kept per sequence).
- Logits controls: at most `max_bad_words` bad_words, `max_allowed_token_ids` allowed_token_ids and
  `max_logit_bias` logit_bias entries (their cost per step does not grow with the lists,
  engine/sampling/logits_controls.py, but each is tokenized, stored and turned into masks once per request).

The KV capacity, unless set, is what kv_cache_memory_bytes holds of the job's model when its config.json
is on this machine (a model directory, or an alias already converted), else DEFAULT_KV_TOKENS.
Pure Python: the store imports it (no torch, no engine but sampling params through formats).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachetools import LRUCache

from batchinfer.config import Settings
from batchinfer.wire.request import LineError, NormalizedRequest

DEFAULT_KV_TOKENS = 262_144  # when the model's config cannot be read here: generous, still finite
PROMPT_BYTES_PER_TOKEN = 4  # text prompts: an estimate on the low side for English, CJK and code
CODE = "request_too_large"


@dataclass(frozen=True)
class ModelShape:
    """What the ingest can know of a model from its config.json: K and V values per token, its context."""

    kv_values_per_token: int
    max_context: int | None


@dataclass(frozen=True)
class RequestBudget:
    """The per-request limits of one job (see the module docstring); `check` raises LineError."""

    max_kv_tokens: int
    max_logprobs: int
    max_stop: int
    max_context: int | None = None
    kv_source: str = "max_request_kv_tokens"  # how max_kv_tokens was found, for the error message
    max_bad_words: int = 1024
    max_allowed_token_ids: int = 4096
    max_logit_bias: int = 300

    @classmethod
    def from_settings(cls, settings: Settings, model: str | None = None) -> RequestBudget:
        """The budget for `model` (default: settings.default_model) under these settings."""
        shape = model_shape(model or settings.default_model)
        context = settings.max_model_len or (shape.max_context if shape else None)
        if settings.max_request_kv_tokens is not None:
            kv_tokens, source = settings.max_request_kv_tokens, "max_request_kv_tokens"
        elif shape is not None:
            # auto: counted as float32 (the API may run elsewhere than the workers; the larger is safe)
            itemsize = 2 if settings.dtype in ("bfloat16", "float16") else 4
            kv_tokens = max(settings.kv_cache_memory_bytes // (shape.kv_values_per_token * itemsize), 1)
            source = (f"the KV cache of kv_cache_memory_bytes={settings.kv_cache_memory_bytes}; "
                      "set max_request_kv_tokens to change it")
        else:
            kv_tokens, source = DEFAULT_KV_TOKENS, "max_request_kv_tokens default"
        return cls(max_kv_tokens=kv_tokens, max_logprobs=settings.max_request_logprobs,
                   max_stop=settings.max_stop_sequences, max_context=context, kv_source=source,
                   max_bad_words=settings.max_bad_words, max_allowed_token_ids=settings.max_allowed_token_ids,
                   max_logit_bias=settings.max_logit_bias)

    def check(self, request: NormalizedRequest) -> None:
        """Raise LineError (code request_too_large) naming the field, the limit and its setting."""
        params = request.params
        stops = params.stop if isinstance(params.stop, list) else []
        if len(stops) > self.max_stop:
            raise _error(f"{len(stops)} stop strings; at most {self.max_stop} are allowed "
                         "(max_stop_sequences)", "stop", request)
        for field, limit in (("bad_words", self.max_bad_words), ("logit_bias", self.max_logit_bias),
                             ("allowed_token_ids", self.max_allowed_token_ids)):
            given = len(getattr(params, field) or ())
            if given > limit:
                raise _error(f"{given} {field} entries; at most {limit} are allowed (max_{field}); shorten "
                             "the list", field, request)
        prompt = estimate_prompt_tokens(request)
        if params.max_tokens is not None:
            per_seq, generated = prompt + params.max_tokens, params.max_tokens
        else:
            per_seq = max(self.max_context or self.max_kv_tokens, prompt)
            generated = per_seq - prompt
        if params.n * per_seq > self.max_kv_tokens:
            without = "" if params.max_tokens is not None else " (no max_tokens: the whole context)"
            raise _error(f"n ({params.n}) x (prompt (about {prompt} tokens) + max_tokens "
                         f"({generated}){without}) = {params.n * per_seq} tokens exceeds the KV cache "
                         f"a request may use, {self.max_kv_tokens} tokens ({self.kv_source}); "
                         "lower n or max_tokens",
                         "max_tokens", request)
        if params.prompt_logprobs is not None:
            entries = prompt * (1 + params.prompt_logprobs)
            if entries > self.max_logprobs:
                raise _error(f"prompt (about {prompt} tokens) x (1 + prompt_logprobs "
                             f"({params.prompt_logprobs})) = {entries} logprob entries exceeds "
                             f"{self.max_logprobs} (max_request_logprobs); lower prompt_logprobs or shorten "
                             "the prompt", "prompt_logprobs", request)
        if params.logprobs is not None:
            entries = params.n * generated * (1 + params.logprobs)
            if entries > self.max_logprobs:
                raise _error(f"n ({params.n}) x max_tokens ({generated}) x (1 + top_logprobs "
                             f"({params.logprobs})) = {entries} logprob entries exceeds {self.max_logprobs} "
                             "(max_request_logprobs); lower n, max_tokens or top_logprobs",
                             "logprobs", request)


def _error(message: str, param: str, request: NormalizedRequest) -> LineError:
    return LineError(message, code=CODE, param=param, custom_id=request.custom_id)


def estimate_prompt_tokens(request: NormalizedRequest) -> int:
    """A low estimate of the request's prompt tokens, without a tokenizer."""
    if request.messages is not None:
        size = sum(len(str(m.get("content", "")).encode()) + 8 for m in request.messages)  # + role markup
        return max(size // PROMPT_BYTES_PER_TOKEN, 1)
    if isinstance(request.prompt, list):
        return len(request.prompt)
    return max(len((request.prompt or "").encode()) // PROMPT_BYTES_PER_TOKEN, 1)


def model_shape(model: str) -> ModelShape | None:
    """The KV shape of `model` from its config.json on this machine, or None when it is not here."""
    for directory in _config_dirs(model):
        path = str(directory / "config.json")
        with _SHAPES_LOCK:
            shape = _SHAPES.get(path)
        shape = shape or _read_shape(path)
        if shape is not None:
            with _SHAPES_LOCK:
                _SHAPES[path] = shape  # only found shapes: an alias converted later is read then
            return shape
    return None


_SHAPES: LRUCache[str, ModelShape] = LRUCache(maxsize=256)  # a few hundred bytes each: bounded by count
_SHAPES_LOCK = threading.Lock()  # the API ingests on several threads


def _config_dirs(model: str) -> list[Path]:
    path = Path(model).expanduser()
    # Aliases are converted into the engine's cache (engine/model_files.py cache_dir(): the same rule).
    cache = Path(os.environ.get("BATCHINFER_CACHE_DIR") or Path.home() / ".cache" / "batchinfer")
    try:
        return [path] if path.is_dir() else [cache / "models" / model] if "/" not in model else []
    except (OSError, ValueError):  # not a name a file system could hold: no local config
        return []


def _read_shape(config_path: str) -> ModelShape | None:
    try:
        with open(config_path, "rb") as handle:
            config: dict[str, Any] = json.load(handle)
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    context = config.get("max_position_embeddings")
    return ModelShape(kv_values_per_token=2 * layers * kv_heads * head_dim,
                      max_context=int(context) if isinstance(context, int) else None)
