"""Helpers for the API tests: a real uvicorn server in a thread, JSONL builders, a fixed-output worker."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from batchinfer.store.shards import claim_shard, complete_shard, pending_requests, write_results


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-test")
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def chat_line(custom_id: str, content: str, *, max_tokens: int = 4, url: str = "/v1/chat/completions",
              **body: Any) -> bytes:
    """One OpenAI batch input line for the chat endpoint."""
    payload = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **body}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


def completion_line(custom_id: str, prompt: str, *, max_tokens: int = 4) -> bytes:
    """One OpenAI batch input line for the completions endpoint."""
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": prompt, "max_tokens": max_tokens}})


def jsonl(lines: list[bytes]) -> bytes:
    """Lines joined into a JSONL document."""
    return b"\n".join(lines) + b"\n"


class FixedOutputWorker:
    """Claims shards from the DB through the store's lease functions and answers every request with a fixed,
    request-dependent text. Used where the test is about the API, not the engine."""

    def __init__(self, factory: sessionmaker[Session], *, model: str, delay_s: float = 0.0) -> None:
        self.factory = factory
        self.model = model
        self.delay_s = delay_s
        self.stop = threading.Event()
        self.done_requests = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="fixed-output-worker")

    def __enter__(self) -> FixedOutputWorker:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=15)

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.factory() as session:
                lease = claim_shard(session, worker_id="fixed-output", model=self.model, lease_seconds=60)
                if lease is None:
                    session.close()
                    self.stop.wait(0.02)
                    continue
                for request in pending_requests(session, shard_id=lease.shard_id):
                    if self.stop.wait(self.delay_s) and self.delay_s:
                        return
                    result = {"request_id": request.request_id, "prompt_tokens": 3, "completion_tokens": 2,
                              "cached_tokens": 0,
                              "choices": [{"text": f"echo:{request.custom_id}", "finish_reason": "stop"}]}
                    write_results(session, shard_id=lease.shard_id, lease_token=lease.lease_token,
                                  results=[result])
                    self.done_requests += 1
                complete_shard(session, shard_id=lease.shard_id, lease_token=lease.lease_token)


def key_maker(factory: Any) -> Any:
    """make(name, owner=None) -> (plaintext, key id): creates API keys in `factory`'s database."""
    from batchinfer.store.apikeys import create_key

    def make(name: str, owner: str | None = None) -> tuple[str, int]:
        with factory() as session:
            plaintext, row = create_key(session, name=name, owner=owner)
            return plaintext, row.id

    return make
