"""The engine prompt of a stored request: its text prompt, or its chat messages through the model's
chat template (tokenized once here), and that prompt as text again for `echo`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchinfer.store.shards import PendingRequest

if TYPE_CHECKING:
    from batchinfer.engine.llm_engine import Engine


def engine_prompt(engine: Engine, request: PendingRequest) -> str | list[int]:
    """What `engine.add_request` gets for `request`: the prompt, or the templated messages' token ids."""
    if request.messages is None:
        assert request.prompt is not None
        return request.prompt
    options = request.options or {}  # add_generation_prompt, chat_template_kwargs: wire/request_options.py
    text = engine.tokenizer.apply_chat_template(
        request.messages, add_generation_prompt=options.get("add_generation_prompt", True),
        tokenize=False, **options.get("chat_template_kwargs", {}))
    # The template already holds the special tokens (BOS); tokenizing must not add them again.
    return engine.tokenize(text, add_special_tokens=False)


def prompt_text(engine: Engine, prompt: str | list[int]) -> str:
    """The prompt as text, for echo (vLLM: a token-id prompt is decoded)."""
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
