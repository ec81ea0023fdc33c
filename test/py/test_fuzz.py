"""Every tool fuzzed over the real stdio transport (#18): seeded hypothesis batches of calls with hostile
arguments — random JSON of every type, lone surrogates, 5,000-deep nesting, huge numbers, paths to a FIFO, a
device-sized sparse file, a link out of the root, unknown tools and lines that are not JSON-RPC at all.

Each batch must leave: every request answered under its id (no hang), the server alive (no crash), no
traceback in its log, no secret and nothing from outside the root in any reply or log line (no leak), and
every answer a tool result, a tool error or a JSON-RPC error. ``CONTEXT_SHRINK_FUZZ_EXAMPLES`` sets the
number of batches (default 50 x 40 calls)."""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import conversation
from conftest import ROOT
from fake_openai import FakeOpenAI, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stores import claude_store
from stores import environ as sessions_environ

import context_shrink as cs

SECRET = "sk-FUZZ-SECRET-4242"
OUTSIDE = "OUTSIDE-THE-ROOT-7f3a"  # the content of a file outside the root, reachable only through a link
BATCH = 40
EXAMPLES = int(os.environ.get("CONTEXT_SHRINK_FUZZ_EXAMPLES", "50"))
DEADLINE = 120.0  # seconds for one batch to be answered in full


class StdioServer:
    """``context-shrink`` as an MCP client starts it, spoken to line by line."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "context_shrink.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=ROOT,
        )
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self.read, daemon=True).start()
        hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "fuzz", "version": "1"}}
        self.send([json.dumps({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": hello})])
        assert "result" in self.collect({"init"})["init"]
        self.send([json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})])

    def read(self) -> None:
        assert self.process.stdout
        for line in self.process.stdout:
            self.replies.put(json.loads(line))  # stdout is the protocol's: anything else is a failure here

    def send(self, lines: list[str]) -> None:
        assert self.process.stdin
        self.process.stdin.write(("\n".join(lines) + "\n").encode())
        self.process.stdin.flush()

    def collect(self, ids: set[Any]) -> dict[Any, dict[str, Any]]:
        """The replies to ``ids`` (and any reply with a null id, under None), waiting at most the deadline."""
        got: dict[Any, dict[str, Any]] = {}
        ends = time.monotonic() + DEADLINE
        while not ids <= got.keys():
            try:
                reply = self.replies.get(timeout=max(0.01, ends - time.monotonic()))
            except queue.Empty:
                missing = sorted(map(str, ids - got.keys()))[:5]
                pytest.fail(f"no reply within {DEADLINE:g} s to {len(ids - got.keys())} request(s): {missing}")
            got[reply.get("id")] = reply
        return got

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StdioServer, Path]]:
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside") / "secret.json"
    outside.write_text(json.dumps([{"role": "user", "content": OUTSIDE}]))
    (root / "history.json").write_text(json.dumps(conversation(6, size=30)))
    (root / "notes.txt").write_text("line one\nline two\nERROR: three\n")
    (root / "leak.json").symlink_to(outside)
    os.mkfifo(root / "pipe.json")
    with (root / "big.json").open("wb") as big:  # sparse: past the size cap without using the disk
        big.truncate(600 * 1024 * 1024)
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as url:
        home = root.parent / "home"  # the agents' stores the session tools may read: a Claude Code session here
        claude_store(home, str(root))
        env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(root), "CONTEXT_SHRINK_API_KEY": SECRET,
               "CONTEXT_SHRINK_BASE_URL": url, "CONTEXT_SHRINK_MODEL": "fake", "CONTEXT_SHRINK_TOKENIZER": "tiktoken",
               "CONTEXT_SHRINK_ARCHIVE_DIR": str(root / "archive"), **sessions_environ(home),
               "CONTEXT_SHRINK_SESSION_STORES": "claude,codex,opencode"}  # fmt: skip
        server = StdioServer(env, root.parent / "server.log")
        try:
            yield server, root.parent / "server.log"
        finally:
            server.close()


# --------------------------------------------------------------------------- what is sent

HOSTILE = [
    "\ud800", "a\udfffb", "../../etc/passwd", "/etc/passwd", "/dev/zero", "pipe.json", "leak.json", "big.json",
    "history.json", "notes.txt", ".", "", "auto", "http://127.0.0.1:1/v1", "x" * 20_000, "\x00", "null",
    "DEEP",
]  # fmt: skip
text = st.text(st.characters(exclude_categories=()), max_size=40) | st.sampled_from(HOSTILE)
scalar = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | text
)
json_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                          max_leaves=12)  # fmt: skip
role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bogus", None, 3])
message = st.fixed_dictionaries(
    {"role": role},
    optional={"content": json_value, "tool_calls": json_value, "tool_call_id": text, "name": text},
)
messages = st.lists(message, max_size=8) | st.just(conversation(4, size=20))
value = json_value | messages | st.sampled_from(HOSTILE)


PATHS = ["history.json", "notes.txt", "pipe.json", "big.json", "leak.json", "../../etc/passwd", "/dev/zero", ".",
         "archive", "out.json", "sub/out.json", "history.json"]  # fmt: skip


PRIMARY = ["messages", "text", "plan", "query"]


def typed(name: str, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value of the type the parameter's schema names, often at or past its bounds."""
    if "anyOf" in schema:
        return st.one_of([typed(name, branch) for branch in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if name == "messages":
        return messages
    if name.endswith("path"):
        return st.sampled_from(PATHS)
    if kind == "integer":
        low, high = schema.get("minimum", -(2**40)), schema.get("maximum", 2**40)
        return st.integers(low, high) | st.sampled_from([low - 1, high + 1, 0, 1, 2**63])
    if kind == "number":
        return st.floats(-1.0, 2.0) | st.sampled_from([0.0, 1.0, 1e308, -0.0])
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.sampled_from(["", "auto", "tiktoken", "heuristic", "pytest -k x", "ERROR"]) | text
    if kind == "array":
        return st.lists(text | json_value, max_size=4)
    return json_value


@st.composite
def call(draw: st.DrawFn, tools: dict[str, dict[str, Any]], n: int) -> str:
    """One JSON-RPC line: a tool call with arguments mostly of the right type (a quarter anything at all,
    some the tool does not take), or a line that is not a valid request."""
    kind = draw(st.sampled_from(["call"] * 8 + ["unknown tool", "not json-rpc"]))
    if kind == "not json-rpc":
        bad_method = json.dumps({"jsonrpc": "2.0", "id": n, "method": 7})
        bad_params = json.dumps({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": "x"})
        return draw(st.sampled_from(["garbage", "[]", "{}", bad_method, bad_params]))
    name = draw(st.sampled_from(sorted(tools))) if kind == "call" else draw(text)
    known = tools.get(name, {"messages": {"type": "array"}})
    main = [k for k in PRIMARY if k in known][: 1 if "messages" in known else 2]  # what the tool works on
    keys = [*main[: draw(st.sampled_from([0] + [2] * 5))], *draw(st.lists(st.sampled_from(sorted(known)), max_size=4))]
    arguments = {k: draw(value if draw(st.integers(0, 5)) == 0 else typed(k, known[k])) for k in dict.fromkeys(keys)}
    if draw(st.integers(0, 5)) == 0:
        arguments.update(draw(st.dictionaries(text, value, max_size=2)))
    line = json.dumps(
        {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    )  # fmt: skip (ensure_ascii: a lone surrogate goes out as \ud800)
    return line.replace('"DEEP"', "[" * 5000 + "]" * 5000)


def tool_parameters(server: StdioServer) -> dict[str, dict[str, Any]]:
    server.send([json.dumps({"jsonrpc": "2.0", "id": "tools", "method": "tools/list"})])
    listed = server.collect({"tools"})["tools"]["result"]["tools"]
    return {t["name"]: t["inputSchema"].get("properties", {}) for t in listed}


# --------------------------------------------------------------------------- what must hold


def check_reply(reply: dict[str, Any]) -> None:
    assert reply.get("jsonrpc") == "2.0" and ("result" in reply) != ("error" in reply), reply
    if "error" in reply:
        assert isinstance(reply["error"]["code"], int) and reply["error"]["message"]
    else:
        content = reply["result"].get("content")
        assert isinstance(content, list), reply
        if reply["result"].get("isError"):
            assert content and content[0]["text"], reply  # an error says what was wrong
    seen = json.dumps(reply)
    assert SECRET not in seen and OUTSIDE not in seen, seen[:300]


def outcome(line: str, reply: dict[str, Any]) -> str:
    """What a call came to, by tool: ``result``, ``tool error`` or ``protocol error``."""
    found = re.search(r'"params": \{"name": "(\w+)"', line)
    if not found:
        return "not a call"
    name = found[1] if found[1] in cs.TOOL_NAMES else "unknown tool"
    if "error" in reply:
        return f"{name}: protocol error"
    return f"{name}: {'tool error' if reply['result'].get('isError') else 'result'}"


def test_every_tool_survives_a_thousand_hostile_calls(fuzzed: tuple[StdioServer, Path]) -> None:
    server, log = fuzzed
    tools = tool_parameters(server)
    assert set(tools) == set(cs.TOOL_NAMES)
    sent: list[int] = []
    tally: collections.Counter[str] = collections.Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data())
    def batch(data: st.DataObject) -> None:
        first = 1 + sum(sent)
        lines = [data.draw(call(tools, first + k)) for k in range(BATCH)]
        server.send(lines)
        ids = {first + k for k, line in enumerate(lines) if line.startswith("{") and '"id"' in line}
        for n, reply in server.collect(ids).items():
            check_reply(reply)
            tally[outcome(lines[n - first] if isinstance(n, int) and 0 <= n - first < BATCH else "", reply)] += 1
        assert server.process.poll() is None, "the server died"
        sent.append(BATCH)

    batch()
    server.send([json.dumps({"jsonrpc": "2.0", "id": "after", "method": "tools/list"})])
    assert "tools" in server.collect({"after"})["after"]["result"]  # still serving
    stderr = log.read_text(errors="replace")
    assert "Traceback" not in stderr and SECRET not in stderr and OUTSIDE not in stderr
    assert sum(sent) >= min(1000, EXAMPLES * BATCH)
    print(sorted(tally.items()))
    for name in cs.TOOL_NAMES:  # every tool was reached, and answered both ways
        assert tally[f"{name}: result"] and tally[f"{name}: tool error"], tally
