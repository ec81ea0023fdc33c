"""Chat histories the tests build: single messages, a tool-using conversation, a plain chat, the cookbook's
counting example and one real transcript from test/data."""

from __future__ import annotations

import json
from typing import Any

from conftest import LOCAL_SESSIONS, load_session

import context_shrink as cs


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str | None, *call_ids: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if call_ids:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": cid})}}
            for cid in call_ids
        ]
    return message


def tool(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def conversation(turns: int, size: int = 400) -> list[dict[str, Any]]:
    """A system prompt, then turns of user -> assistant tool call (two parallel) -> results -> answer."""
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for t in range(turns):
        messages += [
            user(f"turn {t}: please look at file_{t}.py " + "word " * size),
            assistant(None, f"call_{t}_a", f"call_{t}_b"),
            tool(f"call_{t}_a", "output " * size),
            tool(f"call_{t}_b", "more output " * size),
            assistant(f"done with turn {t}"),
        ]
    return messages


def first_non_system(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((m for m in messages if m["role"] not in cs.SYSTEM_ROLES), None)


COOKBOOK = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate jargon "
        "into plain English.",
    },
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities for "
        "increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client deliverable.",
    },
]


def session() -> list[dict[str, Any]]:
    return load_session(LOCAL_SESSIONS / "swe-agent_function-calling_marshmallow-1867.json")


def chat_history(turns: int, size: int) -> list[dict[str, Any]]:
    """A plain chat (no tool results to clear): only compaction or trimming can shrink it."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"turn {t}: please explain file_{t}.py " + "word " * size},
            {"role": "assistant", "content": f"answer {t}: " + "because " * size},
        ]
    return messages
