"""Upstreams the proxy and the tools are tested against: a recorder of requests, the proxy in front of an
upstream in this process, and a server that answers with raw bytes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fake_openai import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tiny_llama import free_port

import context_shrink as cs
import context_shrink_proxy as csp

SECRET = "sk-SECRET-123"


PROXY_KEY = "sk-PROXYKEY-123"


SUMMARY = {
    "choices": [{"message": {"content": "- the user asked for a fix; tests were run."}, "finish_reason": "stop"}]
}


class Recorder:
    """An upstream that records every request's headers and answers with ``answer(request, body)``."""

    def __init__(self, answer: Any = None) -> None:
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self.answer = answer or (lambda request, body: JSONResponse(SUMMARY))
        self.app = Starlette(routes=[Route("/{path:path}", self.endpoint, methods=["GET", "POST"])])

    async def endpoint(self, request: Request) -> Response:
        self.headers.append(dict(request.headers))
        self.paths.append(request.url.path)
        return self.answer(request, await request.body())


@contextlib.contextmanager
def proxied(upstream: str, **settings: Any) -> Iterator[str]:
    config = csp.ProxyConfig(upstream=upstream, archive_dir=None, **{"state": "memory", **settings})
    app = csp.build_proxy(config, cs.resolve_tokenizer("tiktoken:cl100k_base"))
    with serve(types.SimpleNamespace(app=app)) as url:
        yield url


@contextlib.contextmanager
def raw_upstream(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> Iterator[str]:
    """A server that answers with raw bytes, as ``handle`` writes them (a thread, its own event loop)."""
    port = free_port()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        server.close()
