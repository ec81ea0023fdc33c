"""Scripted models that call the proxy's recall tool: at once (:class:`RecallingModel`), or after words streamed
first and a wait for the client to have them (:class:`SlowRecaller`: the test that a streamed reply with recall
offered reaches the agent as it comes, and bench/first_token.py)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
from agent_upstream import AgentUpstream, chat_chunks, messages_events, request_view, responses_events
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

import context_shrink as cs
import context_shrink_wire as csw


class RecallingModel(AgentUpstream):
    """A model that calls the proxy's recall tool while it is offered, ``times`` times at most, then answers
    ``done``; it records what each recall answered."""

    def __init__(self, window: int, query: str, times: int = 1) -> None:
        super().__init__(window, [], 0)
        self.query, self.times, self.recalled = query, times, []

    def next_call(self, tools: list[Any], view: csw.ChatView | None = None) -> tuple[str, str] | None:
        if view is None:
            return None
        calls = [c for m in view.messages for c in m.get("tool_calls") or []]
        ids = {c["id"] for c in calls if c["function"]["name"] == cs.RECALL_TOOL}
        self.recalled = [cs.plain_content(m.get("content")) for m in view.messages if m.get("tool_call_id") in ids]
        if len(ids) >= self.times or not any(n == cs.RECALL_TOOL for n, _ in tools):
            return None
        return cs.RECALL_TOOL, json.dumps({"query": self.query})


PREAMBLE = "Let me look back. "


class SlowRecaller(RecallingModel):
    """A model whose streamed reply starts with a few words, then waits until the client has them (at most
    ``patience`` seconds) before it goes on: to a recall call (``times`` of them), else to its answer.
    ``in_time`` says, for each reply, whether the client had the first words while the model was still
    replying. Its events carry ``sequence_number`` (Responses) to check how a later round is renumbered."""

    def __init__(self, window: int, query: str, times: int, patience: float = 20) -> None:
        super().__init__(window, query, times)
        self.patience = patience  # seconds the model waits for the client to have its first words
        self.heard = threading.Event()  # set by the test when the client reads the first words
        self.in_time: list[bool] = []

    async def streamed(self, api: str, body: dict[str, Any]) -> StreamingResponse:
        self.log.append((api, body))
        view = request_view(api, body)
        tokens = self.over_window(view, 0)[0]
        tools = [(str(t.get("name") or (t.get("function") or {}).get("name")), {}) for t in body.get("tools") or []]
        call = self.next_call(tools, view)
        before, after = {"chat": chat_rounds, "responses": responses_rounds, "messages": messages_rounds}[api](
            call, tokens
        )

        async def events() -> AsyncIterator[str]:
            for name, data in before:
                yield sse_text(name, data)
            self.in_time.append(await anyio.to_thread.run_sync(self.heard.wait, self.patience))
            for name, data in after:
                yield sse_text(name, data)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def agent_chat(self, request: Request) -> Response:
        body = await request.json()
        return await self.streamed("chat", body) if body.get("stream") else await super().agent_chat(request)

    async def agent_responses(self, request: Request) -> Response:
        body = await request.json()
        return await self.streamed("responses", body) if body.get("stream") else await super().agent_responses(request)

    async def agent_messages(self, request: Request) -> Response:
        body = await request.json()
        return await self.streamed("messages", body) if body.get("stream") else await super().agent_messages(request)


def sse_text(name: str | None, data: Any) -> str:
    return (f"event: {name}\n" if name else "") + f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


Events = list[tuple[str | None, Any]]


def chat_rounds(call: tuple[str, str] | None, tokens: int) -> tuple[Events, Events]:
    base = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    words = {
        **base,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": PREAMBLE}, "finish_reason": None}],
    }
    rest = [{**chunk, "choices": [{**c, "delta": {k: v for k, v in c["delta"].items() if k != "role"}}
                                  for c in chunk["choices"]]} for chunk in chat_chunks(call, tokens)]  # fmt: skip
    return [(None, words)], [*((None, c) for c in rest), (None, "[DONE]")]


def responses_rounds(call: tuple[str, str] | None, tokens: int) -> tuple[Events, Events]:
    rid = f"resp_{os.urandom(4).hex()}"
    said = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": PREAMBLE, "annotations": []}]}  # fmt: skip
    _, added, done, completed = [e for _, e in responses_events(call, tokens)]
    item = added["item"]
    before = [{"type": "response.created", "response": completed["response"] | {"status": "in_progress", "output": []}},
              {"type": "response.output_item.added", "output_index": 0, "item": {**said, "content": []}},
              {"type": "response.content_part.added", "output_index": 0, "content_index": 0, "item_id": said["id"],
               "part": {"type": "output_text", "text": "", "annotations": []}},
              {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "item_id": said["id"],
               "delta": PREAMBLE},
              {"type": "response.content_part.done", "output_index": 0, "content_index": 0, "item_id": said["id"],
               "part": said["content"][0]},
              {"type": "response.output_item.done", "output_index": 0, "item": said}]  # fmt: skip
    after = [{**added, "output_index": 1}, {**done, "output_index": 1},
             {**completed, "response": {**completed["response"], "output": [said, item]}}]  # fmt: skip
    numbered = [{**e, "sequence_number": n} for n, e in enumerate(before + after)]
    return [(e["type"], e) for e in numbered[: len(before)]], [(e["type"], e) for e in numbered[len(before) :]]


def messages_rounds(call: tuple[str, str] | None, tokens: int) -> tuple[Events, Events]:
    start, block, delta, stop, end, last = list(messages_events(call, tokens))
    before = [start, ("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": PREAMBLE}}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0})]  # fmt: skip
    after = [(name, {**data, "index": 1}) for name, data in (block, delta, stop)]
    return before, [*after, end, last]
