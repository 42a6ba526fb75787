"""The OpenAI wire format: typed models of every shape that crosses a process or storage boundary.

Two libraries, chosen per shape. The lines of input and output files, the stored requests and the worker's
rows are msgspec Structs (or TypedDicts: result_row.py): they are decoded and encoded per line, millions
per batch, and msgspec is the fastest by measurement (bench/wire_models.py). The Batch and File objects
(batch.py, file.py) are pydantic models: FastAPI serves them as `response_model`s, validates them and
documents them in the OpenAPI schema from pydantic, and there are a few per request, so speed does not
decide there.
"""
