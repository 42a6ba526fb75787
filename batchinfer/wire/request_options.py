"""Per-request options of a line that are not sampling: how the prompt is built and the output shown.

`echo` (completions: the prompt text is prepended to each output text), `add_generation_prompt` and
`chat_template_kwargs` (chat: passed to the tokenizer's chat template) have vLLM's OpenAI-server meaning.
They travel in the requests table's payload as "options" beside the SamplingParams, which stays what
the sampler reads; `read_request_options` checks them once, at ingest.
"""

from __future__ import annotations

from batchinfer.wire.json_types import JSONObject
from batchinfer.wire.request import RequestOptions

CHAT_OPTION_FIELDS = frozenset({"add_generation_prompt", "chat_template_kwargs"})
COMPLETION_OPTION_FIELDS = frozenset({"echo"})
REQUEST_OPTION_FIELDS = CHAT_OPTION_FIELDS | COMPLETION_OPTION_FIELDS
# apply_chat_template arguments the runner sets itself: a line may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt", "return_dict",
                                      "tokenizer_kwargs", "chat_template", "continue_final_message"})


class RequestOptionError(ValueError):
    """A request option with a bad value: `field` is its name, `message` the rule and the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def read_request_options(body: JSONObject) -> RequestOptions | None:
    """The options the body sets (None when it sets none, the common case), checked; values at their
    defaults (echo false, add_generation_prompt true, chat_template_kwargs {}) are left out. Which
    endpoint may use which option is input_line.py's field sets' rule."""
    if body.keys().isdisjoint(REQUEST_OPTION_FIELDS):
        return None
    options: RequestOptions = {}
    echo, add_generation_prompt = _flag(body, "echo"), _flag(body, "add_generation_prompt")
    if echo:  # kept only when not the default
        options["echo"] = echo
    if add_generation_prompt is False:
        options["add_generation_prompt"] = False
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise RequestOptionError("chat_template_kwargs",
                                     f"must be an object of template variables; got {kwargs!r:.80}")
        reserved = sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise RequestOptionError(f"chat_template_kwargs.{reserved[0]}",
                                     "is set by batchinfer; remove it (use add_generation_prompt at the "
                                     "top level of the body)" if reserved[0] == "add_generation_prompt"
                                     else "is set by batchinfer; remove it")
        if kwargs:
            options["chat_template_kwargs"] = kwargs
    return options or None


def _flag(body: JSONObject, name: str) -> bool | None:
    """A boolean option's value (None: not given), or RequestOptionError."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestOptionError(name, f"must be true or false; got {value!r:.80}")
    return value
