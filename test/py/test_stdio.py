"""The one real stdio round trip through the Python SDK (the shipped example), and the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import ROOT

import context_shrink as cs


def test_python_example_over_stdio() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python-client.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "tools: " + ", ".join(cs.TOOL_NAMES)
    assert lines[1].startswith("estimate_context: 1309 tokens of 32768 (tiktoken:cl100k_base)")
    assert re.search(r"dropped \d+ messages, fits=True", lines[2])
    assert "compact_context (plan): needs_summary=True" in lines[3]
    assert "messages[0].role 'robot'" in lines[4]
    assert "context-shrink 0.1.0" in run.stderr  # logs go to stderr, never stdout


def test_version_and_help() -> None:
    version = subprocess.run(
        [sys.executable, str(ROOT / "context_shrink.py"), "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == f"context-shrink {cs.__version__}"
    helptext = subprocess.run(
        [sys.executable, str(ROOT / "context_shrink.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "CONTEXT_SHRINK_" in helptext.stdout


def raw_session(lines: list[str]) -> list[dict[str, object]]:
    """Send ``lines`` to a real stdio server after the handshake; every reply it wrote, in order."""
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}
    head = [
        json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": hello}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    ]
    done = json.dumps({"jsonrpc": "2.0", "id": "last", "method": "tools/list"})
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "context_shrink.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert process.stdin and process.stdout
    process.stdin.write(("\n".join([*head, *lines, done]) + "\n").encode())
    process.stdin.flush()
    replies = []
    try:
        while line := process.stdout.readline():
            replies.append(json.loads(line))
            if replies[-1].get("id") == "last":
                break
    finally:
        process.kill()
        process.wait()
    return replies[1:]


def test_every_request_gets_an_answer_even_unreadable_ones() -> None:
    """A lone surrogate (a valid JSON escape, not a character), 10,000-deep nesting and a malformed request:
    the SDK's reader drops such lines; the server answers each with a JSON-RPC error naming the problem,
    under the request's id, and goes on serving."""
    call = '{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"estimate_context","arguments":%s}}'
    lines = [
        call % (1, '{"messages":[{"role":"user","content":"a\\ud800b"}]}'),
        call % (2, '{"messages":' + "[" * 10_000 + "]" * 10_000 + "}"),
        '{"jsonrpc":"2.0","id":"three","method":5}',
        '{"id": 4, "jsonrpc": "2.0", "params": {"id": 99, "deep": [[[["\\ud800"]]]]}, "method": "tools/list"}',
        "not json at all",
    ]
    replies = raw_session(lines)
    by_id = {r.get("id"): r for r in replies}
    assert "surrogate" in by_id[1]["error"]["message"] and by_id[1]["error"]["code"] == -32700
    assert "nested too deeply" in by_id[2]["error"]["message"]
    assert by_id["three"]["error"]["code"] == -32600 and "method" in by_id["three"]["error"]["message"]
    assert by_id[4]["error"]["code"] == -32700  # the top-level id, not the one inside params
    assert by_id[None]["error"]["code"] == -32700  # no id to be found: null, as JSON-RPC says
    assert "tools" in by_id["last"]["result"]  # still serving


def test_jsonrpc_id_scans_the_top_level_only() -> None:
    assert cs.jsonrpc_id('{"params": {"id": 1}, "id": "x\\"y"}') == 'x"y'
    assert cs.jsonrpc_id('{"jsonrpc": "2.0", "id" : -7, "params": ' + "[" * 50_000) == -7
    assert cs.jsonrpc_id('{"method": "m", "params": {"id": 3}}') is None
    assert cs.jsonrpc_id('{"id": "\\ud800"}') is None  # not a string that can be sent back
    assert cs.jsonrpc_id("") is None and cs.jsonrpc_id('"id": 5') is None
