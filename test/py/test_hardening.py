"""Hardening, round four (#58), through the doors as an attacker meets them: no client sees another's words,
nothing stalls the event loop, a broken stream still ends well, secrets never leave. Each test reproduces one
failure of the attack run on 3404da2 (the leak and the hangs first)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fake_openai import FakeOpenAI, serve
from proxy_helpers import MODULE, started
from starlette.responses import JSONResponse
from tiny_llama import free_port
from upstreams import Recorder, proxied, raw_upstream

import context_shrink_proxy as csp

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


# --------------------------------------------------------------------------- 2. text that is not text; replies closed

FINE = {"role": "user", "content": "fine"}
LONE = {
    "chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi \ud83d"}]},
    "responses": {"model": "m", "input": [FINE, {"role": "user", "content": "\udc00"}]},
    "messages": {"model": "m", "max_tokens": 8, "system": "ok", "messages": [{"role": "user", "content": "x\ud800"}]},
}
FIELDS = {"chat/completions": "messages[0].content", "responses": "input[1].content", "messages": "messages[0].content"}


def test_a_lone_surrogate_is_refused_at_the_door_naming_its_field(tmp_path: Path) -> None:
    """A lone surrogate (valid JSON, no character) was a bare 500 on all three APIs after the upstream had
    answered. It is a 400 in the API's error shape naming the field, and nothing is sent upstream; escaped or
    as its three UTF-8 bytes alike."""
    fake = FakeOpenAI(window=8192)
    with serve(fake) as upstream, started("proxy", "--upstream", upstream, "--window", "8192",
                                          log=tmp_path / "log") as base:  # fmt: skip
        for path, body in LONE.items():
            for raw in (
                json.dumps(body).encode(),
                json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"),
            ):
                answer = httpx2.post(f"{base}/v1/{path}", content=raw, headers={"content-type": "application/json"})
                assert answer.status_code == 400, (path, answer.text)
                message = answer.json()["error"]["message"]
                assert FIELDS[path] in message and "surrogate" in message
    assert fake.requests == [] and fake.responses_requests == [] and fake.anthropic_requests == []
    assert "Traceback" not in (tmp_path / "log").read_text()


def test_every_upstream_reply_is_closed_when_a_request_fails_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that failed after the upstream answered left that reply open: 256 of them filled the connection
    pool and every later request of every client hung. Whatever fails after the reply (here: delivering it, 300
    times), the reply is closed, the client gets a 500 in the API's shape, and the next request is answered."""

    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug after the upstream answered")

    fake = FakeOpenAI(window=8192)
    with serve(fake) as upstream, proxied(upstream, window=8192) as url:
        monkeypatch.setattr(csp.ProxyFront, "deliver", broken)
        with httpx2.Client(timeout=20) as client:
            for _ in range(300):
                answer = client.post(
                    url + "/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                )
                assert answer.status_code == 500 and answer.json()["error"]["type"] == "internal_error"
        monkeypatch.undo()
        assert chat(url, "sk-a", [{"role": "user", "content": "hi"}]).status_code == 200


# --------------------------------------------------------------------------- 3. secrets in URLs

PASSWORD = "s3cr3t-PW-4417"


def test_credentials_in_the_upstream_url_never_leave_the_proxy(tmp_path: Path) -> None:
    """``--upstream http://user:pass@host/v1``: the password was returned to clients in 502 bodies and streamed
    error events, and logged. Now it is ``***`` wherever the upstream is named: an unreachable upstream (plain and
    streamed), a reply broken off mid-stream, an upstream error echoing the Basic credential httpx sent."""

    async def broken_stream(reader: Any, writer: Any) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b'20\r\ndata: {"choices": [{"delta": {}}]}\n\n\r\n')
        await writer.drain()
        writer.close()

    def echoing(request: Any, body: bytes) -> Any:
        return JSONResponse({"error": {"message": f"bad credentials: {request.headers.get('authorization')}"}}, 401)

    closed = f"http://alice:{PASSWORD}@127.0.0.1:{free_port()}/v1"
    seen = []
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with raw_upstream(broken_stream) as cut, serve(Recorder(echoing)) as echo:
        for upstream in (closed, cut.replace("http://", f"http://alice:{PASSWORD}@"),
                         echo.replace("http://", f"http://alice:{PASSWORD}@")):  # fmt: skip
            with started("proxy", "--upstream", upstream, "--window", "8192", log=tmp_path / "log") as base:
                for stream in (False, True):
                    answer = httpx2.post(base + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
                    seen.append(answer.text)
    assert any("***" in text for text in seen), seen
    logged = (tmp_path / "log").read_text()
    doctor = subprocess.run([sys.executable, str(MODULE), "doctor", "--upstream", closed], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    basic = base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    for text in [*seen, logged, doctor.stdout + doctor.stderr]:
        assert PASSWORD not in text and basic not in text, text[:400]


def test_a_redis_password_in_a_rejected_state_is_never_echoed(tmp_path: Path) -> None:
    """A Redis password given as ``?password=`` (or ``user:pass@``) in a ``--state`` that is refused was echoed to
    stderr; the refusal names the setting with the password as ``***``."""
    for spec in (f"redis://localhost:6379/abc?password={PASSWORD}", f"redis://:{PASSWORD}@localhost/x/y"):
        done = subprocess.run([sys.executable, str(MODULE), "proxy", "--upstream", "http://127.0.0.1:9/v1",
                               "--state", spec], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode != 0 and "--state" in done.stderr, done.stderr
        assert PASSWORD not in done.stderr + done.stdout
