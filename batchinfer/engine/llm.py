"""The offline API: LLM(model, **engine options).generate(prompts) / .chat(conversations) / .embed(texts).

vLLM's habits: a prompt is a string, token ids, or a dict ({"prompt": ...} / {"prompt_token_ids": ...});
a tqdm progress bar over finished requests goes to stderr unless use_tqdm=False. It runs an Engine to
completion over a whole batch: prompts are admitted in a prefix-aware order (sorted by token ids, so
prompts sharing a prefix reuse each other's KV blocks), and outputs come back in input order.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypedDict, cast

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.llm_engine import Engine
from batchinfer.engine.lora.request import LoRARequest
from batchinfer.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from batchinfer.engine.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's text prompt: {"prompt": "..."}."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-id prompt: {"prompt_token_ids": [...]}."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


class LLM:
    """Offline batch inference: LLM(model, **engine options).generate(prompts, sampling_params)."""

    _ids = itertools.count()

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        unknown = sorted(set(engine_kwargs) - set(EngineConfig.field_names()))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: unknown engine option; valid: {EngineConfig.field_names()}"
            )
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        lora_request (enable_lora): the adapter of every prompt, or one per prompt (None: the base model).
        """
        texts, token_ids = self._prompts(prompts)
        outputs = self._run(token_ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def embed(self, prompts: PromptType | list[PromptType], *, use_tqdm: bool = True
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's mean-pooled, L2-normalised last hidden state, in input order (vLLM's LLM.embed).

        The prompts run in packed batches (ModelRunner.embed), a step budget of tokens per forward."""
        _, token_ids = self._prompts(prompts)
        outputs = []
        with _progress(len(token_ids), enabled=use_tqdm, what="Embedding prompts") as advance:
            vectors, _ = self.engine.embed(token_ids, label="prompts")
            for ids, vector in zip(token_ids, vectors, strict=True):
                request_id = f"embed-{next(self._ids)}"
                outputs.append(EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), ids))
                advance()
        return outputs

    def _prompts(self, prompts: PromptType | list[PromptType]) -> tuple[list[str | None], list[list[int]]]:
        """(each prompt's text or None, its token ids); ValueError naming prompts[i] and the field."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if not isinstance(prompts, list | tuple):
            raise ValueError(f"prompts: must be a prompt or a list of prompts; got {type(prompts).__name__}")
        texts: list[str | None] = []
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                text, ids = _prompt_fields(prompt)
                token_ids.append(self.engine.tokenize(cast(str, text) if ids is None else ids))  # one is set
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
            texts.append(text)
        return texts, token_ids

    def chat(
        self,
        messages: list[dict[str, object]] | list[list[dict[str, object]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, object] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate (lora_request: as
        generate's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model: {self.engine.config.model!r} has no chat template; use generate()")
        texts = [
            tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template already holds BOS and friends: encode without adding them again.
        token_ids = [self.engine.tokenize(text, add_special_tokens=False) for text in texts]
        outputs = self._run(token_ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def _run(
        self,
        token_ids: list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        *,
        use_tqdm: bool,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(lora_request, list):
            if len(lora_request) != len(token_ids):
                raise ValueError(f"lora_request: {len(lora_request)} given for {len(token_ids)} prompts; "
                                 "pass one, or one per prompt")
            loras = lora_request
        else:
            loras = [lora_request] * len(token_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(token_ids):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(token_ids)} prompts; "
                    "pass one, or one per prompt"
                )
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(token_ids)

        # Prefix-aware order, computed once: prompts sorted by token ids, so prompts sharing a prefix are
        # admitted next to each other and hit each other's blocks. FCFS afterwards, so nobody starves.
        order = sorted(range(len(token_ids)), key=token_ids.__getitem__)
        request_ids = {i: f"llm-{next(self._ids)}" for i in order}
        added: list[str] = []
        try:
            for i in order:
                self.engine.add_request(request_ids[i], token_ids[i], params_list[i], lora_request=loras[i])
                added.append(request_ids[i])
        except ValueError as exc:
            for request_id in added:
                self.engine.abort(request_id)
            raise ValueError(f"prompts[{i}]: {exc}") from None

        wanted = set(added)
        results: dict[str, RequestOutput] = {}
        with _progress(len(added), enabled=use_tqdm) as advance:
            while len(results) < len(added):
                if not self.engine.has_unfinished():
                    raise RuntimeError("engine drained before every request finished")
                for output in self.engine.step():
                    if output.request_id in wanted:
                        results[output.request_id] = output
                        advance()
        return [results[request_ids[i]] for i in range(len(token_ids))]


def _prompt_fields(prompt: object) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt, exactly one of them set; ValueError naming what is wrong."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list):
        return None, prompt
    if not isinstance(prompt, dict):
        raise ValueError(f"must be a string, a list of token ids, {{'prompt': ...}} or {{'prompt_token_ids': "
                         f"...}}; got {type(prompt).__name__}")
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"{', '.join(map(str, unknown))}: not supported by batchinfer; a prompt dict holds "
                         "'prompt' or 'prompt_token_ids'")
    if "prompt_token_ids" in prompt:  # vLLM: the ids win when both are given
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"prompt_token_ids: must be a list of token ids; got {type(ids).__name__}")
        return prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None, ids
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"prompt: must be a string; got {type(text).__name__}")
    return text, None


@contextmanager
def _progress(total: int, *, enabled: bool, what: str = "Processed prompts") -> Iterator[Callable[[], None]]:
    """A tqdm progress bar over finished requests on stderr (vLLM's), or a no-op."""
    if not enabled:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=what, unit="req", file=sys.stderr, dynamic_ncols=True) as bar:
        yield lambda: bar.update(1)
