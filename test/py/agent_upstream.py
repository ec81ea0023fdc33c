"""A scripted model behind the real coding agents (OpenCode, Codex CLI, Claude Code), on 127.0.0.1.

It answers the three wire APIs the agents speak, streamed the way each agent reads them: Chat Completions
chunks, Responses events, Anthropic Messages events. A request that carries tools is a step of the agent's
loop: for the first ``steps`` of them the model calls the agent's own file-reading tool (found by its
schema) on the next of ``files``, so the history grows by a large tool result per step; then it answers
``done``. A request without tools (a title, a topic check, the proxy's summary) gets a short summary.
Like llama.cpp, any request whose prompt is over ``window`` tokens (the cl100k count of its chat view and
tools; the reply's reserve is not counted, llama.cpp ends a reply at the window's end) is refused with
llama.cpp's own error body, and recorded.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fake_openai import FakeOpenAI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import context_shrink as cs
import context_shrink_wire as csw

Tool = tuple[str, dict[str, Any]]  # a tool's name and its JSON schema
SUMMARY = "- The user asked to read every notes file one by one.\n- The earlier files were read.\n- Next: the rest."


class AgentUpstream(FakeOpenAI):
    def __init__(self, window: int, files: list[Path], steps: int) -> None:
        super().__init__(window=window)
        self.files = files
        self.steps = steps
        self.calls = 0  # the tool calls made so far
        self.log: list[tuple[str, dict[str, Any]]] = []  # every (path, body) received, refused ones too
        self.refused: list[tuple[str, int]] = []
        self.credentials: set[str] = set()  # every Authorization and x-api-key value received
        self.app.router.routes[:0] = [
            Route("/v1/chat/completions", self.agent_chat, methods=["POST"]),
            Route("/v1/responses", self.agent_responses, methods=["POST"]),
            Route("/v1/messages", self.agent_messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
        ]
        self.counting = True  # llama.cpp's /v1/chat/completions/input_tokens answers
        self.last_request = time.monotonic()  # when the newest agent request came (a TUI's turn is over when quiet)

    # -- the model's script --------------------------------------------------------------------------------

    def next_call(self, tools: list[Tool], view: csw.ChatView | None = None) -> tuple[str, str] | None:
        """The next tool call (name, JSON arguments) of the script, or None when it is time to answer (or
        when the newest message asks for a summary: an agent compacting its session)."""
        if not tools or self.calls >= self.steps or (view is not None and reply_text(view) != "done"):
            return None
        path = str(self.files[self.calls % len(self.files)])
        self.calls += 1
        return read_call(tools, path)

    def untooled_reply(self, view: csw.ChatView) -> str:
        """The answer to a request with no tools: the proxy's summary request (a summary without the facts, as a
        mediocre local model writes it)."""
        return SUMMARY

    def check(self, path: str, view: csw.ChatView) -> tuple[int, Response | None]:
        """The prompt's size, and llama.cpp's refusal when it is over the window."""
        self.last_request = time.monotonic()
        tokens, refusal = self.over_window(view, 0)
        if refusal is not None:
            self.refused.append((path, tokens))
        return tokens, refusal

    # -- the three APIs ------------------------------------------------------------------------------------

    async def agent_chat(self, request: Request) -> Response:
        body = await request.json()
        self.log.append(("chat", body))
        self.credentials |= {v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}
        view = request_view("chat", body)
        tokens, refusal = self.check("chat", view)
        if refusal is not None:
            return refusal
        tools = [(t["function"]["name"], t["function"].get("parameters") or {}) for t in body.get("tools") or []]
        call = self.next_call(tools, view)
        chunks = list(chat_chunks(call, tokens, reply_text(view) if tools else self.untooled_reply(view)))
        if not body.get("stream"):
            message = chunks[0]["choices"][0]["delta"]  # the whole reply is in the first chunk
            finish = "tool_calls" if call else "stop"
            return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                 "usage": chunks[-1]["usage"]})  # fmt: skip
        return sse((None, chunk) for chunk in [*chunks, "[DONE]"])

    async def agent_responses(self, request: Request) -> Response:
        body = await request.json()
        self.log.append(("responses", body))
        self.credentials |= {v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}
        view = request_view("responses", body)
        tokens, refusal = self.check("responses", view)
        if refusal is not None:
            return refusal
        tools = [(t["name"], t.get("parameters") or {}) for t in body.get("tools") or [] if t.get("type") == "function"]
        events = list(responses_events(self.next_call(tools, view), tokens, reply_text(view)))
        if not body.get("stream"):
            return JSONResponse(events[-1][1]["response"])
        return sse(events)

    async def agent_messages(self, request: Request) -> Response:
        body = await request.json()
        self.log.append(("messages", body))
        self.credentials |= {v for k, v in request.headers.items() if k in ("authorization", "x-api-key")}
        view = request_view("messages", body)
        tokens, refusal = self.check("messages", view)
        if refusal is not None:
            return refusal
        tools = [(t["name"], t.get("input_schema") or {}) for t in body.get("tools") or [] if "name" in t]
        events = list(messages_events(self.next_call(tools, view), tokens, reply_text(view)))
        if not body.get("stream"):
            return JSONResponse(messages_reply(events))
        return sse(events)

    async def count_tokens(self, request: Request) -> Response:
        body = await request.json()
        tokens, _ = self.over_window(csw.messages_view({**body, "max_tokens": 0}), 0)
        return JSONResponse({"input_tokens": tokens})

    async def props(self, request: Request) -> Response:
        """llama.cpp's server properties: where the proxy learns the window."""
        return JSONResponse({"default_generation_settings": {"n_ctx": self.window}})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "test"}]})


def request_view(path: str, body: dict[str, Any]) -> csw.ChatView:
    """A logged request (``chat``, ``responses`` or ``messages``) seen as a chat request."""
    if path == "chat":
        return csw.ChatView(body["messages"], body.get("tools") or [], [None] * len(body["messages"]))
    return csw.responses_view(body) if path == "responses" else csw.messages_view(body)


def reply_text(view: csw.ChatView) -> str:
    """The model's answer when it calls no tool: a summary when the newest user message asks for one while
    telling it not to call tools (Claude Code's /compact does)."""
    users = [m for m in view.messages if m.get("role") == "user"]
    newest = str(users[-1].get("content")).lower() if users else ""
    asked = "summary" in newest and "do not call any tools" in newest
    return f"<summary>\n{SUMMARY}\n</summary>" if asked else "done"


def read_call(tools: list[Tool], path: str) -> tuple[str, str]:
    """A call that reads ``path`` with one of ``tools``: a reader with a path parameter (OpenCode's ``read``,
    Claude Code's ``Read``, Qwen Code's ``read_file``), a reader of a list of them (Cline's ``read_files``), or else
    a shell with a command parameter (Codex's ``shell`` / ``exec_command``)."""
    for name, schema in tools:
        properties = schema.get("properties") or {}
        keys = [k for k in properties if "path" in k.lower()]
        if name.lower() in ("read", "read_file", "view") and keys:
            return name, json.dumps({keys[0]: path})
        items = (properties.get("files") or {}).get("items") or {}
        if name.lower() == "read_files" and "path" in (items.get("properties") or {}):  # Cline's: a list of reads
            return name, json.dumps({"files": [{"path": path}]})
    for name, schema in tools:
        properties = schema.get("properties") or {}
        for key in ("command", "cmd"):
            if key in properties and ("shell" in name.lower() or "exec" in name.lower() or "bash" in name.lower()):
                command: Any = ["cat", path] if properties[key].get("type") == "array" else f"cat {path}"
                extra = {"description": "read the file"} if "description" in (schema.get("required") or []) else {}
                return name, json.dumps({key: command, **extra})
    raise AssertionError(f"no file-reading tool among {[name for name, _ in tools]}")


def sse(events: Any) -> StreamingResponse:
    """Server-sent events: ``(event name or None, data)`` pairs; data is JSON unless it is a string."""

    def lines() -> Iterator[str]:
        for name, data in events:
            head = f"event: {name}\n" if name else ""
            yield f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def chat_chunks(call: tuple[str, str] | None, tokens: int, text: str = "done") -> Iterator[dict[str, Any]]:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    if call:
        tool_call = {"index": 0, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                     "function": {"name": call[0], "arguments": call[1]}}  # fmt: skip
        delta: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    else:
        delta = {"role": "assistant", "content": text}
    yield {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls" if call else "stop"}]}
    usage = {"prompt_tokens": tokens, "completion_tokens": 5, "total_tokens": tokens + 5}
    yield {**base, "choices": [], "usage": usage}


def responses_events(call: tuple[str, str] | None, tokens: int, text: str = "done"
                     ) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
    rid = f"resp_{uuid.uuid4().hex[:12]}"
    if call:
        item = {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{rid}", "name": call[0],
                "arguments": call[1], "status": "completed"}  # fmt: skip
    else:
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed", "content": [part]}
    usage = {"input_tokens": tokens, "output_tokens": 5, "total_tokens": tokens + 5,
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    response = {"id": rid, "object": "response", "status": "in_progress", "model": "m", "output": []}
    yield "response.created", {"type": "response.created", "response": response}
    yield "response.output_item.added", {"type": "response.output_item.added", "output_index": 0, "item": item}
    yield "response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}
    done = {**response, "status": "completed", "output": [item], "usage": usage}
    yield "response.completed", {"type": "response.completed", "response": done}


def messages_events(
    call: tuple[str, str] | None, tokens: int, text: str = "done"
) -> Iterator[tuple[str, dict[str, Any]]]:
    message = {"id": f"msg_{uuid.uuid4().hex[:12]}", "type": "message", "role": "assistant", "model": "m",
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": tokens, "output_tokens": 1}}  # fmt: skip
    yield "message_start", {"type": "message_start", "message": message}
    if call:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:12]}", "name": call[0], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": call[1]}
    else:
        block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
    yield "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
    yield "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": 0}
    stop = {"stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None}
    yield "message_delta", {"type": "message_delta", "delta": stop, "usage": {"output_tokens": 5}}
    yield "message_stop", {"type": "message_stop"}


def messages_reply(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The non-streamed reply the events describe."""
    message = dict(events[0][1]["message"])
    block = dict(events[1][1]["content_block"])
    delta = events[2][1]["delta"]
    if block["type"] == "tool_use":
        block["input"] = json.loads(delta["partial_json"])
    else:
        block["text"] = delta["text"]
    return {**message, "content": [block], "stop_reason": events[4][1]["delta"]["stop_reason"]}


def fixed_tokens(path: str, body: dict[str, Any], task: str) -> int:
    """What an agent sends before the task's first word: its system prompt, its standing messages and every one
    of its tool definitions (all kinds: Codex's ``namespace`` and ``web_search`` too, as JSON), in cl100k tokens."""
    view = request_view(path, body)
    tokenizer = cs.resolve_tokenizer("tiktoken")
    counted = cs.count_messages(view.messages, tokenizer)[1] - tokenizer.count(task)
    return counted + tokenizer.count(json.dumps(body.get("tools") or [], separators=(",", ":")))
