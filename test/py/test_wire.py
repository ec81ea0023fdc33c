"""Section 10, the other wire APIs seen as chat: the Responses API (Codex CLI) and Anthropic Messages (Claude
Code) read as chat messages, one assistant-message builder for every reader, and what is written back: an
untouched message goes out exactly as the client sent it."""

from __future__ import annotations

from typing import Any

import pytest

import context_shrink as cs

pytestmark = pytest.mark.core


def test_one_assistant_message_builder() -> None:
    call = cs.tool_call("c1", "read", '{"path": "a.py"}')
    assert cs.assistant_message("", [call]) == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert cs.assistant_message("") == {"role": "assistant", "content": ""}  # never None without calls
    assert cs.assistant_message("ok", reasoning="thought") == {"role": "assistant", "content": "ok",
                                                               "reasoning_content": "thought"}  # fmt: skip


def test_text_parts_read_as_text_and_images_stay_parts() -> None:
    assert cs.chat_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert cs.chat_content([{"type": "text", "text": "a"}, image]) == [{"type": "text", "text": "a"}, image]


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
    view = cs.messages_view(anthropic())
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
    view = cs.messages_view(body)
    written = cs.messages_body(body, view, view.messages)
    assert written["messages"] == body["messages"] and written["system"] == body["system"]


def test_responses_items_as_chat_and_back() -> None:
    body = {"instructions": "You are Codex.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        {"type": "function_call", "call_id": "k1", "name": "exec", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "k1", "output": "a.py"},
    ]}  # fmt: skip
    view = cs.responses_view(body)
    assert [m["role"] for m in view.messages] == ["system", "user", "assistant", "tool"]
    assert view.messages[2] == cs.assistant_message("", [cs.tool_call("k1", "exec", '{"cmd": "ls"}')])
    assert cs.responses_body(body, view, view.messages)["input"] == body["input"]


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
        cs.messages_view(body)
