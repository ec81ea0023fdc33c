"""One agent turn for the Qwen chat templates: a system prompt, two of OpenCode's tools, a user request, an
assistant that thinks and calls two tools (arguments as the wire sends them: JSON strings, one with nested
values), their results, a text part list, and a final answer. test/data/qwen/<family>.txt holds what each
family's own template (rendered with jinja2 as transformers and vLLM render it) makes of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"


def tools() -> list[dict[str, Any]]:
    listed = json.loads((DATA / "tools" / "opencode.json").read_text(encoding="utf-8"))
    return [t for t in listed if t["function"]["name"] in ("read", "bash")]


def messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Read README.md and run the tests, then tell me what fails."},
        {
            "role": "assistant",
            "content": "<think>\nFirst the README, then the tests.\n</think>\n\nReading it now.",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "read", "arguments": '{"filePath": "README.md"}'}},
                {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": json.dumps(
                    {"command": "pytest -q", "timeout": 120, "env": {"CI": "1"}, "flags": ["-x", "-q"]})}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "# Project\n\nRun `./test/test.sh`."},
        {"role": "tool", "tool_call_id": "c2", "content": "1 failed, 41 passed in 2.1s\nFAILED test_x.py::test_é"},
        {"role": "user",
         "content": [{"type": "text", "text": "And the failure?"}, {"type": "text", "text": "Briefly."}]},
        {"role": "assistant", "content": "test_é fails: the expected value changed."},
        {"role": "user", "content": "Thanks. Fix it."},
    ]  # fmt: skip
