"""The requests three coding agents send, built at any size: OpenCode's chat request, Codex CLI's Responses
request, Claude Code's Messages request (the proxy's tests and the real-server tests both send them)."""

from __future__ import annotations

import json
from typing import Any


def opencode_request(
    turns: int = 3, file_lines: int = 50, system_size: int = 900, tool_size: int = 60
) -> dict[str, Any]:
    """OpenCode's shape: a system prompt and ten tool definitions that take most of an 8k window (with the
    default sizes, in cl100k tokens), then ``u a u a u`` with a file attached to every user message."""
    rules = "Follow the rules. " * system_size
    system = {"role": "system", "content": "You are opencode, an interactive CLI agent. " + rules}
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "Does one thing. " * tool_size,
              "parameters": schema}} for i in range(10)]  # fmt: skip
    messages: list[dict[str, Any]] = [system]
    for t in range(turns):
        attached = {"type": "text", "text": f"<file path='src/m{t}.py'>\n" + "def f():\n    return 1\n" * file_lines}
        messages.append({"role": "user", "content": [{"type": "text", "text": f"question {t}"}, attached]})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} " * 150})
    return {"model": "m", "messages": messages, "tools": tools, "max_tokens": 1024}


def chat_request(turns: int, result_size: int) -> dict[str, Any]:
    """An OpenCode-like Chat Completions request: a task, then turns of a shell call and its output."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are opencode."},
        {"role": "user", "content": "fix it"},
    ]
    for t in range(turns):
        call = {
            "id": f"c{t}",
            "type": "function",
            "function": {"name": "shell", "arguments": json.dumps({"cmd": f"cat f{t}"})},
        }
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{t}", "content": f"line {t}\n" * result_size}]  # fmt: skip
    messages.append({"role": "user", "content": "and now run the tests"})
    tool = {
        "type": "function",
        "function": {"name": "shell", "description": "Run a command.", "parameters": {"type": "object"}},
    }
    return {"model": "m", "messages": messages, "tools": [tool], "max_tokens": 512}


def codex_request(turns: int, result_size: int, reasoning: bool = True) -> dict[str, Any]:
    """A Codex CLI Responses request: instructions, a user task, then turns of reasoning, a shell call (two
    in parallel every third turn) and their outputs, and a final user message."""
    task = [{"type": "input_text", "text": "fix the failing test in src/app.py"}]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": task}]
    for t in range(turns):
        calls = [f"c{t}a", f"c{t}b"] if t % 3 == 0 else [f"c{t}"]
        if reasoning:  # (llama.cpp refuses reasoning items without content)
            items.append({"type": "reasoning", "id": f"rs_{t}", "summary": [], "encrypted_content": "opaque"})
        arguments = json.dumps({"cmd": f"cat f{t}"})
        items += [{"type": "function_call", "call_id": c, "name": "shell", "arguments": arguments} for c in calls]
        items += [{"type": "function_call_output", "call_id": c, "output": f"line {t}\n" * result_size} for c in calls]
        items.append(
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"step {t}"}]}
        )
    items.append({"role": "user", "content": [{"type": "input_text", "text": "and now run the tests"}]})
    tool = {"type": "function", "name": "shell", "description": "Run a command.", "parameters": {"type": "object"}}
    return {"model": "m", "instructions": "You are Codex, a coding agent.", "input": items, "tools": [tool],
            "max_output_tokens": 512, "store": False}  # fmt: skip


def claude_request(turns: int, result_size: int, thinking: bool = True) -> dict[str, Any]:
    """A Claude Code Messages request: a system field, a task and (as Claude Code 2.1 sends it) a system
    message with the environment, then turns of (thinking,) text and a Bash tool_use answered by a
    tool_result in the next user message, and a final user message."""
    environment = {"role": "system", "content": [{"type": "text", "text": "# Environment\n - cwd: /src\n - linux"}]}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix src/app.py"}]},
                                      environment]  # fmt: skip
    for t in range(turns):
        blocks: list[dict[str, Any]] = (
            [{"type": "thinking", "thinking": f"plan {t}", "signature": "sig"}] if thinking else []
        )
        blocks += [{"type": "text", "text": f"step {t}"},
                   {"type": "tool_use", "id": f"tu{t}", "name": "Bash", "input": {"command": f"cat f{t}"}}]  # fmt: skip
        messages.append({"role": "assistant", "content": blocks})
        result = {"type": "tool_result", "tool_use_id": f"tu{t}", "content": f"line {t}\n" * result_size}
        messages.append({"role": "user", "content": [result]})
    messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "now run the tests"}]
    tool = {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}}
    return {"model": "m", "system": [{"type": "text", "text": "You are Claude Code."}], "messages": messages,
            "tools": [tool], "max_tokens": 512}  # fmt: skip
