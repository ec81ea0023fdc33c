"""Hardening found by an attack run (#18): keys never leave, the proxy answers every request and stays
inside its upstream. Each test is one reproduction from the attack report."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from builders import conversation
from fake_openai import serve
from mcp_calls import call, error, ok, run
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from tiny_llama import free_port
from upstreams import PROXY_KEY, SECRET, SUMMARY, Recorder, proxied, raw_upstream

import context_shrink as cs
import context_shrink_proxy as csp
import context_shrink_state as cst


def compact_args(**extra: Any) -> dict[str, Any]:
    return {"messages": conversation(6, size=40), "force": True, "keep_last": 2, "model": "m", **extra}


# --------------------------------------------------------------------------- secrets


def test_the_history_and_the_key_go_only_to_the_configured_url(tmp_path: Path) -> None:
    """A tool call cannot name another summariser: a prompt-injected call could send the history (and once
    the configured key) anywhere. ``base_url`` and ``api_key`` are server settings only."""
    mine, other = Recorder(), Recorder()
    with serve(mine) as configured, serve(other) as foreign:
        config = cs.Config(root=tmp_path, tokenizer="tiktoken", base_url=configured, api_key=SECRET,
                           extra_headers={"api-key": "azure-" + SECRET})  # fmt: skip
        server = cs.build_server(config)
        assert ok(run(call(server, "compact_context", compact_args())))["compacted"]
        refused = error(run(call(server, "compact_context", compact_args(base_url=foreign, api_key="sk-caller-1"))))
    assert "unknown argument `api_key`" in refused and "unknown argument `base_url`" in refused
    assert mine.headers and all(h["authorization"] == f"Bearer {SECRET}" for h in mine.headers)
    assert all(h["api-key"] == "azure-" + SECRET for h in mine.headers)
    assert other.headers == []  # the foreign URL was never asked


def test_a_key_is_redacted_before_an_error_is_cut(tmp_path: Path) -> None:
    body = "x" * 285 + f" Bearer {SECRET} was refused"  # the key sits across the old 300-character cut

    def answer(request: Request, _: bytes) -> Response:
        return PlainTextResponse(body, status_code=401)

    with serve(Recorder(answer)) as url:
        config = cs.Config(root=tmp_path, tokenizer="tiktoken", base_url=url, api_key=SECRET)
        result = ok(run(call(cs.build_server(config), "compact_context", compact_args())))
    assert not result["compacted"] and "401" in result["reason"]
    for fragment in ("sk-S", "SECRET", "123"):
        assert fragment not in result["reason"], result["reason"]


@pytest.mark.parametrize("credential", ["sk-CLIENTKEY-999", f"Basic {base64.b64encode(b'me:pw-CLIENT-999').decode()}"])
def test_a_client_credential_in_any_scheme_is_redacted(credential: str) -> None:
    def echo(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(401, json={"error": {"message": f"bad key {request.headers.get('authorization')}"}})

    async def attempt() -> str:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(echo)) as http:
            state = csp.ProxyState(csp.ProxyConfig(upstream="http://up/v1"), http, cs.resolve_tokenizer("heuristic"))
            with pytest.raises(cs.BackendError) as raised:
                await state.backend("http://up/v1", credential).chat("m", [{"role": "user", "content": "hi"}], 10)
            return str(raised.value)

    message = asyncio.run(attempt())
    assert "401" in message and "CLIENT" not in message and credential.split()[-1] not in message


def test_redact_covers_every_form() -> None:
    basic = "Basic " + base64.b64encode(b"user:hunter22").decode()
    secrets = cs.secret_forms(basic) + cs.secret_forms(f"Bearer {SECRET}")
    text = f"{basic} / user:hunter22 / hunter22 / {json.dumps({'k': SECRET})}"
    assert cs.redact(text, secrets).count("***") == 4 and "hunter22" not in cs.redact(text, secrets)
    assert cs.secret_forms("abc") == [] and cs.redact("abc", []) == "abc"


@pytest.mark.parametrize("shape", ["json message", "json detail", "text", "html"])
def test_the_proxys_own_key_never_reaches_a_client(shape: str) -> None:
    def echo(request: Request, _: bytes) -> Response:
        said = f"Incorrect API key provided: {request.headers.get('authorization')}"
        return {
            "json message": lambda: JSONResponse({"error": {"message": said}}, status_code=401),
            "json detail": lambda: JSONResponse({"detail": said}, status_code=401),
            "text": lambda: PlainTextResponse(said, status_code=401),
            "html": lambda: HTMLResponse(f"<html><body>{said}</body></html>", status_code=401),
        }[shape]()

    upstream = Recorder(echo)
    with serve(upstream) as url, proxied(url, api_key=PROXY_KEY) as front:
        chat = httpx2.post(
            f"{front}/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
        models = httpx2.get(f"{front}/models")
    assert upstream.headers and all(h["authorization"] == f"Bearer {PROXY_KEY}" for h in upstream.headers)
    for reply in (chat, models):
        assert reply.status_code == 401 and "Incorrect API key" in reply.text
        assert PROXY_KEY not in reply.text and "PROXYKEY" not in json.dumps(dict(reply.headers))


# --------------------------------------------------------------------------- the proxy answers, and stays inside


@contextlib.contextmanager
def broken_upstream(head: bytes = b"content-type: application/json\r\ncontent-length: 1000") -> Iterator[str]:
    """A server that promises more than it sends, then closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b'\r\n\r\n{"choices')
        await writer.drain()
        writer.close()

    with raw_upstream(handle) as url:
        yield url


def test_an_upstream_that_breaks_off_mid_body_is_a_502(capfd: pytest.CaptureFixture[str]) -> None:
    with broken_upstream() as url, proxied(url, window=8192) as front:
        reply = httpx2.post(
            f"{front}/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
    assert reply.status_code == 502 and url in reply.json()["error"]["message"]
    assert "Traceback" not in capfd.readouterr().err


def test_a_streamed_reply_that_breaks_off_ends_with_an_error_event(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    head = b"content-type: text/event-stream\r\ntransfer-encoding: chunked"
    with broken_upstream(head) as url, proxied(url, window=8192) as front:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx2.post(f"{front}/chat/completions", json=body)
    last = reply.text.strip().splitlines()[-1]
    assert reply.status_code == 200 and last.startswith("data: ")  # the status was sent before the cut
    assert url in json.loads(last[6:])["error"]["message"]
    assert "Traceback" not in capfd.readouterr().err and "broke off" in caplog.text


@pytest.mark.parametrize("chunked", [True, False])
def test_a_large_reply_is_streamed_through_not_held(monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    """Above the buffer size a non-streamed reply is relayed as it arrives, with or without a content-length:
    the client reads its first bytes while the upstream is still holding back the rest."""
    monkeypatch.setattr(csp, "PROXY_BUFFER_BYTES", 64 * 1024)
    part = b"x" * (256 * 1024)
    client_reading = threading.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        length = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % (2 * len(part))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + length + b"\r\n\r\n")
        frame = (lambda b: b"%x\r\n%s\r\n" % (len(b), b)) if chunked else (lambda b: b)
        writer.write(frame(part))
        await writer.drain()
        await asyncio.get_running_loop().run_in_executor(None, client_reading.wait, 20)
        writer.write(frame(part) + (b"0\r\n\r\n" if chunked else b""))
        await writer.drain()
        writer.close()

    with raw_upstream(handle) as url, proxied(url, window=8192) as front:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        with httpx2.stream("POST", f"{front}/chat/completions", json=body, timeout=60) as reply:
            chunks = reply.iter_raw()
            first = next(chunks)
            early = not client_reading.is_set()
            client_reading.set()
            received = first + b"".join(chunks)
    assert reply.status_code == 200 and early and received == 2 * part


def test_an_absurd_refused_window_is_not_learnt() -> None:
    refusal = {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 900, "n_ctx": -5,
                         "message": "request (900 tokens) exceeds the available context size (-5 tokens)"}}  # fmt: skip
    calls: list[int] = []

    def answer(request: Request, body: bytes) -> Response:
        if not request.url.path.endswith("/chat/completions"):  # the proxy asks the upstream its window
            return JSONResponse({"error": "not here"}, status_code=404)
        calls.append(1)
        return JSONResponse(refusal, status_code=400) if len(calls) == 1 else JSONResponse(SUMMARY)

    with serve(Recorder(answer)) as url, proxied(url, window=8192) as front:
        request = {"model": "m", "messages": conversation(3, size=40)}
        first = httpx2.post(f"{front}/chat/completions", json=request)
        second = httpx2.post(f"{front}/chat/completions", json=request)
    assert first.status_code == 400 and len(calls) == 2  # not retried with a -5 window
    assert second.status_code == 200 and "window=-5" not in second.headers["x-context-shrink"]
    assert "window=8192" in second.headers["x-context-shrink"]


@pytest.mark.parametrize("path", ["/v1/../../x", "/v1/%2e%2e/%2e%2e/x", "/v1/./models", "/v1/models/.."])
def test_a_path_cannot_leave_the_upstreams_prefix(path: str) -> None:
    upstream = Recorder()
    with serve(upstream) as url, proxied(url) as front:
        origin = front.removesuffix("/v1")
        with httpx2.Client() as client:  # send the path as written, unnormalised
            reply = client.send(
                client.build_request("GET", origin + "/v1/models", extensions={"target": path.encode()})
            )
    assert reply.status_code == 400 and upstream.paths == []


# --------------------------------------------------------------------------- files


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    for read in (cs.load_messages_file, cs.read_jsonl_lines):
        with pytest.raises(cs.ContextShrinkError, match="not a regular file"):
            read(fifo)  # returns at once: opened non-blocking, refused by fstat
    for special in (Path("/dev/zero"), tmp_path):  # a device; a folder (found by the fuzz suite)
        with pytest.raises(cs.ContextShrinkError, match="not a regular file"):
            cs.read_file_text(special)
    opened = len(os.listdir("/proc/self/fd"))
    with contextlib.suppress(cs.ContextShrinkError):
        cs.read_file_text(tmp_path)
    assert len(os.listdir("/proc/self/fd")) == opened  # the descriptor was closed
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    reply = run(call(server, "estimate_context", {"messages_path": "pipe.json"}))
    assert reply.is_error and "not a regular file" in reply.content[0].text
    pruned = run(call(server, "prune_context", {"messages_path": "pipe.json", "remove_ids": ["ab"], "dry_run": False}))
    assert pruned.is_error and "not a regular file" in pruned.content[0].text


def test_every_file_input_has_the_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs, "MAX_FILE_BYTES", 1000)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"role": "user", "content": "x" * 90}) + "\n" for _ in range(20)))
    with pytest.raises(cs.ContextShrinkError, match="larger than the limit"):
        cs.read_jsonl_lines(big)  # prune_context's reader


def test_in_place_rewrites_keep_backups_bytes_and_mode(tmp_path: Path) -> None:
    messages = conversation(3, size=5)
    path = tmp_path / "h.jsonl"
    path.write_bytes("".join(json.dumps(m) + "\r\n" for m in messages).encode())
    path.chmod(0o644)
    backups = {cs.write_text_atomic(path, path.read_bytes().decode(), backup=True) for _ in range(3)}
    assert len(backups) == 3 and all(b.read_bytes() == path.read_bytes() for b in backups)  # none overwritten
    lines = cs.read_jsonl_lines(path)
    assert lines is not None and all(raw.endswith("\r\n") for raw, _ in lines)
    changed = [dict(m) for m in messages]
    changed[2] = {**changed[2], "content": "changed"}
    text = cs.render_jsonl(lines, messages, [changed[0], changed[2], *changed[3:]], removed={1})
    cs.write_text_atomic(path, text)
    written = path.read_bytes().decode().split("\r\n")
    assert written[0] == json.dumps(messages[0]) and '"changed"' in written[1]  # untouched bytes, CRLF kept
    assert "\n" not in path.read_bytes().decode().replace("\r\n", "")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_output_to_a_folder_writes_nothing_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    server = cs.build_server(cs.Config(root=root, tokenizer="tiktoken"))
    reply = run(call(server, "trim_context", {"messages": conversation(3, size=5), "output_path": "."}))
    assert reply.is_error and sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_the_state_store_is_private(tmp_path: Path) -> None:
    """The archive lives in the store: a new folder 0700, the file and its WAL files 0600 (test_state.py has the
    store's bounds)."""
    store = cst.SqliteStore(tmp_path / "state" / "state.sqlite3")
    history = conversation(3, size=5)
    assert store.archive(cst.archive_entries(history, history[-1:], "trim"), 1 << 30, 30) == len(history) - 1
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "state").iterdir()} == {0o600}
    store.close()


@pytest.mark.parametrize(
    ("variable", "value"), [("CONTEXT_SHRINK_ARCHIVE_MAX_BYTES", "12"), ("CONTEXT_SHRINK_ARCHIVE_MAX_DAYS", "soon")]
)
def test_archive_limits_are_settings_checked_at_start(variable: str, value: str) -> None:
    args = argparse.Namespace(upstream="http://127.0.0.1:1/v1", no_archive=False)
    config = csp.proxy_config(
        args, {"CONTEXT_SHRINK_ARCHIVE_MAX_BYTES": "2097152", "CONTEXT_SHRINK_ARCHIVE_MAX_DAYS": "7"}
    )
    assert (config.archive_max_bytes, config.archive_max_days) == (2097152, 7)
    with pytest.raises(cs.ConfigError, match=variable) as caught:
        csp.proxy_config(args, {variable: value})
    assert caught.value.variable == variable


@contextlib.contextmanager
def listening(header_timeout: float, idle_timeout: float) -> Iterator[int]:
    """The proxy's uvicorn settings (:func:`csp.listening`) around a tiny app, in a thread; yields the port."""
    import uvicorn

    port = free_port()
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    server = uvicorn.Server(csp.listening(app, "127.0.0.1", port, header_timeout, idle_timeout))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (whatever it sent first)."""
    sock.settimeout(seconds)
    with contextlib.suppress(TimeoutError):
        while sock.recv(65536):
            pass
        return True
    return False


def test_slow_header_and_idle_connections_are_closed() -> None:
    with listening(header_timeout=0.5, idle_timeout=1) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")  # a complete request is answered
        assert closed_within(silent, 10) and closed_within(slow, 10)
        assert closed_within(kept, 10)  # then closed once idle
        for sock in (silent, slow, kept):
            sock.close()
