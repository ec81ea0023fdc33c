"""Hardening, round four (#58), through the doors as an attacker meets them: no client sees another's words,
nothing stalls the event loop, a broken stream still ends well, secrets never leave. Each test reproduces one
failure of the attack run on 3404da2 (the leak and the hangs first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
from fake_openai import FakeOpenAI, serve
from upstreams import proxied

SYSTEM = {"role": "system", "content": "You are a coding agent. Today is 2026-12-07."}


def chat(url: str, key: str, messages: list[dict[str, Any]], **extra: Any) -> httpx2.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 64, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx2.post(url + "/chat/completions", json=body, headers=headers, timeout=60)


def sent_text(fake: FakeOpenAI, since: int = 0) -> str:
    return json.dumps([r["body"] for r in fake.requests[since:]], ensure_ascii=False)


# --------------------------------------------------------------------------- 1. one client's words, another's request


def test_a_clients_words_never_reach_another_clients_request(tmp_path: Path) -> None:
    """Two conversations that opened with the same first user message ("hi") shared their memory whatever their
    key, system prompt or tools: a password one client typed was put in a ledger in the other's request. The memory
    is kept per caller (its key, hashed) and agent (its fixed part); within one, it still carries what the agent
    left out (the control: it fails if the memory is off)."""
    fake = FakeOpenAI(window=32768)
    secret = "my password is hunter2-PW-7781"
    hi, hello = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    with serve(fake) as upstream, proxied(upstream, window=32768, state=f"sqlite:{tmp_path / 'state.sqlite3'}") as url:
        assert chat(url, "sk-alice", [SYSTEM, hi]).status_code == 200
        assert chat(url, "sk-alice", [SYSTEM, hi, hello, {"role": "user", "content": secret}]).status_code == 200
        others = len(fake.requests)
        other_prompt = {"role": "system", "content": "You are another agent."}
        for key, system in (("sk-bob", SYSTEM), ("sk-alice", other_prompt), ("", SYSTEM)):
            assert chat(url, key, [system, hi]).status_code == 200
            later = [system, hi, {"role": "assistant", "content": "hey"}, {"role": "user", "content": "what now?"}]
            assert chat(url, key, later).status_code == 200
        assert "hunter2" not in sent_text(fake, others), "another client's typed words were sent in its request"
        # The control: the same client and agent, the agent having left the message out, the day after.
        tomorrow = {"role": "system", "content": "You are a coding agent. Today is 2026-12-08."}
        mine = chat(url, "sk-alice", [tomorrow, hi, hello, {"role": "user", "content": "go on"}])
    assert mine.status_code == 200 and "hunter2" in sent_text(fake, len(fake.requests) - 1)
