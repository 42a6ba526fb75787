"""Incremental detokenization (vLLM's prefix/read offsets) and stop-string matching.

Decoding one token alone is wrong for most tokenizers: SentencePiece drops the leading space of the
first token, and a byte-level BPE token may hold half of a multi-byte character. So each new token is
decoded inside a small window of the previous tokens:

    prefix_text = decode(ids[prefix_offset:read_offset])     text already emitted for that window
    full_text   = decode(ids[prefix_offset:])                the window plus the unread tokens
    new text    = full_text[len(prefix_text):]

If full_text ends in U+FFFD (an incomplete UTF-8 sequence) nothing is emitted and the offsets stay, so
the next token completes the character. The window starts on the last prompt tokens, so the first
output token is decoded with its left context too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchinfer.engine.sampling.stop_matcher import stop_matcher
from batchinfer.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchinfer.engine.core.tokenizer import TextTokenizer

INITIAL_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context of the first output token


def _rust_backend(tokenizer: TextTokenizer) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a fast tokenizer whose decode is transformers' own, else None.

    Its decode(ids, skip_special_tokens) is exactly what transformers' fast decode returns with
    clean_up_tokenization_spaces=False, without the Python wrapping around it (about half the cost of
    the per-token detokenization). A subclass that overrides decode keeps the slow, faithful path.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):
        return tokenizer.backend_tokenizer
    return None


class IncrementalDetokenizer:
    """The output text of one sequence, grown token by token, with stop strings applied."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        num_prompt_tokens: int,
        params: SamplingParams,
        *,
        token_texts: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = _rust_backend(tokenizer)
        # decode([token]) by token id (fast tokenizers). Valid for one tokenizer and one skip_special_tokens
        # value, so an engine shares one dict per value between its sequences. In steady decoding the prefix
        # window is the one previous token: this saves one of the two decodes per token.
        self._token_texts = {} if token_texts is None else token_texts
        self.params = params
        self.output_text = ""
        self.prefix_offset = max(num_prompt_tokens - INITIAL_CONTEXT_TOKENS, 0)
        self.read_offset = num_prompt_tokens
        assert isinstance(params.stop, list)
        self.stop = params.stop
        self._stops = stop_matcher(tuple(self.stop)) if self.stop else None
        self._stop_state = 0  # the automaton's state after the whole output text (stop_matcher.py)
        # While running, hold back as many characters as could start a stop string, so a streamed text
        # never shows a stop string that is later cut off.
        longest = self._stops.longest if self._stops is not None else 0
        self._hold_back = 0 if params.include_stop_str_in_output else max(longest - 1, 0)

    def update(self, token_ids: list[int], *, stop_terminated: bool, check_stop: bool) -> str | None:
        """Decode the last token of `token_ids`; returns the stop string matched (text then cut), or None.

        stop_terminated: the last token is EOS / a stop token id that ends the sequence; its text is left
        out unless include_stop_str_in_output. check_stop: stop strings apply (min_tokens reached).
        """
        if stop_terminated and not self.params.include_stop_str_in_output:
            return None
        prefix_offset, read_offset = self.prefix_offset, self.read_offset
        backend = self._backend
        if backend is not None and read_offset - prefix_offset == 1:
            # The steady state, inlined (this runs per sequence per step): one token of left context,
            # whose text is cached, and one direct Rust decode.
            skip = self.params.skip_special_tokens
            token_id = token_ids[prefix_offset]
            prefix_text = self._token_texts.get(token_id)
            if prefix_text is None:
                prefix_text = backend.decode([token_id], skip_special_tokens=skip)
                self._token_texts[token_id] = prefix_text
            full_text = backend.decode(token_ids[prefix_offset:], skip_special_tokens=skip)
            if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
                return None  # nothing printable yet: keep the offsets and wait for more tokens
            self.prefix_offset, self.read_offset = read_offset, len(token_ids)
            new_text = full_text[len(prefix_text) :]
        else:
            new_text = self._decode_new_text(token_ids)
        if not new_text:
            return None
        self.output_text += new_text
        if self._stops is None:
            return None
        return self._apply_stop_strings(new_text, check_stop)

    def text(self, *, finished: bool) -> str:
        """Text to show: all of it once finished, else without a possible partial stop string at the end."""
        if finished or not self._hold_back:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self._hold_back, 0)]

    def _decode_new_text(self, token_ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        prefix_text = self._decode(token_ids[self.prefix_offset : self.read_offset], skip)
        full_text = self._decode(token_ids[self.prefix_offset :], skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing printable yet: keep the offsets and wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if not token_ids:
            return ""
        if self._backend is not None:  # called per sequence per step: straight to Rust
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def _apply_stop_strings(self, new_text: str, check_stop: bool) -> str | None:
        """Feed the new text to the stop automaton (always, so matches may start in text before
        min_tokens); when checking, cut the output at the earliest stop string ending in the new text."""
        assert self._stops is not None
        self._stop_state, found = self._stops.scan(self._stop_state, new_text)
        if found is None or not check_stop:
            return None
        text = self.output_text
        offset, stop = found
        index = len(text) - len(new_text) + offset
        cut = index + len(stop) if self.params.include_stop_str_in_output else index
        self.output_text = text[:cut]
        return stop
