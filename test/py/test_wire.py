"""Section 10, the other wire APIs seen as chat: the Responses API (Codex CLI) and Anthropic Messages (Claude
Code) read as chat messages, one assistant-message builder for every reader, and what is written back: an
untouched message goes out exactly as the client sent it."""

from __future__ import annotations

from typing import Any

import pytest

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
