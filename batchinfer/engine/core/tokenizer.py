"""TextTokenizer: the part of a transformers tokenizer the engine's text paths call.

The engine runs on a transformers tokenizer; its detokenizer, prompt checks, bad words and logprob texts
call only these methods, so they name this Protocol (tests pass small fakes). xgrammar reads the whole
tokenizer (its vocabulary and decoder), so structured output names transformers' class instead.
"""

from __future__ import annotations

from typing import Protocol


class TextTokenizer(Protocol):
    """encode / decode / batch_decode, with the keyword arguments the engine passes."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]:
        """The token ids of `text`."""
        ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool = ..., spaces_between_special_tokens: bool = ...) -> str:
        """The text of `token_ids`."""
        ...

    def batch_decode(self, sequences: list[list[int]]) -> list[str]:
        """The text of each token id list."""
        ...
