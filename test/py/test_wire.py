"""Section 10, the other wire APIs seen as chat: the Responses API (Codex CLI) and Anthropic Messages (Claude
Code) read as chat messages, one assistant-message builder for every reader, and what is written back: an
untouched message goes out exactly as the client sent it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from agent_requests import claude_request, codex_request
from hypothesis import given, settings
from hypothesis import strategies as st

import context_shrink as cs
import context_shrink_wire as csw

pytestmark = pytest.mark.core


def test_one_assistant_message_builder() -> None:
    call = cs.tool_call("c1", "read", '{"path": "a.py"}')
    assert cs.assistant_message("", [call]) == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert cs.assistant_message("") == {"role": "assistant", "content": ""}  # never None without calls
    assert cs.assistant_message("ok", reasoning="thought") == {"role": "assistant", "content": "ok",
                                                               "reasoning_content": "thought"}  # fmt: skip


def test_text_parts_read_as_text_and_images_stay_parts() -> None:
    assert csw.chat_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert csw.chat_content([{"type": "text", "text": "a"}, image]) == [{"type": "text", "text": "a"}, image]


def anthropic() -> dict[str, Any]:
    return {
        "system": "You are Claude Code.",
        "max_tokens": 1000,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "read a.py"}, {"type": "text", "text": "please"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "Read",
                                               "input": {"file_path": "a.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "print(1)"}]}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "only a thought"}]},
        ],
    }  # fmt: skip


def test_anthropic_messages_as_chat() -> None:
    view = csw.messages_view(anthropic())
    assert view.messages == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "read a.py\nplease"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm",
         "tool_calls": [cs.tool_call("t1", "Read", '{"file_path": "a.py"}')]},
        {"role": "tool", "tool_call_id": "t1", "content": "print(1)"},
        {"role": "assistant", "content": "", "reasoning_content": "only a thought"},
    ]  # fmt: skip
    assert view.origins == [-1, 0, 1, 2, 3]


def test_untouched_anthropic_messages_go_out_as_sent() -> None:
    body = anthropic()
    view = csw.messages_view(body)
    written = csw.messages_body(body, view, view.messages)
    assert written["messages"] == body["messages"] and written["system"] == body["system"]


def test_responses_items_as_chat_and_back() -> None:
    body = {"instructions": "You are Codex.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        {"type": "function_call", "call_id": "k1", "name": "exec", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "k1", "output": "a.py"},
    ]}  # fmt: skip
    view = csw.responses_view(body)
    assert [m["role"] for m in view.messages] == ["system", "user", "assistant", "tool"]
    assert view.messages[2] == cs.assistant_message("", [cs.tool_call("k1", "exec", '{"cmd": "ls"}')])
    assert csw.responses_body(body, view, view.messages)["input"] == body["input"]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": "x"}, "messages must be a list"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document' is not understood"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "must be a user, assistant or system message"),
    ],
)
def test_a_body_it_cannot_read_is_an_error_naming_why(body: dict[str, Any], said: str) -> None:
    with pytest.raises(cs.ContextShrinkError, match=said):
        csw.messages_view(body)


def test_an_anthropic_message_is_edited_block_by_block() -> None:
    """#34: a cleared tool result keeps its block (is_error, cache_control) with the new content; the other
    blocks of its message (an image, a text with citations) go out as sent; a turn that held only thinking,
    its reasoning removed, is not sent with empty content (the turns around it are joined)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    cited = {"type": "text", "text": "see the screenshot", "citations": [{"type": "char_location", "cited_text": "s"}]}
    result = {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "cache_control": {"type": "ephemeral"},
              "content": [{"type": "text", "text": "Traceback ... " * 20}]}  # fmt: skip
    body = anthropic()
    body["messages"][2]["content"] = [result, image, cited]
    body["messages"] += [{"role": "user", "content": "go on"}]
    view = csw.messages_view(body)
    k = next(i for i, m in enumerate(view.messages) if m["role"] == "tool")
    sent = [*view.messages[:k], {**view.messages[k], "content": "[cleared]"}, *view.messages[k + 1 :]]
    sent = [cs.without_reasoning(m) if m["role"] == "assistant" and not m["content"] else m for m in sent]
    written = csw.messages_body(body, view, sent)["messages"]
    assert written[2]["content"][:3] == [{**result, "content": "[cleared]"}, image, cited]
    assert written[:2] == body["messages"][:2]
    assert all(m["content"] for m in written) and [m["role"] for m in written] == ["user", "assistant", "user"]
    assert written[2]["content"][-1] == {"type": "text", "text": "go on"}  # the turn after, joined


def test_an_image_removed_from_a_message_leaves_its_other_blocks_as_sent() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    cited = {"type": "text", "text": "see the screenshot", "citations": [{"type": "char_location", "cited_text": "s"}]}
    body = {"messages": [{"role": "user", "content": [image, cited]}]}
    view = csw.messages_view(body)
    sent = [{"role": "user", "content": "[image removed: png, 0 KB]\nsee the screenshot"}]
    assert csw.messages_body(body, view, sent)["messages"][0]["content"] == [
        {"type": "text", "text": "[image removed: png, 0 KB]"},
        cited,
    ]


def test_an_assistant_turn_with_new_text_keeps_its_thinking_and_calls() -> None:
    body = anthropic()
    view = csw.messages_view(body)
    k = next(i for i, m in enumerate(view.messages) if m.get("tool_calls"))
    sent = [*view.messages[:k], {**view.messages[k], "content": "ok (shortened)"}, *view.messages[k + 1 :]]
    written = csw.messages_body(body, view, sent)["messages"]
    original = body["messages"][1]["content"]
    assert written[1]["content"] == [original[0], {"type": "text", "text": "ok (shortened)"}, original[2]]


def places_by_definition(view: csw.ChatView, sent: list[dict[str, Any]]) -> list[int | None]:
    """What ``_view_places`` promises, written the plain way (quadratic): unchanged messages by fingerprint in
    order, changed ones by a call id, else the one message of their role missing between placed neighbours."""
    unchanged: dict[str, list[int]] = {}
    for k, m in enumerate(view.messages):
        unchanged.setdefault(cs.fingerprint(m), []).append(k)

    def calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
        ids = [m.get("tool_call_id")] + [c.get("id") for c in m.get("tool_calls") or []]
        return [(m["role"], i) for i in ids if i is not None]

    by_call: dict[tuple[str, Any], int] = {}
    for k, m in enumerate(view.messages):
        for key in calls(m):
            by_call.setdefault(key, k)
    places: list[int | None] = []
    for m in sent:
        found = unchanged.get(cs.fingerprint(m))
        places.append(found.pop(0) if found else next((by_call[c] for c in calls(m) if c in by_call), None))
    taken = {k for k in places if k is not None}
    for j, m in enumerate(sent):
        if places[j] is not None or cs.plain_content(m.get("content")).startswith(cs.SUMMARY_MARKER):
            continue
        low = next((places[i] for i in range(j - 1, -1, -1) if places[i] is not None), -1)
        high = next((places[i] for i in range(j + 1, len(sent)) if places[i] is not None), len(view.messages))
        between = [k for k in range(low + 1, high) if k not in taken and view.origins[k] != -1
                   and view.messages[k]["role"] == m["role"]]  # fmt: skip
        if len(between) == 1:
            places[j] = between[0]
            taken.add(between[0])
    return places


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_each_shrunk_message_is_placed_as_defined(data: st.DataObject) -> None:
    """Any view and any shrunk list (messages kept, changed, dropped, reordered, summaries written in): the
    one-pass placing equals the definition."""
    roles = st.sampled_from(["user", "assistant", "system"])
    view_roles = data.draw(st.lists(roles, max_size=14))
    messages = [{"role": r, "content": f"m{i}"} for i, r in enumerate(view_roles)]
    origins = [data.draw(st.sampled_from([i, i, -1])) for i in range(len(messages))]
    view = csw.ChatView(messages, [], origins)
    sent: list[dict[str, Any]] = []
    for m in messages:
        fate = data.draw(st.sampled_from(["kept", "changed", "dropped", "summary"]))
        if fate == "kept":
            sent.append(m)
        elif fate == "changed":
            sent.append({**m, "content": m["content"] + " (changed)"})
        elif fate == "summary":
            sent.append({"role": "user", "content": cs.SUMMARY_MARKER + " earlier"})
    sent = data.draw(st.permutations(sent)) if data.draw(st.booleans()) else sent
    assert csw._view_places(view, sent) == places_by_definition(view, sent)


class Counted(list):  # type: ignore[type-arg]
    """A list that counts the elements read from it: by index, by iterating, by counting or searching."""

    reads = 0

    def __getitem__(self, at: Any) -> Any:
        Counted.reads += 1
        return super().__getitem__(at)

    def __iter__(self) -> Any:
        for item in super().__iter__():
            Counted.reads += 1
            yield item

    def count(self, value: Any) -> int:
        Counted.reads += len(self)
        return super().count(value)

    def index(self, value: Any, *bounds: Any) -> int:
        Counted.reads += len(self)
        return super().index(value, *bounds)


def test_many_changed_messages_are_placed_in_one_pass() -> None:
    """#50: 4,000 changed messages, none placed by a neighbour, read each view message's origin once; the earlier
    search between neighbours read them 8 million times (8,000 changed messages took 14 s, growing with the
    square: a Responses or Messages request of 100,000 would have taken over half an hour)."""
    n = 4000
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"message {i}"} for i in range(n)]
    origins = Counted(range(n))
    sent = [{**m, "content": m["content"] + " (changed)"} for m in messages]
    places = csw._view_places(csw.ChatView(messages, [], origins), sent)
    assert places == [None] * n and Counted.reads <= 2 * n


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_a_request_with_every_tool_result_cleared_is_written_back_in_one_pass(api: str) -> None:
    """#50: an agent's request of 2,000 turns, every tool result cleared by the pipeline, written back in its
    own format reads each view message's origin a few times (the Messages writer looked up each edited
    message's parts across the whole view: 20,000 turns took 105 s, now 3.8 s)."""
    body = (codex_request if api == "responses" else claude_request)(2000, 3)
    view = (csw.responses_view if api == "responses" else csw.messages_view)(body)
    view = csw.ChatView(view.messages, view.tools, Counted(view.origins))
    sent = [{**m, "content": "[cleared]"} if m["role"] == "tool" else m for m in view.messages]
    Counted.reads = 0
    written = (csw.responses_body if api == "responses" else csw.messages_body)(body, view, sent)
    assert "[cleared]" in json.dumps(written) and Counted.reads <= 4 * len(view.messages)
