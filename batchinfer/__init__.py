"""batchinfer: batch LLM inference."""

__version__ = "0.1.0"
