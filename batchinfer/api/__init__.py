"""The REST API: OpenAI-compatible files and batches over the job store (see batchinfer.api.app)."""
