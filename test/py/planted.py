"""Conversations with planted identifiers, for the fidelity tests and bench/fidelity.py."""

from __future__ import annotations

import json
import random
from typing import Any

IDENTIFIERS = [
    "src/parser/core.py",
    "tests/test_parser.py",
    "KeyError: 'timeout'",
    "PARSER_STRICT=1",
    "a1b2c3d",
    "issue #481",
    "https://ci.example.com/job/77",
    "250 ms",
    "parse_header",
    "pytest -x tests/test_parser.py",
]

FILLER = [
    "Let me look at the surrounding code first.",
    "The tests are slow on this machine, so I will run only the failing module.",
    "That output is long; the relevant part is near the end.",
    "I will keep the change small and leave the public API as it is.",
    "Before editing, I want to confirm how the configuration is loaded.",
]


def planted_conversation(seed: int = 0, turns: int = 6, tool_heavy: bool = True, lead: int = 0) -> list[dict[str, Any]]:
    """A debugging conversation in which every identifier of IDENTIFIERS appears exactly where a real one would:
    ``lead`` filler turns, then the six turns that hold the facts, then filler up to ``turns``."""
    rng = random.Random(seed)
    facts = [
        ("user", "The parser crashes with KeyError: 'timeout' when the config has no timeout. See issue #481."),
        ("read_file", {"path": "src/parser/core.py"}, "def parse_header(raw):\n    timeout = raw['timeout']\n" * 3),
        (
            "bash",
            {"command": "pytest -x tests/test_parser.py"},
            "FAILED tests/test_parser.py::test_defaults\nE   KeyError: 'timeout'\n1 failed in 250 ms",
        ),
        ("assistant", "The crash comes from parse_header, which reads raw['timeout'] without a default."),
        ("bash", {"command": "git log --oneline -3"}, "a1b2c3d Read timeout from config\n9f8e7d6 Add parser\n"),
        (
            "user",
            "CI shows the same failure: https://ci.example.com/job/77 . Strict mode is on there (PARSER_STRICT=1).",
        ),
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent working in a repository."}]
    call = 0
    for k in range(max(turns, lead + len(facts))):
        fact = facts[k - lead] if lead <= k < lead + len(facts) else None
        for _ in range(rng.randint(1, 3) if tool_heavy else 0):  # noise before the fact
            call += 1
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"n{call}",
                            "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps({"command": f"ls src/module_{call}"})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"n{call}", "content": "\n".join(f"file_{i}.txt" for i in range(40))},
            ]
        if fact is None:
            messages.append({"role": "assistant", "content": rng.choice(FILLER)})
        elif fact[0] in ("user", "assistant"):
            messages.append({"role": fact[0], "content": fact[1]})
        else:
            call += 1
            name, arguments, output = fact
            messages += [
                {
                    "role": "assistant",
                    "content": rng.choice(FILLER),
                    "tool_calls": [
                        {
                            "id": f"c{call}",
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"c{call}", "content": output},
            ]
    messages.append({"role": "user", "content": "Please fix it now and tell me what you changed."})
    return messages
