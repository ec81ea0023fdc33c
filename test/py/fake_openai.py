"""A scriptable OpenAI-compatible server on 127.0.0.1, for what a real model cannot be made to do on demand.

Each request is checked against the server's window (cl100k count of the messages plus ``max_tokens``):
an oversized one is refused with a vLLM-style 400 and recorded. Replies follow a script of behaviours,
then the default: ``ok`` (a short summary), ``429`` (with Retry-After), ``500``, ``garbage`` (not JSON),
``hang`` (no reply for 30 s), ``empty``, ``tool_call`` (no text), ``overflow_openai`` (an OpenAI-style
context_length_exceeded body), ``repeat`` (one sentence looped), ``copy`` (the transcript handed back),
``cut`` (stopped by max_tokens mid-sentence) and ``echo_key`` (a 401 quoting the Authorization header).
Every request also waits ``latency`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from tiny_llama import free_port

import context_shrink as cs
import context_shrink_wire as csw


class FakeOpenAI:
    def __init__(
        self, window: int = 4096, latency: float = 0.0, script: list[str] | None = None, fill: float = 0.0
    ) -> None:
        self.window = window
        self.latency = latency
        self.fill = fill  # a summary this share of max_tokens long (0: one short line)
        self.script = list(script or [])
        self.default = "ok"
        self.requests: list[dict[str, Any]] = []
        self.oversized: list[int] = []
        self.active = 0
        self.max_active = 0
        self.tokenizer = cs.resolve_tokenizer("tiktoken:cl100k_base")
        self.usage_ratio: float | None = None  # when set, replies report usage.prompt_tokens = ratio x our count
        self.render_tools = True  # False: a chat template that drops the tools (SmolLM2's), in counts and refusals
        self.counting = False  # True: llama.cpp's /v1/chat/completions/input_tokens answers
        self.counted: list[dict[str, Any]] = []  # the bodies of the count requests answered
        self.responses_requests: list[dict[str, Any]] = []  # Responses API bodies received
        self.anthropic_requests: list[dict[str, Any]] = []  # Anthropic Messages bodies received
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/messages", self.anthropic, methods=["POST"]),
            ]
        )

    def over_window(self, view: csw.ChatView, reserve: int) -> tuple[int, Response | None]:
        """A request of another wire API read through its chat view, as llama.cpp reads it: its size, and
        llama.cpp's own refusal when it is over the window."""
        tokens = self.count_prompt(view.messages) + reserve + self.count_tools({"tools": view.tools})
        if tokens <= self.window:
            return tokens, None
        self.oversized.append(tokens)
        error = {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": tokens, "n_ctx": self.window,
                 "message": f"request ({tokens} tokens) exceeds the available context size ({self.window} tokens), "
                 "try increasing it"}  # fmt: skip
        return tokens, JSONResponse({"error": error}, 400)

    async def responses(self, request: Request) -> Response:
        """The Responses API as llama.cpp serves it; a reply with ``usage.input_tokens``."""
        body = await request.json()
        self.responses_requests.append(body)
        if body.get("previous_response_id"):  # the earlier turns are held here: nothing to count
            body = {**body, "previous_response_id": None}
        # csw.responses_view raises on what it does not understand: a test failure
        tokens, refusal = self.over_window(csw.responses_view(body), int(body.get("max_output_tokens") or 0))
        if refusal is not None:
            return refusal
        text = {"type": "output_text", "text": "done", "annotations": []}
        output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": [text]}]
        usage = {"input_tokens": tokens, "output_tokens": 1, "total_tokens": tokens + 1}
        return JSONResponse(
            {"id": "resp_1", "object": "response", "status": "completed", "output": output, "usage": usage}
        )

    async def anthropic(self, request: Request) -> Response:
        """The Anthropic Messages API as llama.cpp serves it; a reply with ``usage.input_tokens``."""
        body = await request.json()
        self.anthropic_requests.append(body)
        tokens, refusal = self.over_window(csw.messages_view(body), int(body.get("max_tokens") or 0))
        if refusal is not None:
            return refusal
        usage = {"input_tokens": tokens, "output_tokens": 1}
        return JSONResponse({"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": "end_turn",
                             "content": [{"type": "text", "text": "done"}], "usage": usage})  # fmt: skip

    def count_prompt(self, messages: list[dict[str, Any]]) -> int:
        """The server's count of the messages (cl100k, OpenAI's overheads)."""
        return cs.count_messages(messages, self.tokenizer)[1]

    def count_tools(self, body: dict[str, Any]) -> int:
        return cs.count_tools(body.get("tools") or [], self.tokenizer) if self.render_tools else 0

    async def input_tokens(self, request: Request) -> Response:
        if not self.counting:
            return JSONResponse({"error": {"message": "Not Found", "code": 404}}, 404)
        body = await request.json()
        self.counted.append(body)
        return JSONResponse({"input_tokens": self.count_prompt(body["messages"]) + self.count_tools(body)})

    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        body = await request.json()
        tokens = self.count_prompt(body["messages"]) + int(body.get("max_tokens") or 0)
        tokens += self.count_tools(body)
        self.requests.append({"body": body, "tokens": tokens, "auth": request.headers.get("authorization"), "raw": raw})
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.latency)
            if tokens > self.window:
                self.oversized.append(tokens)
                message = (
                    f"This model's maximum context length is {self.window} tokens. However, you requested "
                    f"{int(body.get('max_tokens') or 0)} output tokens and your prompt contains {tokens} input "
                    f"tokens, for a total of {tokens} tokens."
                )
                return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, 400)
            behaviour = self.script.pop(0) if self.script else self.default
            if behaviour == "echo_key":  # a server that quotes the key it refused
                message = f"Incorrect API key provided: {request.headers.get('authorization')}"
                return JSONResponse({"error": {"message": message}}, 401)
            self.max_tokens = int(body.get("max_tokens") or 0)
            self.last_user = str(body["messages"][-1].get("content"))
            self.prompt_tokens = cs.count_messages(body["messages"], self.tokenizer)[1]
            return await self.reply(behaviour, len(self.requests))
        finally:
            self.active -= 1

    async def reply(self, behaviour: str, n: int) -> Response:
        if behaviour == "429":
            return JSONResponse({"error": {"message": "Rate limit reached"}}, 429, headers={"Retry-After": "0"})
        if behaviour == "500":
            return JSONResponse({"error": {"message": "internal error"}}, 500)
        if behaviour == "garbage":
            return PlainTextResponse("<html>bad gateway</html>", 200)
        if behaviour == "hang":
            await asyncio.sleep(30)
        if behaviour == "overflow_openai":
            body = {
                "error": {
                    "message": "This model's maximum context length is 1000 tokens. However, your messages "
                    "resulted in 5000 tokens. Please reduce the length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
            return JSONResponse(body, 400)
        text = f"- summary {n}: the goal, files touched, next steps"
        if self.fill:  # about eight tokens a line
            text += "".join(f"\n- fact {k} of summary {n}" for k in range(int(self.fill * self.max_tokens / 8)))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if behaviour == "empty":
            message["content"] = ""
        if behaviour == "repeat":  # a small model looping on one sentence
            message["content"] = "- The parser was fixed. " + "The tests pass now. " * 12
        if behaviour == "copy":  # the transcript handed back instead of a summary
            message["content"] = self.last_user
        finish = "stop"
        if behaviour == "cut":  # stopped by max_tokens in the middle of a sentence
            message["content"], finish = "- The user wants the parser fixed and the tests to", "length"
        if behaviour == "tool_call":
            message = {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {"name": "f"}}]}
        reply: dict[str, Any] = {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}
        if self.usage_ratio is not None:
            reply["usage"] = {"prompt_tokens": round(self.usage_ratio * self.prompt_tokens), "completion_tokens": 9}
        return JSONResponse(reply)


@contextlib.contextmanager
def serve(fake: FakeOpenAI) -> Iterator[str]:
    """Run ``fake`` on 127.0.0.1 in a thread; yields its base URL (``.../v1``)."""
    port = free_port()
    config = uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the fake OpenAI server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
