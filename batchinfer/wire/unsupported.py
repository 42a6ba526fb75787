"""Fields of OpenAI's and vLLM's APIs that batchinfer knows but does not do, and what each one is.

A line using one is told "<what> is not supported by batchinfer" rather than told to check its spelling
(input_line.py); the values are what the message calls the feature.
"""

from __future__ import annotations

NOT_SUPPORTED_FIELDS = {
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"),
                    "tool calling"),
    **dict.fromkeys(("audio", "modalities"), "audio output"),
    "prediction": "predicted outputs", "web_search_options": "web search",
    "reasoning_effort": "reasoning effort", "verbosity": "verbosity", "stream_options": "streaming",
    "suffix": "suffix (insertion)", "best_of": "best_of",
    **dict.fromkeys(("chat_template", "continue_final_message", "add_special_tokens", "documents",
                     "mm_processor_kwargs", "use_beam_search", "length_penalty"), "this vLLM field"),
}  # fmt: skip
NOT_SUPPORTED_PARTS = {"image_url": "image input", "input_image": "image input", "input_audio": "audio input",
                       "file": "file input", "video_url": "video input"}
