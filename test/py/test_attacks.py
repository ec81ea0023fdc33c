"""Hardening, round two (#34), through the doors as an attacker meets them: no key usable without the token,
no browser cross-site use, headers always valid, bounded time for slow bodies and cut streams, clear
errors for deep nesting, a learnt window that is evidence and not a verdict. Each test reproduces one
failure of the attack run on the previous main."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import h11
import httpx2
import pytest
from builders import conversation
from fake_openai import serve
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_calls import call, error, ok, run
from proxy_helpers import MODULE, started
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from stores import claude_store, environ
from upstreams import PROXY_KEY, SUMMARY, Recorder, proxied, raw_upstream

import context_shrink as cs
import context_shrink_proxy as csp
import context_shrink_sessions as css
import context_shrink_state as cst
import context_shrink_wire as csw

TOKEN = "test-token-0123456789abcdef"
ABOUT = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
HELLO = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": ABOUT}
ACCEPT = {"Accept": "application/json, text/event-stream"}


def reflecting(request: Request, body: bytes) -> Response:
    """An upstream like llama.cpp: it answers and reflects the browser's Origin in its CORS grant."""
    reply = JSONResponse({"object": "list", "data": []})
    reply.headers["access-control-allow-origin"] = request.headers.get("origin", "*")
    reply.headers["access-control-allow-credentials"] = "true"
    return reply


# --------------------------------------------------------------------------- keys and exposure


def test_health_is_get_only_and_nothing_else_skips_the_token(tmp_path: Path) -> None:
    """Any method but GET on /health went past the token and was relayed upstream with the proxy's key."""
    recorder = Recorder(reflecting)
    keyed = {"CONTEXT_SHRINK_PROXY_API_KEY": PROXY_KEY}
    with serve(recorder) as upstream, started("serve", "--token", TOKEN, "--upstream", upstream,
                                              log=tmp_path / "log", env=keyed) as base:  # fmt: skip
        answers = {m: httpx2.request(m, base + "/health", json={"model": "m"}) for m in ("POST", "PUT", "DELETE")}
        authorised = httpx2.post(base + "/health", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        get = httpx2.get(base + "/health")
    assert {m: r.status_code for m, r in answers.items()} == {"POST": 401, "PUT": 401, "DELETE": 401}
    assert authorised.status_code == 405 and get.status_code == 200
    assert recorder.paths == [], "a /health request was relayed upstream"


def test_the_plain_proxy_refuses_browser_cross_site_requests() -> None:
    recorder = Recorder(reflecting)
    with serve(recorder) as upstream, proxied(upstream, api_key=PROXY_KEY) as url:
        evil = httpx2.post(url + "/chat/completions", json={"model": "m", "messages": []},
                           headers={"Origin": "https://evil.example"})  # fmt: skip
        blind = httpx2.get(url + "/models", headers={"Sec-Fetch-Site": "cross-site"})
        local = httpx2.get(url + "/models", headers={"Origin": "http://localhost:5173"})
        agent = httpx2.get(url + "/models")
    assert evil.status_code == 403 and "evil.example" in evil.json()["error"]["message"]
    assert blind.status_code == 403
    assert local.status_code == agent.status_code == 200
    assert recorder.paths == ["/v1/models", "/v1/models"]  # the refused ones never reached the upstream
    assert not any(k.startswith("access-control-") for k in local.headers), "the upstream's CORS grant was relayed"


def test_an_allowed_origin_gets_the_upstreams_cors_grant() -> None:
    recorder = Recorder(reflecting)
    with serve(recorder) as upstream, proxied(upstream, origins=("https://app.example",)) as url:
        allowed = httpx2.get(url + "/models", headers={"Origin": "https://app.example", "Sec-Fetch-Site": "cross-site"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"


def raw_get(port: int, path: str, host: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("door", ["serve", "proxy"])
def test_a_foreign_host_name_is_refused(door: str, tmp_path: Path) -> None:
    """DNS rebinding: a page on evil.example whose name resolves to 127.0.0.1 reads nothing, whatever path."""
    recorder = Recorder(reflecting)
    with serve(recorder) as upstream, started(door, "--upstream", upstream, log=tmp_path / "log") as base:
        port = int(base.rsplit(":", 1)[1])
        answers = {p: raw_get(port, p, f"evil.example:{port}") for p in
                   ("/context-shrink/stats", "/metrics", "/v1/models", "/mcp")}  # fmt: skip
        ours = raw_get(port, "/v1/models", f"localhost:{port}")
    for path, answer in answers.items():
        assert answer.startswith(b"HTTP/1.1 403"), (path, answer[:200])
    assert ours.startswith(b"HTTP/1.1 200") and recorder.paths == ["/v1/models"]


def test_allow_origin_works_on_mcp_too(tmp_path: Path) -> None:
    """The SDK's own origin check refused an origin --allow-origin allows; one guard decides now."""
    with started("serve", "--allow-origin", "https://app.example", log=tmp_path / "log") as base:
        allowed = httpx2.post(base + "/mcp", json=HELLO, headers={**ACCEPT, "Origin": "https://app.example"})
        other = httpx2.post(base + "/mcp", json=HELLO, headers={**ACCEPT, "Origin": "https://other.example"})
    assert allowed.status_code == 200, allowed.text
    assert other.status_code == 403


# --------------------------------------------------------------------------- headers always valid


@settings(max_examples=300, deadline=None)
@given(reason=st.text(max_size=400), conversation=st.text(max_size=50))
def test_the_header_is_valid_for_any_reason_text(reason: str, conversation: str) -> None:
    """A reason whose character 200 was a space made h11 refuse the header and drop the connection."""
    header = csp.shrink_header({"tokens_before": 9, "tokens_after": 3, "action": "trim", "reason": reason,
                               "conversation": conversation})  # fmt: skip
    h11.Response(status_code=200, headers=[("x-context-shrink", header)])  # raises when invalid
    assert header == header.strip() and len(header) < 400


# --------------------------------------------------------------------------- streams cut


def cut_upstream(head: bytes, sent: bytes) -> Any:
    """A server that answers 200 with ``head``, sends ``sent`` and closes the connection mid-body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n" + sent)
        await writer.drain()
        writer.close()

    return raw_upstream(handle)


def test_a_stream_cut_inside_an_event_ends_with_a_whole_error_event() -> None:
    """The error event was glued onto the half event, so a client could parse neither."""
    whole = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
    sent = b"5c\r\n" + whole + b'data: {"choices": [{"del\r\n'  # one chunk: a whole event and half of the next
    head = b"content-type: text/event-stream\r\ntransfer-encoding: chunked"
    with cut_upstream(head, sent.replace(b"5c", b"%x" % (len(whole) + 24))) as url, proxied(url, window=8192) as front:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx2.post(f"{front}/chat/completions", json=body)
    events = [e for e in reply.text.split("\n\n") if e.strip()]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == "a"
    assert "error" in json.loads(events[-1].removeprefix("data: ")) and len(events) == 2  # the half event dropped


def test_a_cut_json_reply_to_a_streamed_request_is_never_a_clean_200() -> None:
    head = b"content-type: application/json\r\ntransfer-encoding: chunked"
    with cut_upstream(head, b"10\r\n" + b'{"choices": [{"m' + b"\r\n") as url, proxied(url, window=8192) as front:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(httpx2.RemoteProtocolError):
            httpx2.post(f"{front}/chat/completions", json=body)


# --------------------------------------------------------------------------- deep nesting


@pytest.mark.parametrize("depth", [300, 900, 5000])
def test_a_deeply_nested_messages_file_is_a_clear_error(depth: int, tmp_path: Path) -> None:
    """messages_path files nested 900+ deep gave a bare "Error executing tool"."""
    path = tmp_path / "deep.json"
    path.write_text("[" + json.dumps({"role": "user", "content": "hi"})[:-1] + ', "meta": ' + "[" * depth
                    + "]" * depth + "}]")  # fmt: skip
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    for tool in ("estimate_context", "trim_context", "analyze_context"):
        said = error(run(call(server, tool, {"messages_path": str(path), "max_context_tokens": 1000})))
        assert "nested" in said and "deep" in said, (tool, said)


JSON_WE_WROTE = {  # (module, function): the only places json.loads reads text directly
    ("context_shrink", "json_or"),  # the one reader of JSON someone else wrote: no exception escapes it
    ("context_shrink_proxy", "read_json"),  # a request body: its callers relay it, saying it is nested too deeply
    ("context_shrink", "load_messages_file"),  # a messages file: a named error for each way it cannot be read
    ("context_shrink", "read_jsonl_lines"),
    ("context_shrink", "StoredTable.__iter__"),  # a store's keys and values, as the store wrote them
    ("context_shrink", "MemoryTables.get"),
    ("context_shrink", "MemoryTables.first"),
    ("context_shrink", "MemoryTables.items"),
    ("context_shrink_proxy", "ProxyStats.rows"),
    ("context_shrink_state", "MemoryStore.changed"),
    *(("context_shrink_state", f"SqliteStore.{name}") for name in ("_value", "first", "items", "found", "changed")),
    *(
        ("context_shrink_state", f"RedisStore.{name}")
        for name in ("get", "first", "items", "_catch_up", "search", "changed")
    ),
}


def test_json_someone_else_wrote_is_read_only_through_json_or() -> None:
    """A tool call's arguments, an upstream's reply, an SSE event, a setting, an archive line: read with
    ``json_or``, whose RecursionError on deep nesting is an answer. A new ``json.loads`` must be one of these."""
    found = set()
    for module in (cs, csp, css, cst, csw):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))

        def walk(node: ast.AST, names: list[str], module: Any = module) -> None:
            for child in ast.iter_child_nodes(node):
                inner = [*names, child.name] if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                                           | ast.ClassDef) else names  # fmt: skip
                call = child.func if isinstance(child, ast.Call) else None
                if isinstance(call, ast.Attribute) and call.attr == "loads" and getattr(call.value, "id", "") == "json":
                    found.add((module.__name__, ".".join(names)))
                walk(child, inner)

        walk(tree, [])
    assert found == JSON_WE_WROTE


def deep_files(folder: Path, depth: int) -> list[str]:
    """Files nested ``depth`` levels deep in each place a history can hide it: the whole file (a list, an
    object), a message's content, a key beside it, a tool call's arguments (a JSON string), one JSONL line and
    a request body's tools."""
    deep_list, deep_object = "[" * depth + "]" * depth, '{"a": ' * depth + "1" + "}" * depth
    user = {"role": "user", "content": "look at the parser " * 20}
    calls = [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": deep_list}}]
    call = {"role": "assistant", "content": None, "tool_calls": calls}
    turn = [user, call, {"role": "tool", "tool_call_id": "c1", "content": "output " * 3000},
            {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]  # fmt: skip
    shapes = {
        "file.json": deep_list,
        "object.json": deep_object,
        "content.json": f'[{json.dumps(user)}, {{"role": "user", "content": {deep_list}}}]',
        "beside.json": f'[{{"role": "user", "content": "hi", "meta": {deep_object}}}]',
        "arguments.json": json.dumps(turn),
        "line.jsonl": f"{json.dumps(user)}\n{deep_list}\n",
        "tools.json": f'{{"messages": [{json.dumps(user)}], "tools": {deep_list}}}',
    }
    for name, text in shapes.items():
        (folder / name).write_text(text, encoding="utf-8")
    return list(shapes)


DEEP_CALLS = {  # every tool that reads a file, with what makes it do its work
    "estimate_context": {},
    "analyze_context": {},
    "trim_context": {"max_context_tokens": 2000},
    "prune_context": {"clear_tool_results_before": 0, "dry_run": True},
    "compact_context": {"model": "", "force": True, "max_context_tokens": 2000},
}


async def deep_calls(client: Any, names: list[str]) -> list[tuple[str, str, str]]:
    """Each tool on each file: ``(tool, file, what it said)`` for every call that was neither a result nor a
    tool error with its reason (the SDK's bare "Error executing tool X" is an exception the tool let escape)."""
    unnamed = []
    for name in names:
        calls = {tool: {"messages_path": name, **extra} for tool, extra in DEEP_CALLS.items()}
        calls |= {"shrink_text": {"path": name, "budget": 50}, "check_text": {"path": name, "plan": ["parser"]}}
        for tool, arguments in calls.items():
            result = await client.call_tool(tool, arguments)
            said = result.content[0].text if result.content else ""
            if result.is_error and ": " not in said:
                unnamed.append((tool, name, said))
    return unnamed


@pytest.mark.parametrize("depth", [900, 10_000, 100_000])
def test_deep_files_through_stdio_and_http_are_a_result_or_a_named_error(depth: int, tmp_path: Path) -> None:
    """Nested 900, 10,000 and 100,000 levels deep anywhere in a file, through the doors users take (a stdio
    server, ``serve`` over HTTP): prune_context and trim_context let a RecursionError escape at 10,000+."""
    names = deep_files(tmp_path, depth)
    env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(tmp_path), "CONTEXT_SHRINK_TOKENIZER": "tiktoken"}
    params = StdioServerParameters(command=sys.executable, args=[str(MODULE)], env=env, cwd=str(tmp_path))

    async def over_stdio() -> list[tuple[str, str, str]]:
        async with Client(params) as client:
            return await deep_calls(client, names)

    async def over_http(base: str) -> list[tuple[str, str, str]]:
        http = httpx2.AsyncClient(timeout=httpx2.Timeout(120, read=300))
        async with Client(streamable_http_client(base + "/mcp", http_client=http)) as client:
            return await deep_calls(client, names)

    assert anyio.run(over_stdio) == []
    with started("serve", log=tmp_path / "serve.log", env={"CONTEXT_SHRINK_ROOT": str(tmp_path)}) as base:
        assert anyio.run(over_http, base) == []


def test_a_tool_call_with_deep_arguments_is_still_shrunk_by_the_proxy() -> None:
    """A tool call's arguments are a JSON string the body's nesting check cannot see: nested 100,000 deep,
    they made the proxy's trim raise (forwarded unshrunk as an internal error)."""
    sent: list[dict[str, Any]] = []
    recorder = Recorder(lambda request, body: sent.append(json.loads(body)) or JSONResponse(SUMMARY))
    deep = "[" * 100_000 + "]" * 100_000
    messages = [{"role": "user", "content": "start"}]
    for k in range(12):
        calls = [{"id": f"c{k}", "type": "function", "function": {"name": "bash", "arguments": deep}}]
        messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": f"c{k}", "content": "output " * 400},
                     {"role": "user", "content": f"turn {k}"}]  # fmt: skip
    with serve(recorder) as upstream, proxied(upstream, window=8192) as url:
        reply = httpx2.post(url + "/chat/completions", json={"model": "m", "max_tokens": 9, "messages": messages},
                            timeout=120)  # fmt: skip
    said = reply.headers["x-context-shrink"]
    assert reply.status_code == 200 and "internal error" not in said and "action=trim" in said, said
    assert recorder.paths[-1].endswith("/chat/completions") and len(sent[-1]["messages"]) < len(messages)


@pytest.mark.parametrize("api", ["/chat/completions", "/messages", "/responses"])
def test_a_deeply_nested_proxy_body_is_relayed_with_the_reason(api: str) -> None:
    """A body nested 990+ deep was a bare 500."""
    recorder = Recorder()
    nested = '{"role": "user", "content": "hi", "meta": ' + "[" * 995 + "]" * 995 + "}"
    body = '{"model": "m", "max_tokens": 9, "messages": [' + nested + '], "input": [' + nested + "]}"
    with serve(recorder) as upstream, proxied(upstream, window=8192) as url:
        reply = httpx2.post(url + api, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200 and "nested" in reply.headers["x-context-shrink"]
    assert len(recorder.paths) == 1  # the upstream answers it


# --------------------------------------------------------------------------- session and output_path


@pytest.mark.parametrize("tool", ["prune_context", "trim_context", "compact_context"])
def test_a_session_with_an_output_path_is_refused_before_anything_is_written(
    tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune_context wrote the file and then failed; trim_context ignored output_path without a word."""
    for name, value in environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    path = claude_store(tmp_path, str(tmp_path))
    original = path.read_bytes()
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", session_stores=("claude",)))
    arguments = {"session": "claude:s1", "output_path": "out.json", "dry_run": False, "max_context_tokens": 300}
    said = error(
        run(call(server, tool, {**arguments, **({"summary": "s", "force": True} if "compact" in tool else {})}))
    )
    assert "output_path cannot be used with session" in said
    assert not (tmp_path / "out.json").exists() and path.read_bytes() == original


# --------------------------------------------------------------------------- paths: no check-then-use window


def swapped_after_the_check(monkeypatch: pytest.MonkeyPatch, folder: Path, outside: Path) -> None:
    """The race at its worst moment: just after a path inside the root was checked, a folder on its way is
    replaced by a symlink out of the root (what an attacker flipping the folder hit 1 time in 400)."""
    check = cs.resolve_path

    def racing(root: Path, path: str) -> Path:
        target = check(root, path)
        if not folder.is_symlink():
            folder.rename(folder.with_name(folder.name + ".real"))
            folder.symlink_to(outside, target_is_directory=True)
        return target

    monkeypatch.setattr(cs, "resolve_path", racing)


def jsonl(messages: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(m) + "\n" for m in messages)


READS = {
    "trim_context": {"messages_path": "sub/h.jsonl", "max_context_tokens": 100_000},
    "prune_context": {"messages_path": "sub/h.jsonl", "clear_tool_results_before": 0},
    "estimate_context": {"messages_path": "sub/h.jsonl"},
    "shrink_text": {"path": "sub/h.jsonl"},
}


@pytest.mark.parametrize("tool", list(READS))
def test_a_folder_swapped_for_a_symlink_after_the_check_is_not_read_through(
    tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read opened the path after checking it: a folder swapped meanwhile led it out of the root. Now the
    opened file itself is checked: refused, and nothing of the outside file comes back."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "h.jsonl").write_text(jsonl(conversation(3, size=5)))
    (outside / "h.jsonl").write_text(jsonl([{"role": "user", "content": "SECRET-OUTSIDE " * 20}] * 3))
    swapped_after_the_check(monkeypatch, root / "sub", outside)
    server = cs.build_server(cs.Config(root=root, tokenizer="tiktoken"))
    reply = run(call(server, tool, READS[tool]))
    assert "SECRET-OUTSIDE" not in json.dumps(reply.structured_content) + reply.content[0].text
    assert "moved while it was opened" in error(reply)


def test_a_folder_swapped_for_a_symlink_after_the_check_is_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary file and the rename went through the swapped folder, out of the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    swapped_after_the_check(monkeypatch, root / "sub", outside)
    server = cs.build_server(cs.Config(root=root, tokenizer="tiktoken"))
    reply = run(call(server, "trim_context", {"messages": conversation(3, size=5), "output_path": "sub/out.json"}))
    assert "moved while it was opened" in error(reply)
    assert list(outside.iterdir()) == []


def test_a_folder_flipping_to_a_symlink_never_lets_a_read_or_write_escape(tmp_path: Path) -> None:
    """An attacker flips a folder between itself and a symlink out of the root while files are read and
    written through it (400 of each, seeded timing): nothing outside is read, nothing lands outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    folder, aside = root / "sub", root / "sub.real"
    folder.mkdir(parents=True)
    outside.mkdir()
    (folder / "h.jsonl").write_text("inside\n")
    (outside / "h.jsonl").write_text("SECRET-OUTSIDE\n")
    stop, rng, escaped = threading.Event(), random.Random(34), []

    def flip() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                folder.rename(aside)
                folder.symlink_to(outside, target_is_directory=True)
                time.sleep(rng.random() / 5000)
                folder.unlink()
                aside.rename(folder)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for k in range(400):
            with contextlib.suppress(cs.ContextShrinkError):
                data = cs.read_file_bytes(cs.resolve_path(root, "sub/h.jsonl"), root=root)
                escaped += [f"read {k}"] if b"SECRET" in data else []
            with contextlib.suppress(cs.ContextShrinkError):
                cs.write_text_atomic(cs.resolve_path(root, "sub/out.json"), f"{k}\n", root=root)
            escaped += [f"wrote {k}: {p.name}" for p in outside.iterdir() if p.name != "h.jsonl"]
    finally:
        stop.set()
        flipper.join()
    assert escaped == []


def test_a_path_resolved_while_its_folder_was_missing_is_not_followed_through_a_new_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught once in CI under load (1 read and 1 write of 400 escaped): the check resolved the path while the
    flipped folder was missing (so it read as inside), then looked it up by name after the link was back,
    and the link led to the outside file the descriptor held. Now the check walks down from the root
    without following any link."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "h.jsonl").write_text("SECRET-OUTSIDE\n")
    resolved = cs.resolve_path(root, "sub/h.jsonl")  # sub is missing: resolved as it is written, inside
    (root / "sub").symlink_to(outside, target_is_directory=True)  # the link is put there meanwhile
    fd = os.open(resolved, os.O_RDONLY)
    monkeypatch.setattr(cs, "resolve_path", lambda root, path: resolved)  # the check's resolution, made then
    try:
        with pytest.raises(cs.ContextShrinkError, match="moved while it was opened"):
            cs.check_opened(fd, root, resolved)
    finally:
        os.close(fd)


def test_a_link_vanishing_while_it_is_resolved_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flipping folder above, caught mid-resolution once in CI: realpath read a link that was gone and a
    bare FileNotFoundError escaped resolve_path (a tool would answer "Error executing tool")."""

    def vanished(self: Path, strict: bool = False) -> Path:
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "resolve", vanished)
    with pytest.raises(cs.ContextShrinkError, match=r"could not be resolved .* changed while it was read"):
        cs.resolve_path(tmp_path, "sub/h.jsonl")


# --------------------------------------------------------------------------- one large shrink beside small requests


@pytest.mark.parametrize("rungs", [("diet", "clear", "trim"), ("compact", "trim")])
def test_no_step_of_a_shrink_runs_on_the_event_loop(rungs: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """While one 100k-message request was shrunk, a small one waited up to 19 s: steps between the rungs (the
    counts, the ledger of what a cut took out) ran on the event loop. Now every step runs in a worker thread;
    only the summariser's call is awaited on the loop (and its answer handed back to the steps)."""
    where: list[str] = []
    loop: list[int] = []
    count, ledger = cs.count_messages, cs.fact_ledger

    def counted(*args: Any, **kwargs: Any) -> Any:
        where.append("loop" if threading.get_ident() in loop else "worker")
        return count(*args, **kwargs)

    def noted(*args: Any, **kwargs: Any) -> Any:
        where.append("loop" if threading.get_ident() in loop else "worker")
        return ledger(*args, **kwargs)

    monkeypatch.setattr(cs, "count_messages", counted)
    monkeypatch.setattr(cs, "fact_ledger", noted)
    asked: list[str] = []

    async def summarise(messages: Any, plan: Any, max_tokens: int, growth: int) -> dict[str, Any]:
        asked.append("loop" if threading.get_ident() in loop else "worker")
        return {"summary": "the old turns read files", "summary_cached": False, "model_calls": 1}

    async def go() -> dict[str, Any]:
        loop.append(threading.get_ident())
        tokenizer = cs.resolve_tokenizer("tiktoken:cl100k_base")
        return await cs.shrink(conversation(40, size=60), [], tokenizer, 3000, cs.Policy(rungs=rungs), summarise)

    result = anyio.run(go)
    assert result["fits"] and where and set(where) == {"worker"}
    assert asked == (["loop"] if "compact" in rungs else [])
    assert result["action"] == ("compact" if "compact" in rungs else result["action"])


# --------------------------------------------------------------------------- a window in another tokenizer's tokens


def test_a_window_from_the_server_counted_with_another_tokenizer_says_so(tmp_path: Path) -> None:
    """With an explicit tiktoken tokenizer and max_context_tokens "auto", fits held in cl100k tokens but not
    necessarily in the server's, without a word. Now the report says which tokens fits is in."""

    def llama(request: Request, body: bytes) -> Response:
        if request.url.path == "/props":
            return JSONResponse({"default_generation_settings": {"n_ctx": 4096}})
        return JSONResponse({"error": "not here"}, status_code=404)

    with serve(Recorder(llama)) as upstream:
        config = cs.Config(root=tmp_path, tokenizer="tiktoken:cl100k_base", base_url=upstream)
        server = cs.build_server(config)
        found = ok(run(call(server, "estimate_context", {"messages": conversation(3, size=5),
                                                          "max_context_tokens": "auto"})))  # fmt: skip
        given = ok(run(call(server, "estimate_context", {"messages": conversation(3, size=5),
                                                          "max_context_tokens": 4096})))  # fmt: skip
    assert found["max_context_tokens"] == 4096 and found["max_context_source"] == "llama.cpp /props"
    assert "in the server's tokens" in found["tokenizer_note"] and "tiktoken:cl100k_base" in found["tokenizer_note"]
    assert "server's tokens" not in (given["tokenizer_note"] or "")  # a window the caller gave is in its own terms


# --------------------------------------------------------------------------- a learnt window is evidence


def refusing_once(refusal: dict[str, Any], times: int = 1) -> tuple[Recorder, list[int]]:
    """An upstream that refuses the first ``times`` requests with ``refusal``, then answers with usage."""
    calls: list[int] = []

    def answer(request: Request, body: bytes) -> Response:
        if not request.url.path.endswith("/chat/completions"):  # the proxy's probes: nothing to learn from
            return JSONResponse({"error": "not here"}, status_code=404)
        calls.append(1)
        if len(calls) <= times:
            return JSONResponse(refusal, status_code=400)
        reply = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": len(body) // 4, "completion_tokens": 1}}  # fmt: skip
        return JSONResponse(reply)

    return Recorder(answer), calls


@pytest.mark.parametrize(("window", "prompt"), [(300, 900), (4000, 10**27)])
def test_one_odd_refusal_does_not_change_every_later_request(window: int, prompt: int) -> None:
    """One refusal claiming a plausible wrong window (300 tokens), or a prompt of 10^27 tokens, cut or
    compacted every later request for that model (20 of 20)."""
    said = f"request ({prompt} tokens) exceeds the available context size ({window} tokens)"
    refusal = {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": prompt,
                         "n_ctx": window, "message": said}}  # fmt: skip
    recorder, _ = refusing_once(refusal)
    request = {"model": "m", "messages": conversation(8, size=80), "max_tokens": 64}  # 3,200 of 8,192 tokens
    with serve(recorder) as url, proxied(url, window=8192) as front:
        httpx2.post(f"{front}/chat/completions", json=request)
        later = [httpx2.post(f"{front}/chat/completions", json=request) for _ in range(20)]
    assert all(r.status_code == 200 for r in later)
    assert [r.headers["x-context-shrink"] for r in later if "action=none" not in r.headers["x-context-shrink"]] == []


def test_a_window_two_refusals_agree_on_is_learnt_and_a_larger_answer_corrects_it() -> None:
    """An upstream that really has a 1,024-token window: its first refusal serves the retry only, the second
    (the next request) teaches the window; an answer to a larger prompt later would make it forgotten."""

    def answer(request: Request, body: bytes) -> Response:
        if not request.url.path.endswith("/chat/completions"):
            return JSONResponse({"error": "not here"}, status_code=404)
        size = len(body) // 3  # about its tokens
        if size > 1024:
            said = f"request ({size} tokens) exceeds the available context size (1024 tokens)"
            return JSONResponse({"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": size,
                                           "n_ctx": 1024, "message": said}}, status_code=400)  # fmt: skip
        choice = {"message": {"role": "assistant", "content": "- ok"}, "finish_reason": "stop"}
        return JSONResponse({"choices": [choice], "usage": {"prompt_tokens": size, "completion_tokens": 1}})

    request = {"model": "m", "messages": conversation(8, size=80), "max_tokens": 64}
    with serve(Recorder(answer)) as url, proxied(url, window=8192) as front:
        first, second, third = (httpx2.post(f"{front}/chat/completions", json=request) for _ in range(3))
    assert "retried=1" in first.headers["x-context-shrink"] and "retried=1" in second.headers["x-context-shrink"]
    assert "window=1024" in third.headers["x-context-shrink"] and "retried" not in third.headers["x-context-shrink"]
    config = csp.ProxyConfig(upstream="http://x/v1", window=8192)
    state = csp.ProxyState(config, None, cs.resolve_tokenizer("tiktoken"))  # type: ignore[arg-type]
    state.windows["m"] = 1024
    state.learn_usage("m", 2000, 2000)  # the upstream answered a larger prompt than the learnt window
    assert "m" not in state.windows


# --------------------------------------------------------------------------- bounded time


def slow_body(port: int, head: str, seconds: float) -> float:
    """Send ``head`` and then a byte a second of a 10,000-byte body; how long until the server closes."""
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 5) as sock:
        sock.sendall(head.encode())
        with contextlib.suppress(OSError):
            while time.monotonic() - began < seconds:
                sock.sendall(b"x")
                sock.settimeout(1)
                try:
                    if sock.recv(65536) == b"":
                        break
                    while sock.recv(65536):  # an answer, then the close
                        pass
                    break
                except TimeoutError:
                    continue
    return time.monotonic() - began


@pytest.mark.parametrize("door", ["proxy", "serve"])
def test_a_slow_body_is_cut_off(door: str, tmp_path: Path) -> None:
    """100 of 100 slow bodies were still open after 45 s, including ones already refused 401."""
    recorder = Recorder()
    flags = ("--token", TOKEN) if door == "serve" else ()
    env = {"CONTEXT_SHRINK_PROXY_BODY_TIMEOUT": "2"}
    with serve(recorder) as upstream, started(door, "--upstream", upstream, *flags, log=tmp_path / "log",
                                              env=env) as base:  # fmt: skip
        port = int(base.rsplit(":", 1)[1])
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
                "content-length: 10000\r\n\r\n{")  # fmt: skip
        held = slow_body(port, head, 20)
    assert held < 15, f"a slow body held the connection {held:.0f} s"  # a bound, not a speed: 2 s + slack
    assert recorder.paths == []
