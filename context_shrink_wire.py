"""context_shrink_wire: the Responses API and Anthropic Messages seen as chat, and written back.

A companion of :mod:`context_shrink` (it imports the core; the core never imports it at load time). Each wire
API is one :class:`Wire`: a view of its request body as the chat messages the core shrinks
(:class:`ChatView`), the body written back from the shrunk messages, its overflow and usage fields, and the
recall tool in its own shape. Pure: no I/O. The proxy (:mod:`context_shrink_proxy`) and the sessions of Codex
CLI and Claude Code (:mod:`context_shrink_sessions`) use it.
"""

from __future__ import annotations

__all__ = [
    "WIRES",
    "ChatView",
    "chat_content",
    "messages_body",
    "messages_view",
    "recall_lines",
    "responses_body",
    "responses_view",
]


import bisect
import collections
import dataclasses
import json
import re
from collections.abc import (
    Callable,
    Mapping,
    Sequence,
)
from typing import Any, Protocol

from context_shrink import (
    LEDGER_MARKER,
    RECALL_TOOL,
    SUMMARY_MARKER,
    SYSTEM_ROLES,
    ContextShrinkError,
    assistant_message,
    fingerprint,
    json_or,
    plain_content,
    pseudo_tool,
    tool_call,
    validate_messages,
    validate_tools,
)

# =============================================================================
# 2. The Responses API and Anthropic Messages seen as chat (pure): views, bodies, the recall tool
# =============================================================================


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Content parts as chat content: text parts only are their text (joined by newlines, as the core's
    ``plain_content`` reads them); with an image, the parts."""
    if all(p.get("type") == "text" for p in parts):
        return "\n".join(p.get("text", "") for p in parts)
    return parts


# --- the Responses API (Codex CLI): its input items seen as chat messages, and written back --------------


@dataclasses.dataclass
class ChatView:
    """A request of another wire API seen as a chat request: ``messages`` and ``tools`` in the chat shape,
    and for each message where it came from in the original body (``origins``: for the Responses API the
    indices of its input items, for Anthropic Messages the index of its message; -1 is the instructions or
    system field)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    origins: list[Any]

    def matcher(self) -> Callable[[Mapping[str, Any]], Any]:
        """Called on the shrunk messages in order: the origin of one the pipeline left as it was, else None."""
        unchanged: dict[str, collections.deque[Any]] = collections.defaultdict(collections.deque)
        for message, origin in zip(self.messages, self.origins, strict=True):
            unchanged[fingerprint(message)].append(origin)

        def origin(message: Mapping[str, Any]) -> Any:
            found = unchanged.get(fingerprint(message))
            return found.popleft() if found else None

        return origin


def _chat_parts(content: Any) -> str | list[dict[str, Any]]:
    """Responses content (a string or typed parts) in the chat shape; a part it does not know raises."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ContextShrinkError(f"message content must be text or a list of parts, got {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url") or "", "detail": "auto"}})
        else:
            raise ContextShrinkError(f"content part type {kind!r} is not understood")
    return parts


def responses_view(body: Mapping[str, Any]) -> ChatView:
    """The chat view of a Responses request body (a reasoning item travels with the item after it). Raises
    :class:`ContextShrinkError` naming what it does not understand, or when the request continues a stored
    response (``previous_response_id``: the server holds the earlier turns); such a request is relayed as
    it is."""
    if body.get("previous_response_id"):
        raise ContextShrinkError("it continues a stored response (previous_response_id): the server holds the rest")
    items = body.get("input")
    items = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ContextShrinkError("input must be text or a list of items")
    messages: list[dict[str, Any]] = []
    origins: list[list[int]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
        origins.append([-1])
    pending: list[int] = []  # reasoning items, waiting for the item they precede
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            pending.append(i)
            continue
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}  # fmt: skip
            if messages and messages[-1].get("tool_calls") and items[origins[-1][-1]].get("type") == "function_call":
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant message, as in chat
                origins[-1] += [*pending, i]
                pending = []
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _chat_parts(output)})  # fmt: skip
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": _chat_parts(item.get("content"))})
        else:
            raise ContextShrinkError(f"input item type {kind!r} is not understood")
        origins.append([*pending, i])
        pending = []
    if pending and origins:
        origins[-1] += pending
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             if t.get("type") == "function" else pseudo_tool(t)
             for t in body.get("tools") or [] if isinstance(t, dict)]  # fmt: skip
    return ChatView(validate_messages(messages), tools, origins)


def _as_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat message the pipeline wrote or changed (a summary, a cleared result), as Responses items."""
    if message.get("role") == "tool":
        return [{"type": "function_call_output", "call_id": message.get("tool_call_id"),
                 "output": plain_content(message.get("content"))}]  # fmt: skip
    items = []
    if text := plain_content(message.get("content")):
        kind = "output_text" if message.get("role") == "assistant" else "input_text"
        items.append({"type": "message", "role": message.get("role"), "content": [{"type": kind, "text": text}]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        items.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                      "arguments": function.get("arguments") or ""})  # fmt: skip
    return items


def responses_body(body: Mapping[str, Any], view: ChatView, sent: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``body`` with ``sent`` (the shrunk chat messages) written back as its input: a message the pipeline
    left as it was goes out as the very items it came from; a changed or new one in the Responses shape."""
    items = body["input"] if isinstance(body["input"], list) else [{"type": "message", "role": "user",
                                                                     "content": body["input"]}]  # fmt: skip
    origin_of = view.matcher()
    out: dict[str, Any] = {k: v for k, v in body.items() if k != "instructions"}
    written: list[dict[str, Any]] = []
    for message in sent:
        origin = origin_of(message)
        if origin == [-1]:
            out["instructions"] = body["instructions"]
        elif origin is not None:
            written += [items[i] for i in origin]
        else:
            written += _as_items(message)
    return {**out, "input": written}


# --- the Anthropic Messages API (Claude Code): its messages seen as chat messages, and written back -------


def _anthropic_parts(content: Any) -> list[dict[str, Any]]:
    """Text and image blocks in the chat shape; a block type it does not know raises."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise ContextShrinkError(f"content must be text or a list of blocks, got {type(content).__name__}")
    parts = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            source = block.get("source") or {}
            url = source.get("url") or f"data:{source.get('media_type')};base64,{source.get('data', '')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ContextShrinkError(f"content block type {kind!r} is not understood")
    return parts


def _anthropic_message(i: int, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages one Anthropic message stands for."""
    role, content = message.get("role"), message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if role not in ("user", "assistant", "system") or not isinstance(blocks, list):
        raise ContextShrinkError(f"messages[{i}] must be a user, assistant or system message with content")
    if role == "system":  # Claude Code sends its environment so, between the turns
        return [{"role": "system", "content": chat_content(_anthropic_parts(blocks))}]
    if role == "assistant":
        known = {"text", "tool_use", "thinking", "redacted_thinking"}
        if unknown := [b.get("type") for b in blocks if not isinstance(b, dict) or b.get("type") not in known]:
            raise ContextShrinkError(f"content block type {unknown[0]!r} is not understood")
        text = plain_content([b for b in blocks if b.get("type") == "text"])
        calls = [tool_call(b.get("id"), b.get("name"), json.dumps(b.get("input") or {}, ensure_ascii=False))
                 for b in blocks if b.get("type") == "tool_use"]  # fmt: skip
        thinking = "\n".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
        return [assistant_message(text, calls, thinking if thinking.strip("\n") else "")]
    results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
    rest = [b for b in blocks if not (isinstance(b, dict) and b.get("type") == "tool_result")]
    out_messages: list[dict[str, Any]] = []
    for block in results:
        content = block.get("content")
        content = content if isinstance(content, str) else chat_content(_anthropic_parts(content or []))
        out_messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
    if rest:
        out_messages.append({"role": "user", "content": chat_content(_anthropic_parts(rest))})
    return out_messages


def messages_view(body: Mapping[str, Any]) -> ChatView:
    """The chat view of an Anthropic Messages request body: the ``system`` field first; a user message's
    ``tool_result`` blocks become tool messages, its other blocks one user message; an assistant message's
    ``tool_use`` blocks become tool calls, its thinking reasoning. Raises :class:`ContextShrinkError` naming
    what it does not understand (such a request is relayed as it is)."""
    if not isinstance(body.get("messages"), list):
        raise ContextShrinkError("messages must be a list")
    messages: list[dict[str, Any]] = []
    origins: list[int] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": system if isinstance(system, str) else _anthropic_parts(system)})
        origins.append(-1)
    for i, message in enumerate(body["messages"]):
        if not isinstance(message, dict):
            raise ContextShrinkError(f"messages[{i}] must be an object")
        converted = _anthropic_message(i, message)
        messages += converted
        origins += [i] * len(converted)
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
              "parameters": t.get("input_schema") or {}}}
             if t.get("type") in (None, "custom") and "input_schema" in t else pseudo_tool(t)
             for t in body.get("tools") or [] if isinstance(t, dict)]  # fmt: skip
    return ChatView(validate_messages(messages), tools, origins)


def _anthropic_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat message the pipeline wrote or changed, as Anthropic content blocks."""
    if message.get("role") == "tool":
        return [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                 "content": plain_content(message.get("content"))}]  # fmt: skip
    blocks: list[dict[str, Any]] = []
    if text := plain_content(message.get("content")):
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = json_or(function.get("arguments") or "{}")
        if arguments is None:  # not JSON (or too deep to read): kept as the text it is
            arguments = {"arguments": function.get("arguments")}
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                       "input": arguments if isinstance(arguments, dict) else {"value": arguments}})  # fmt: skip
    return blocks


def _view_places(view: ChatView, sent: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """For each shrunk message, the chat message of ``view`` it stands for (unchanged, or changed in place),
    else None (a message the pipeline wrote). Unchanged ones by their fingerprint in order; a changed tool
    result by its call id, an assistant turn by its calls; any other changed message when it is the one
    message of its role missing between its placed neighbours."""
    unchanged: dict[str, collections.deque[int]] = collections.defaultdict(collections.deque)
    by_call: dict[tuple[str, Any], int] = {}

    def calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
        ids = [message.get("tool_call_id")] + [c.get("id") for c in message.get("tool_calls") or []]
        return [(message["role"], i) for i in ids if i is not None]

    for k, message in enumerate(view.messages):
        unchanged[fingerprint(message)].append(k)
        for key in calls(message):
            by_call.setdefault(key, k)
    places: list[int | None] = []
    for message in sent:
        found = unchanged.get(fingerprint(message))
        places.append(found.popleft() if found else next((by_call[c] for c in calls(message) if c in by_call), None))
    _place_the_rest(view, sent, places)
    return places


def _place_the_rest(view: ChatView, sent: Sequence[Mapping[str, Any]], places: list[int | None]) -> None:
    """Place each changed message that is the one message of its role missing between its placed neighbours,
    in one pass: the neighbours from a pass each way, the missing ones of each role kept sorted (``bisect``),
    so a request of many changed messages costs n log n, not n squared."""
    taken = {k for k in places if k is not None}
    free: dict[str, list[int]] = collections.defaultdict(list)  # by role, in order: not placed, not the view's own
    for k, message in enumerate(view.messages):
        if k not in taken and view.origins[k] != -1:
            free[message["role"]].append(k)
    placed: dict[str, list[int]] = collections.defaultdict(list)  # by role, sorted: placed by this pass
    placed_now: set[int] = set()
    after, high = [len(view.messages)] * len(sent), len(view.messages)
    for j in range(len(sent) - 1, -1, -1):  # the nearest placed message after each one
        after[j] = high
        high = places[j] if places[j] is not None else high
    low = -1
    for j, message in enumerate(sent):
        if places[j] is not None or plain_content(message.get("content")).startswith((SUMMARY_MARKER, LEDGER_MARKER)):
            low = places[j] if places[j] is not None else low
            continue
        role = message["role"]
        first, last = bisect.bisect_right(free[role], low), bisect.bisect_left(free[role], after[j])
        gone = bisect.bisect_left(placed[role], after[j]) - bisect.bisect_right(placed[role], low)
        if last - first - gone == 1:  # the one missing: the range holds it and the ``gone`` placed already
            k = next(k for k in free[role][first:last] if k not in placed_now)
            places[j] = low = k
            bisect.insort(placed[role], k)
            placed_now.add(k)


def _anthropic_content(content: Any) -> list[dict[str, Any]]:
    """Chat content as Anthropic blocks: text, and images back as image blocks."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "image_url":
            url = str((part.get("image_url") or {}).get("url") or "")
            head, _, data = url.partition(";base64,")
            source = ({"type": "base64", "media_type": head.removeprefix("data:"), "data": data}
                      if url.startswith("data:") and data else {"type": "url", "url": url})  # fmt: skip
            blocks.append({"type": "image", "source": source})
        elif part.get("text"):
            blocks.append({"type": "text", "text": part["text"]})
    return blocks


def _edited_message(original: Mapping[str, Any], view: ChatView, mine: Sequence[int],
                    sent: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:  # fmt: skip
    """The Anthropic message ``original`` (the view's messages ``mine`` stand for it) with only what the pipeline
    changed changed, block by block: every block whose chat message went out unchanged is kept as sent (images,
    ``is_error``, ``cache_control``, citations and all); a changed tool result keeps its block with the new
    content; a changed text or call is rebuilt in its place; a dropped one goes. None when nothing is left
    (an assistant turn that held only thinking, its reasoning removed)."""
    results = iter(k for k in mine if view.messages[k]["role"] == "tool")
    rest = next((k for k in mine if view.messages[k]["role"] != "tool"), None)
    out: list[dict[str, Any]] = []
    rebuilt: set[int] = set()
    for block in _as_blocks(original.get("content")):
        kind = block.get("type")
        k = next(results, None) if kind == "tool_result" else rest
        if k is None or k not in sent:
            continue
        new, old = sent[k], view.messages[k]
        if fingerprint(new) == fingerprint(old):
            out.append(block)
        elif kind == "tool_result":
            content = new.get("content")
            out.append({**block, "content": content if isinstance(content, str) else _anthropic_content(content)})
        elif old["role"] == "assistant":
            out += _edited_assistant_block(block, new, old, first=k not in rebuilt)  # first: its new text here
            if block.get("type") == "text":
                rebuilt.add(k)
        elif k not in rebuilt:
            rebuilt.add(k)
            out += _edited_blocks([b for b in _as_blocks(original.get("content")) if b.get("type") != "tool_result"],
                                  new.get("content"))  # fmt: skip
    return {**original, "content": out} if out else None


def _edited_blocks(blocks: Sequence[Mapping[str, Any]], content: Any) -> list[dict[str, Any]]:
    """Text and image blocks whose chat message the pipeline changed (an image removed, lines dropped):
    each block whose text or image is still in ``content`` kept as sent (citations, cache_control); what is
    new in ``content`` in the place of the first block that is not."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    text = "\n".join(p.get("text", "") for p in parts if p.get("type") == "text")
    images = [p for p in parts if p.get("type") == "image_url"]
    out: list[dict[str, Any]] = []
    at = None
    for block in blocks:
        own = _anthropic_parts([block])[0] if block.get("type") in ("text", "image") else None
        if own is not None and own.get("type") == "text" and own["text"] and own["text"] in text:
            text = text.replace(own["text"], "", 1)
            out.append(dict(block))
        elif own is not None and own in images:
            images.remove(own)
            out.append(dict(block))
        elif at is None:
            at = len(out)
    rest = _anthropic_content([*([{"type": "text", "text": text.strip()}] if text.strip() else []), *images])
    at = len(out) if at is None else at
    return [*out[:at], *rest, *out[at:]]


def _edited_assistant_block(block: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any],
                            first: bool) -> list[dict[str, Any]]:  # fmt: skip
    """One block of an assistant turn the pipeline changed: thinking kept only with its reasoning, the text
    kept where it is the same (else the new text in the first text block's place), a call kept as sent
    where its arguments are the same."""
    kind = block.get("type")
    if kind in ("thinking", "redacted_thinking"):
        return [dict(block)] if new.get("reasoning_content") == old.get("reasoning_content") else []
    if kind == "text":
        if plain_content(new.get("content")) == plain_content(old.get("content")):
            return [dict(block)]
        text = plain_content(new.get("content"))
        return [{"type": "text", "text": text}] if first and text else []
    calls = {c.get("id"): c for c in new.get("tool_calls") or []}
    before = {c.get("id"): c for c in old.get("tool_calls") or []}
    call = calls.get(block.get("id"))
    if call is None:
        return []
    if call == before.get(block.get("id")):
        return [dict(block)]
    return _anthropic_blocks({"role": "assistant", "content": None, "tool_calls": [call]})


def messages_body(body: Mapping[str, Any], view: ChatView, sent: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``body`` with ``sent`` (the shrunk chat messages) written back: an Anthropic message all of whose chat
    messages went out unchanged goes out as the client sent it; one the pipeline changed in part is edited
    block by block (:func:`_edited_message`); a message the pipeline wrote (a summary, the ledger) goes into a
    user turn. No message leaves with empty content; adjacent turns of one role are joined."""
    places = _view_places(view, sent)
    members: dict[int, list[int]] = collections.defaultdict(list)  # each body message's chat messages, in order
    for k, o in enumerate(view.origins):
        members[o].append(k)
    out: dict[str, Any] = {k: v for k, v in body.items() if k != "system"}
    groups: list[tuple[int | None, dict[int, Mapping[str, Any]], list[Mapping[str, Any]]]] = []
    for message, k in zip(sent, places, strict=True):
        origin = None if k is None else view.origins[k]
        if origin == -1:
            out["system"] = body["system"]
            continue
        if groups and origin is not None and groups[-1][0] == origin:
            groups[-1][1][k] = message  # type: ignore[index]
        else:
            groups.append((origin, {} if k is None else {k: message}, [message]))
    written: list[dict[str, Any]] = []
    for origin, placed, messages in groups:
        if origin is None:
            role = "assistant" if messages[0].get("role") == "assistant" else "user"
            blocks = [b for m in messages for b in _anthropic_blocks(m)]
            message: dict[str, Any] | None = {"role": role, "content": blocks} if blocks else None
        else:
            message = _edited_message(body["messages"][origin], view, members[origin], placed)
            if message is not None and all(fingerprint(m) == fingerprint(view.messages[k]) for k, m in placed.items()) \
                    and len(placed) == len(members[origin]):  # fmt: skip
                message = dict(body["messages"][origin])  # all of it went out unchanged: as the client sent it
        if message is not None:
            _join_turn(written, message)
    return {**out, "messages": written}


def _join_turn(written: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """``message`` added to ``written`` so that the turns alternate: joined to the last turn when that has its
    role, with only system messages (the environment Claude Code sends between turns) after it, which stay
    after the joined turn."""
    last = next((k for k in range(len(written) - 1, -1, -1) if written[k]["role"] != "system"), None)
    if message["role"] == "system" or last is None or written[last]["role"] != message["role"]:
        written.append(message)
        return
    joined = _as_blocks(written[last]["content"]) + _as_blocks(message["content"])
    written[last] = {**written[last], "content": joined}


def _as_blocks(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


# --- the recall tool: what the proxy offers the model over what it folded away, in each API's format ---------


RECALL_DESCRIPTION = (
    "Fetch back, verbatim, what was folded away from this conversation to fit the model's window (earlier "
    "messages, tool results, files read): the lines that match the query, with context. Query by a file name, "
    "a command, an identifier or words; by a tool's name, that tool's whole description."
)
RECALL_SCHEMA = {"type": "object", "properties": {"query": {"type": "string", "description": "Words or an id."}},
                 "required": ["query"], "additionalProperties": False}  # fmt: skip
RECALL_CONTEXT = 2  # lines around each matching line
RECALL_TOKENS = 1500  # the most one recall returns
RECALL_WORDS = 32  # a query's distinct words looked for, at most (a longer query is its first ones)
RECALL_PIECE = 400  # characters: a longer line is searched, and returned, by its sentences


def recall_pieces(text: str) -> list[str]:
    """A text as the recall searches it: its lines (at any line end: LF, CRLF, CR), a line longer than
    :data:`RECALL_PIECE` characters by its sentences, and a sentence longer still by that many characters."""
    pieces = []
    for line in re.split(r"\r\n|\r|\n", text):
        if len(line) <= RECALL_PIECE:
            pieces.append(line)
            continue
        for sentence in re.split(r"(?<=[.!?])\s+", line):
            pieces += [sentence[k : k + RECALL_PIECE] for k in range(0, len(sentence), RECALL_PIECE)]
    return pieces


def recall_lines(
    messages: Sequence[Mapping[str, Any]],
    query: str,
    limit: int,
    count: Callable[[str], int],
    calls: Sequence[Mapping[str, Any]] = (),
    described: Mapping[str, str] | None = None,
) -> str:
    """What ``messages`` (those folded away) hold that matches ``query``, within ``limit`` tokens, newest
    message first as ``[message N, role]`` blocks: the results of a tool call (among ``messages`` and
    ``calls``, the request's messages: a call may be kept while its result was folded) whose name and
    arguments hold every word (a file read by its name, a command), from their head; else every line (a long
    line's sentences: :func:`recall_pieces`) holding all the query's words (its first :data:`RECALL_WORDS`; or, when
    none does, any of them) with :data:`RECALL_CONTEXT` lines around it. A sentence says so when
    nothing matches. A query that names a tool in ``described`` (tools whose descriptions the request carries
    cut: :func:`context_shrink_fit.lean_tools`) gets that tool's whole descriptions."""
    words = list(dict.fromkeys(w for w in re.findall(r"[\w.:/@-]+", query.lower()) if len(w) > 1))[:RECALL_WORDS]
    if not words:
        return "The query holds no word to search for."
    named = [
        text
        for name, text in (described or {}).items()
        if name.lower() in words or name.lower() == query.lower().strip()
    ]
    if named:
        return _within("\n\n".join(named), limit, count)
    called = {c.get("id") for m in [*messages, *calls] for c in m.get("tool_calls") or []
              if all(w in json.dumps(c.get("function") or {}).lower() for w in words)}  # fmt: skip
    texts = []
    for m in messages:
        calls = [f"{c['function'].get('name')} {c['function'].get('arguments')}" for c in m.get("tool_calls") or []]
        texts.append(recall_pieces("\n".join([plain_content(m.get("content")), *calls])))
    lowered = [[line.lower() for line in lines] for lines in texts]
    for needed in (len(words), 1):  # all the words on a line, else any of them
        blocks, room = [], limit
        for i in range(len(messages) - 1, -1, -1):
            lines = texts[i]
            if messages[i].get("tool_call_id") in called and needed == len(words):
                shown = list(range(len(lines)))  # the result of a matching call: whole, from its head
            else:
                hits = [k for k, line in enumerate(lowered[i]) if sum(w in line for w in words) >= needed]
                shown = sorted({j for k in hits for j in range(k - RECALL_CONTEXT, k + RECALL_CONTEXT + 1)
                                if 0 <= j < len(lines)})  # fmt: skip
            if not shown:
                continue
            block = [f"[message {i}, {messages[i]['role']}]"]
            room -= count(block[0]) + 1
            for j in shown:
                if (cost := count(lines[j]) + 1) > room - 16:
                    block.append("[... cut: the recall's limit]")
                    room = 0
                    break
                block.append(lines[j])
                room -= cost
            blocks.append("\n".join(block))
            if room <= 32:
                break
        if blocks:
            return "\n\n".join(blocks)
    return f"Nothing folded away matches {query!r}."


def _within(text: str, limit: int, count: Callable[[str], int]) -> str:
    """``text``'s lines from its head while they fit ``limit`` tokens, a marker where it is cut."""
    lines, room = [], limit - 16
    for line in text.split("\n"):
        if (cost := count(line) + 1) > room:
            lines.append("[... cut: the recall's limit]")
            break
        lines.append(line)
        room -= cost
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Call:
    """A tool call a model made: its id, the tool's name, its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def query(self) -> str:
        arguments = json_or(self.arguments or "{}")
        return str(arguments.get("query") or "") if isinstance(arguments, dict) else ""


# A reply is someone else's JSON: every field is read as the type it must have, or as empty (a tool's name that
# is a number, ``"delta": "x"``, ``"choices": 5``, ``"index": null`` beside ``"index": 0``...), never raised on.
def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _index(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def sse_events(data: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream (``[DONE]`` and what does not parse left out)."""
    events = []
    for line in data.decode("utf-8", "replace").splitlines():
        data_line = line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")
        if data_line and isinstance(event := json_or(line[5:]), dict):
            events.append(event)
    return events


class Rounds(Protocol):
    """A streamed reply relayed while the recall tool is offered: the model's replies, one per round (a recall
    answered, then asked again), go to the client as one. An event goes out as it comes until one that may be
    part of a tool call, or that ends the reply, arrives (:meth:`holds`): from there the round is held to its
    end, to be dropped if it called the recall tool. A later round's events are renumbered to follow what the
    client already has, its opening events dropped (:meth:`relayed`). A call to the recall tool the model made
    when it was no longer offered is taken out of the round (:meth:`without`): the agent never sees a call to a
    tool it does not have."""

    def start(self) -> None: ...

    def holds(self, event: Mapping[str, Any]) -> bool: ...

    def relayed(self, event: dict[str, Any], later: bool) -> dict[str, Any] | None: ...

    def without(self, event: dict[str, Any], name: str) -> dict[str, Any] | None: ...


class ChatRounds:
    """Chat Completions: every chunk stands alone; a tool call's deltas, the finishing chunk and the usage hold."""

    def __init__(self) -> None:
        self.dropped: set[int] = set()  # this round's calls taken out (:meth:`without`), by index
        self.kept: set[int] = set()  # and those left

    def start(self) -> None:
        self.dropped, self.kept = set(), set()

    def holds(self, event: Mapping[str, Any]) -> bool:
        choices = [c for c in _list(event.get("choices")) if isinstance(c, dict)]
        if not choices:
            return "usage" in event  # the usage chunk ends the reply; an opening one without choices goes out
        return any(c.get("finish_reason") or _dict(c.get("delta")).get("tool_calls") for c in choices)

    def relayed(self, event: dict[str, Any], later: bool) -> dict[str, Any] | None:
        return event

    def without(self, event: dict[str, Any], name: str) -> dict[str, Any] | None:
        choices = []
        for choice in _list(event.get("choices")):
            delta = _dict(_dict(choice).get("delta"))
            calls = [c for c in _list(delta.get("tool_calls")) if self._kept(c, name)]
            if calls != _list(delta.get("tool_calls")):
                rest = {k: v for k, v in delta.items() if k != "tool_calls"}
                choice = {**choice, "delta": {**rest, "tool_calls": calls} if calls else rest}
            if _dict(choice).get("finish_reason") == "tool_calls" and self.dropped and not self.kept:
                choice = {**choice, "finish_reason": "stop"}
            choices.append(choice)
        return {**event, "choices": choices} if "choices" in event and choices != event["choices"] else event

    def _kept(self, delta: Any, name: str) -> bool:
        if not isinstance(delta, dict):
            return True
        index = _index(delta.get("index"))
        if _text(_dict(delta.get("function")).get("name")) == name:
            self.dropped.add(index)
        if index not in self.dropped:
            self.kept.add(index)
        return index not in self.dropped


class ResponsesRounds:
    """The Responses API: an output item that is not a message or reasoning holds, and so do the reply's end
    events; a later round's items follow the ones relayed (``output_index``), its ``sequence_number`` too, and
    its closing response is the first one's (its id, and the output items relayed before it)."""

    ENDS = ("response.completed", "response.incomplete", "response.failed", "error")
    OPENING = ("response.created", "response.in_progress")

    def __init__(self) -> None:
        self.items = self.offset = 0  # output items relayed; those relayed before this round
        self.sequence: int | None = None  # the last sequence number relayed
        self.id: Any = None  # the response's id, as the first round opened it
        self.done: dict[int, Any] = {}  # the output items relayed whole, by their place
        self.dropped: set[int] = set()  # this round's calls taken out (:meth:`without`), by place

    def start(self) -> None:
        self.offset, self.dropped = self.items, set()

    def closing(self, event: dict[str, Any]) -> dict[str, Any]:
        """A later round's response event as the first round's: its id, and the items relayed before it."""
        response = event.get("response")
        if not isinstance(response, dict):
            return event
        earlier = [self.done[i] for i in sorted(self.done) if i < self.offset]
        return {**event, "response": {**response, "id": self.id, "output": [*earlier, *_list(response.get("output"))]}}

    def holds(self, event: Mapping[str, Any]) -> bool:
        kind, item = str(event.get("type") or ""), event.get("item")
        call = isinstance(item, dict) and item.get("type") not in ("message", "reasoning")
        return kind in self.ENDS or call or kind.startswith("response.function_call")

    def relayed(self, event: dict[str, Any], later: bool) -> dict[str, Any] | None:
        if later and event.get("type") in self.OPENING:
            return None
        if later and isinstance(event.get("output_index"), int):
            event = {**event, "output_index": event["output_index"] + self.offset}
        if isinstance(event.get("sequence_number"), int):
            if later and self.sequence is not None:
                event = {**event, "sequence_number": self.sequence + 1}
            self.sequence = event["sequence_number"]
        if later and self.id is not None:
            event = self.closing(event)
        kind, place = event.get("type"), event.get("output_index")
        if kind == "response.created" and isinstance(event.get("response"), dict):
            self.id = event["response"].get("id")
        if kind == "response.output_item.added" and isinstance(place, int):
            self.items = max(self.items, place + 1)
        if kind == "response.output_item.done" and isinstance(place, int):
            self.done[place] = event.get("item")
        return event

    def without(self, event: dict[str, Any], name: str) -> dict[str, Any] | None:
        if _is_call(event.get("item"), name) and isinstance(event.get("output_index"), int):
            self.dropped.add(event["output_index"])
        if isinstance(event.get("output_index"), int) and event["output_index"] in self.dropped:
            return None
        response = event.get("response")
        if isinstance(response, dict) and any(_is_call(i, name) for i in _list(response.get("output"))):
            output = [i for i in _list(response.get("output")) if not _is_call(i, name)]
            return {**event, "response": {**response, "output": output}}
        return event


def _is_call(item: Any, name: str) -> bool:
    """Whether a Responses output item is a call to the tool ``name``."""
    return isinstance(item, dict) and item.get("type") == "function_call" and item.get("name") == name


class MessagesRounds:
    """Anthropic Messages: a content block that is not text or thinking holds, and so do the reply's end events;
    a later round's blocks follow the ones relayed (``index``), its ``message_start`` dropped."""

    ENDS = ("message_delta", "message_stop", "error")
    SAID = ("text", "thinking", "redacted_thinking")

    def __init__(self) -> None:
        self.blocks = self.offset = 0  # content blocks relayed; those relayed before this round
        self.dropped: set[int] = set()  # this round's calls taken out (:meth:`without`), by index
        self.kept: set[int] = set()  # and its other tool calls

    def start(self) -> None:
        self.offset, self.dropped, self.kept = self.blocks, set(), set()

    def holds(self, event: Mapping[str, Any]) -> bool:
        block = _dict(event.get("content_block"))
        opens_call = event.get("type") == "content_block_start" and block.get("type") not in self.SAID
        return event.get("type") in self.ENDS or opens_call

    def relayed(self, event: dict[str, Any], later: bool) -> dict[str, Any] | None:
        if later and event.get("type") == "message_start":
            return None
        if later and isinstance(event.get("index"), int):
            event = {**event, "index": event["index"] + self.offset}
        if event.get("type") == "content_block_start" and isinstance(event.get("index"), int):
            self.blocks = max(self.blocks, event["index"] + 1)
        return event

    def without(self, event: dict[str, Any], name: str) -> dict[str, Any] | None:
        block, index = _dict(event.get("content_block")), event.get("index")
        if event.get("type") == "content_block_start" and block.get("type") == "tool_use":
            (self.dropped if block.get("name") == name else self.kept).add(_index(index))
        if _text(event.get("type")).startswith("content_block") and _index(index) in self.dropped:
            return None
        delta = _dict(event.get("delta"))
        if delta.get("stop_reason") == "tool_use" and self.dropped and not self.kept:
            return {**event, "delta": {**delta, "stop_reason": "end_turn"}}
        return event


SYSTEM_PART_TYPES = (None, "text", "input_text")  # the parts of a system prompt that hold its text


def _edited(content: Any, edit: Callable[[str], str]) -> Any:
    """A message's content (a text, or a list of parts) with ``edit`` applied to each text in it."""
    if isinstance(content, str):
        return edit(content)
    if isinstance(content, list):
        return [{**part, "text": edit(part["text"])} if isinstance(part, dict) and isinstance(part.get("text"), str)
                and part.get("type") in SYSTEM_PART_TYPES else part for part in content]  # fmt: skip
    return content


def _leading_edited(items: Any, edit: Callable[[str], str]) -> Any:
    """A list of messages (or input items) with ``edit`` applied to the texts of its leading system and developer
    ones; anything else as it is."""
    if not isinstance(items, list):
        return items
    out, leading = [], True
    for item in items:
        leading = leading and isinstance(item, dict) and item.get("role") in SYSTEM_ROLES
        out.append({**item, "content": _edited(item.get("content"), edit)} if leading else item)
    return out


class Wire(Protocol):
    """One wire API as the proxy sees it: its body as a chat view and written back, and what recall needs: its
    tool format, the calls in a reply (whole or streamed), a whole reply without the calls to one tool, a request
    answering them, how a streamed reply is relayed round after round (:class:`Rounds`), and the event a stream
    the proxy must end early ends with (in the API's own shape)."""

    def view(self, body: Mapping[str, Any]) -> ChatView: ...

    def write(self, body: Mapping[str, Any], view: ChatView, sent: Sequence[Mapping[str, Any]]) -> dict[str, Any]: ...

    def with_tool(self, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def with_system(self, body: Mapping[str, Any], edit: Callable[[str], str]) -> dict[str, Any]: ...

    def calls(self, reply: bytes, streamed: bool) -> list[Call]: ...

    def without_calls(self, reply: Any, name: str) -> Any: ...

    def answered(self, body: Mapping[str, Any], calls: Sequence[Call], results: Sequence[str]) -> dict[str, Any]: ...

    def rounds(self) -> Rounds: ...

    def error_event(self, message: str) -> bytes: ...


class ChatWire:
    """Chat Completions (OpenCode and most clients): the body is its own chat view."""

    rounds = ChatRounds

    def view(self, body: Mapping[str, Any]) -> ChatView:
        messages = validate_messages(body.get("messages"))
        return ChatView(messages, validate_tools(body.get("tools") or []), list(range(len(messages))))

    def write(self, body: Mapping[str, Any], view: ChatView, sent: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {**body, "messages": list(sent)}

    def with_tool(self, body: Mapping[str, Any]) -> dict[str, Any]:
        tool = {"type": "function", "function": {"name": RECALL_TOOL, "description": RECALL_DESCRIPTION,
                                                 "parameters": RECALL_SCHEMA}}  # fmt: skip
        return {**body, "tools": [*(body.get("tools") or []), tool]}

    def with_system(self, body: Mapping[str, Any], edit: Callable[[str], str]) -> dict[str, Any]:
        return {**body, "messages": _leading_edited(body["messages"], edit)} if "messages" in body else dict(body)

    def calls(self, reply: bytes, streamed: bool) -> list[Call]:
        if not streamed:
            choice = _dict((_list(_dict(json_or(reply)).get("choices")) or [None])[0])
            found = [c for c in _list(_dict(choice.get("message")).get("tool_calls")) if isinstance(c, dict)]
            return [Call(_text(c.get("id")), _text(_dict(c.get("function")).get("name")),
                         _text(_dict(c.get("function")).get("arguments"))) for c in found]  # fmt: skip
        parts: dict[int, tuple[list[str], list[str], list[str]]] = {}  # its ids, its name's and arguments' pieces
        for event in sse_events(reply):
            for choice in _list(event.get("choices")):
                for delta in _list(_dict(_dict(choice).get("delta")).get("tool_calls")):
                    if not isinstance(delta, dict):
                        continue
                    ids, name, arguments = parts.setdefault(_index(delta.get("index")), ([], [], []))
                    function = _dict(delta.get("function"))
                    ids.append(_text(delta.get("id")))
                    name.append(_text(function.get("name")))
                    arguments.append(_text(function.get("arguments")))
        return [Call(next((i for i in reversed(ids) if i), ""), "".join(name), "".join(arguments))
                for _, (ids, name, arguments) in sorted(parts.items())]  # fmt: skip

    def without_calls(self, reply: Any, name: str) -> Any:
        choices = []
        for choice in _list(_dict(reply).get("choices")):
            message = _dict(_dict(choice).get("message"))
            calls = [c for c in _list(message.get("tool_calls")) if _dict(_dict(c).get("function")).get("name") != name]
            if calls != _list(message.get("tool_calls")):
                rest = {k: v for k, v in message.items() if k != "tool_calls"}
                message = {**rest, "tool_calls": calls} if calls else {**rest, "content": message.get("content") or ""}
                choice = {**choice, "message": message, **({} if calls else {"finish_reason": "stop"})}
            choices.append(choice)
        return {**reply, "choices": choices} if choices else reply

    def error_event(self, message: str) -> bytes:
        return f"data: {json.dumps({'error': {'message': message, 'type': 'upstream_error'}})}\n\n".encode()

    def answered(self, body: Mapping[str, Any], calls: Sequence[Call], results: Sequence[str]) -> dict[str, Any]:
        turn = assistant_message("", [tool_call(c.id, c.name, c.arguments) for c in calls])
        answers = [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results, strict=True)]
        return {**body, "messages": [*body["messages"], turn, *answers]}


class ResponsesWire:
    """The Responses API (Codex CLI)."""

    rounds = ResponsesRounds

    view = staticmethod(responses_view)
    write = staticmethod(responses_body)

    def with_tool(self, body: Mapping[str, Any]) -> dict[str, Any]:
        tool = {"type": "function", "name": RECALL_TOOL, "description": RECALL_DESCRIPTION,
                "parameters": RECALL_SCHEMA, "strict": False}  # fmt: skip
        return {**body, "tools": [*(body.get("tools") or []), tool]}

    def with_system(self, body: Mapping[str, Any], edit: Callable[[str], str]) -> dict[str, Any]:
        edited = {**body, "input": _leading_edited(body["input"], edit)} if "input" in body else dict(body)
        if isinstance(body.get("instructions"), str):
            edited["instructions"] = edit(body["instructions"])
        return edited

    def calls(self, reply: bytes, streamed: bool) -> list[Call]:
        items: list[Any] = []
        if streamed:
            for event in sse_events(reply):
                if event.get("type") == "response.output_item.done":
                    items.append(event.get("item"))
                elif event.get("type") == "response.completed" and not items:
                    items = list(_list(_dict(event.get("response")).get("output")))
        else:
            items = _list(_dict(json_or(reply)).get("output"))
        return [Call(_text(i.get("call_id")), _text(i.get("name")), _text(i.get("arguments")))
                for i in items if isinstance(i, dict) and i.get("type") == "function_call"]  # fmt: skip

    def without_calls(self, reply: Any, name: str) -> Any:
        if not isinstance(reply, dict) or not isinstance(reply.get("output"), list):
            return reply
        return {**reply, "output": [i for i in reply["output"] if not _is_call(i, name)]}

    def error_event(self, message: str) -> bytes:
        event = {"type": "error", "code": "upstream_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()

    def answered(self, body: Mapping[str, Any], calls: Sequence[Call], results: Sequence[str]) -> dict[str, Any]:
        items = body["input"] if isinstance(body.get("input"), list) else [
            {"type": "message", "role": "user", "content": body.get("input") or ""}]  # fmt: skip
        made = [{"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        outputs = [{"type": "function_call_output", "call_id": c.id, "output": r}
                   for c, r in zip(calls, results, strict=True)]  # fmt: skip
        return {**body, "input": [*items, *made, *outputs]}


class MessagesWire:
    """Anthropic Messages (Claude Code)."""

    rounds = MessagesRounds

    view = staticmethod(messages_view)
    write = staticmethod(messages_body)

    def with_tool(self, body: Mapping[str, Any]) -> dict[str, Any]:
        tool = {"name": RECALL_TOOL, "description": RECALL_DESCRIPTION, "input_schema": RECALL_SCHEMA}
        return {**body, "tools": [*(body.get("tools") or []), tool]}

    def with_system(self, body: Mapping[str, Any], edit: Callable[[str], str]) -> dict[str, Any]:
        return {**body, "system": _edited(body["system"], edit)} if "system" in body else dict(body)

    def calls(self, reply: bytes, streamed: bool) -> list[Call]:
        if not streamed:
            blocks = _list(_dict(json_or(reply)).get("content"))
            return [Call(_text(b.get("id")), _text(b.get("name")), json.dumps(b.get("input") or {}))
                    for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]  # fmt: skip
        parts: dict[int, tuple[str, str, list[str]]] = {}  # its id, its name, its arguments' pieces
        for event in sse_events(reply):
            block, delta = _dict(event.get("content_block")), _dict(event.get("delta"))
            index = _index(event.get("index"))
            if event.get("type") == "content_block_start" and block.get("type") == "tool_use":
                parts[index] = (_text(block.get("id")), _text(block.get("name")), [])
            elif delta.get("type") == "input_json_delta" and index in parts:
                parts[index][2].append(_text(delta.get("partial_json")))
        return [Call(i, name, "".join(pieces) or "{}") for _, (i, name, pieces) in sorted(parts.items())]

    def without_calls(self, reply: Any, name: str) -> Any:
        if not isinstance(reply, dict) or not isinstance(reply.get("content"), list):
            return reply
        uses = lambda blocks: [b for b in blocks if _dict(b).get("type") == "tool_use"]  # noqa: E731
        content = [b for b in reply["content"] if not (_dict(b).get("type") == "tool_use" and b.get("name") == name)]
        stop = "end_turn" if reply.get("stop_reason") == "tool_use" and not uses(content) else reply.get("stop_reason")
        return {**reply, "content": content, "stop_reason": stop} if uses(reply["content"]) != uses(content) else reply

    def error_event(self, message: str) -> bytes:
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()

    def answered(self, body: Mapping[str, Any], calls: Sequence[Call], results: Sequence[str]) -> dict[str, Any]:
        uses = []
        for c in calls:
            arguments = json_or(c.arguments or "{}")
            if arguments is None:  # not JSON (or too deep to read): the query it stands for
                arguments = {"query": c.arguments}
            uses.append({"type": "tool_use", "id": c.id, "name": c.name, "input": arguments})
        answers = [{"type": "tool_result", "tool_use_id": c.id, "content": r}
                   for c, r in zip(calls, results, strict=True)]  # fmt: skip
        turns = [{"role": "assistant", "content": uses}, {"role": "user", "content": answers}]
        return {**body, "messages": [*body["messages"], *turns]}


WIRES: dict[str, Wire] = {"chat": ChatWire(), "responses": ResponsesWire(), "messages": MessagesWire()}
