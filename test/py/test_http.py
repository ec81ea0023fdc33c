"""``context-shrink serve``: the MCP tools over streamable HTTP at /mcp and the proxy at /v1, in one real
process, driven by the official Python SDK client (the TypeScript SDK and the MCP Inspector CLI drive it
in test/js/http.test.js)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from builders import chat_history, session
from fake_openai import FakeOpenAI, serve
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from proxy_helpers import MODULE, started

import context_shrink as cs
import context_shrink_proxy as csp

TOKEN = "test-token-0123456789abcdef"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def client(base: str, headers: dict[str, str] | None = None, **options: Any) -> Client:
    """The SDK's client over streamable HTTP, with ``headers`` on every request."""
    http = httpx2.AsyncClient(headers=headers or BEARER, timeout=httpx2.Timeout(120, read=300))
    return Client(streamable_http_client(base + "/mcp", http_client=http), **options)


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content[0].text
    return result.structured_content


@pytest.mark.parametrize("mode", ["stateful", "stateless"])
def test_the_python_sdk_over_http(tmp_path: Path, mode: str) -> None:
    """Tools listed, the three main tools called, structured results, a tool error, progress per summariser
    request and sampling by the client's model (no model configured), stateful and stateless."""
    fake = FakeOpenAI(window=2500)
    sampled: list[str] = []

    async def sampler(context: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        sampled.append(params.messages[0].content.text)
        text = f"- sampled summary {len(sampled)}: goal, files and next steps"
        return types.CreateMessageResult(role="assistant", content=types.TextContent(type="text", text=text), model="m")

    updates: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        updates.append(progress)

    history = session()
    arguments = {"messages": history, "force": True, "summary_context_tokens": 2500, "max_summary_tokens": 200}
    flags = ["serve", "--token", TOKEN, *(["--stateless"] if mode == "stateless" else [])]
    env = {"CONTEXT_SHRINK_ROOT": str(tmp_path)}
    with serve(fake) as backend:

        async def go() -> dict[str, Any]:
            with started(*flags, log=tmp_path / "plain.log", env=env) as plain:
                async with client(plain, sampling_callback=sampler) as mcp:
                    names = [t.name for t in (await mcp.list_tools()).tools]
                    measured = structured(await mcp.call_tool("estimate_context", {"messages": history}))
                    trimmed = structured(
                        await mcp.call_tool("trim_context", {"messages": history, "max_context_tokens": 3000})
                    )
                    failed = await mcp.call_tool("trim_context", {"messages": [{"role": "robot", "content": "x"}]})
                    sampled_result = structured(await mcp.call_tool("compact_context", arguments))
            backed = {**env, "CONTEXT_SHRINK_BASE_URL": backend, "CONTEXT_SHRINK_MODEL": "fake"}
            with started(*flags, log=tmp_path / "backed.log", env=backed) as base:
                async with client(base) as mcp:
                    progressed = structured(
                        await mcp.call_tool("compact_context", arguments, progress_callback=on_progress)
                    )
            return {"names": names, "measured": measured, "trimmed": trimmed, "failed": failed,
                    "sampled": sampled_result, "progressed": progressed}  # fmt: skip

        got = anyio.run(go)
    assert got["names"] == list(cs.TOOL_NAMES)
    assert got["measured"]["message_count"] == len(session()) and got["measured"]["tokens"] > 3000
    assert got["trimmed"]["tokens_after"] < got["measured"]["tokens"] and got["trimmed"]["messages"]
    assert got["failed"].is_error and "messages[0].role 'robot'" in got["failed"].content[0].text
    assert got["sampled"]["mode"] == "sampling" and "sampled summary" in got["sampled"]["summary"]
    assert len(sampled) == got["sampled"]["model_calls"] > 1
    assert got["progressed"]["compacted"] and len(updates) == got["progressed"]["model_calls"] > 1
    assert updates == sorted(updates)


def test_refusals_and_the_token_never_shown(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with started("serve", "--token", TOKEN, log=log) as base:
        about = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": about}
        accept = {"Accept": "application/json, text/event-stream"}
        none = httpx2.post(base + "/mcp", json=hello, headers=accept)
        wrong = httpx2.post(base + "/mcp", json=hello, headers={**accept, "Authorization": "Bearer " + "x" * 26})
        prefix = httpx2.post(base + "/mcp", json=hello, headers={**accept, "Authorization": f"Bearer {TOKEN[:-1]}"})
        foreign = httpx2.post(base + "/mcp", json=hello, headers={**accept, **BEARER, "Origin": "http://evil.example"})
        local = httpx2.post(base + "/mcp", json=hello, headers={**accept, **BEARER, "Origin": "http://localhost:3000"})
        keyed = httpx2.post(base + "/mcp", json=hello, headers={**accept, "x-api-key": TOKEN})
        health = httpx2.get(base + "/health")
    assert none.status_code == wrong.status_code == prefix.status_code == 401
    assert none.headers["www-authenticate"].startswith("Bearer") and "token" in none.json()["error"]["message"]
    assert foreign.status_code == 403 and "evil.example" in foreign.json()["error"]["message"]
    assert local.status_code == 200 and keyed.status_code == 200
    assert health.status_code == 200 and health.json() == {"status": "ok", "version": cs.__version__, "mcp": "/mcp",
                                                           "proxy": False}  # fmt: skip
    text = log.read_text()
    assert "bearer token required" in text and TOKEN not in text and TOKEN not in none.text + wrong.text


@pytest.mark.parametrize(
    ("flags", "env", "said"),
    [
        (["--host", "0.0.0.0"], {}, "needs a bearer token: --token or CONTEXT_SHRINK_HTTP_TOKEN"),
        (["--token", "short"], {}, "at least 16"),
        (["--host", "0.0.0.0"], {"CONTEXT_SHRINK_HTTP_TOKEN": "a b" * 8}, "without spaces"),
        (["--port", "99999"], {}, "--port must be a port number"),
        (["--upstream", "ftp://x"], {}, "must be an http(s) URL"),
    ],
)
def test_it_will_not_serve_beyond_this_machine_without_a_token(
    flags: list[str], env: dict[str, str], said: str
) -> None:
    run = subprocess.run([sys.executable, str(MODULE), "serve", "--port", "0", *flags], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})  # fmt: skip
    assert run.returncode == 2 and said in run.stderr and run.stdout == ""


def test_v1_and_mcp_at_once_and_recall_reads_what_the_proxy_archived(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000, latency=0.2)
    histories = [chat_history(30, size=300)[: 21 + 2 * k] for k in range(4)]
    with serve(fake) as upstream:  # the store in memory: the tools find what the proxy archived in one process
        flags = ("serve", "--token", TOKEN, "--upstream", upstream, "--window", "6000", "--state", "memory")
        with started(*flags, log=tmp_path / "log", env={"CONTEXT_SHRINK_ROOT": str(tmp_path)}) as base:

            def proxied(messages: list[dict[str, Any]]) -> httpx2.Response:
                body = {"model": "m", "messages": messages, "max_tokens": 200}
                return httpx2.post(base + "/v1/chat/completions", json=body, headers=BEARER, timeout=120)

            async def tools() -> list[dict[str, Any]]:
                async with client(base) as mcp:
                    calls = [mcp.call_tool("estimate_context", {"messages": h}) for h in histories]
                    return [structured(await c) for c in calls]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(proxied, histories))
                measured = pool.submit(anyio.run, tools).result()
                replies += list(pool.map(proxied, histories))
            unauthorised = httpx2.post(base + "/v1/chat/completions", json={"model": "m", "messages": histories[0]})
            stats = httpx2.get(base + "/context-shrink/stats", headers=BEARER).json()

            async def recall() -> dict[str, Any]:
                async with client(base) as mcp:
                    return structured(await mcp.call_tool("recall_context", {"query": "file_0.py"}))

            recalled = anyio.run(recall)
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
    assert all("action=compact" in r.headers["x-context-shrink"] for r in replies)
    assert [m["message_count"] for m in measured] == [len(h) for h in histories]
    assert unauthorised.status_code == 401 and stats["totals"]["requests"] == len(replies)
    assert all(r["auth"] is None for r in fake.requests)  # this server's token never goes upstream
    assert recalled["archive"] == "memory" and histories[0][1] in [e["message"] for e in recalled["entries"]]
    assert TOKEN not in (tmp_path / "log").read_text() and TOKEN not in json.dumps(recalled)


@pytest.mark.parametrize("mode", ["stateful", "stateless"])
def test_a_client_that_goes_away_cancels_the_compaction(tmp_path: Path, mode: str) -> None:
    """A compaction whose summariser takes a second a request, one request at a time: the client gives up
    after 1.5 s, and the server asks the summariser nothing more (the whole compaction asks more than
    twice), then serves the next client."""
    arguments = {"messages": session(), "force": True, "summary_context_tokens": 2500, "max_summary_tokens": 200}
    whole = FakeOpenAI(window=2500)
    with serve(whole) as url:
        config = cs.Config(root=tmp_path, tokenizer="tiktoken", model="m", base_url=url, summary_concurrency=1)
        server = cs.build_server(config)

        async def uncancelled() -> dict[str, Any]:
            async with Client(server) as mcp:
                return structured(await mcp.call_tool("compact_context", arguments))

        assert anyio.run(uncancelled)["model_calls"] > 2
    fake = FakeOpenAI(window=2500, latency=1.0)
    flags = ["serve", "--token", TOKEN, *(["--stateless"] if mode == "stateless" else [])]
    with serve(fake) as backend:
        env = {"CONTEXT_SHRINK_ROOT": str(tmp_path), "CONTEXT_SHRINK_BASE_URL": backend, "CONTEXT_SHRINK_MODEL": "m",
               "CONTEXT_SHRINK_SUMMARY_CONCURRENCY": "1"}  # fmt: skip
        with started(*flags, log=tmp_path / "log", env=env) as base:

            async def leave() -> None:
                async with client(base) as mcp:
                    with anyio.move_on_after(1.5):
                        await mcp.call_tool("compact_context", arguments)

            async def next_client() -> dict[str, Any]:
                async with client(base) as mcp:
                    return structured(await mcp.call_tool("estimate_context", {"messages": session()}))

            anyio.run(leave)
            asked = len(fake.requests)
            anyio.run(anyio.sleep, 4)
            measured = anyio.run(next_client)
    assert asked <= 2 and len(fake.requests) == asked and fake.active == 0, (asked, len(fake.requests))
    assert measured["message_count"] == len(session())


def test_the_container_serves_with_the_token_from_its_environment(tmp_path: Path) -> None:
    """The Dockerfile's contract, run here without Docker: a non-root user, the files it copies exist, its
    command refuses to start without CONTEXT_SHRINK_HTTP_TOKEN, and with it serves what its health check
    asks for."""
    text = (MODULE.parent / "Dockerfile").read_text()
    user = re.search(r"^USER (\S+)$", text, re.M)
    assert user and user.group(1) not in ("root", "0")
    copied = re.search(r"^COPY ((?:.|\\\n)+?) \./$", text, re.M)
    names = copied.group(1).replace("\\\n", " ").split() if copied else []
    assert names and all((MODULE.parent / name).is_file() for name in names)
    assert {p.name for p in MODULE.parent.glob("context_shrink*.py")} <= set(names)  # the core and its companions
    command = json.loads(re.findall(r"^CMD (\[.*\])$", text, re.M)[-1])
    check = json.loads(re.search(r"^    CMD (\[.*\])$", text, re.M).group(1))
    assert command[:2] == ["context-shrink", "serve"] and command[command.index("--host") + 1] == "0.0.0.0"
    refused = subprocess.run([sys.executable, str(MODULE), *command[1:]], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert refused.returncode == 2 and "CONTEXT_SHRINK_HTTP_TOKEN" in refused.stderr
    env = {"CONTEXT_SHRINK_HTTP_TOKEN": TOKEN, "CONTEXT_SHRINK_ROOT": str(tmp_path)}
    with started(*command[1:], log=tmp_path / "log", env=env) as base:
        port = base.rsplit(":", 1)[1]
        health = subprocess.run([sys.executable, *[a.replace("8787", port) for a in check[1:]]], timeout=30)
        refused_mcp = httpx2.post(base + "/mcp", json={})
    assert health.returncode == 0 and refused_mcp.status_code == 401


def test_connections_accepted_by_the_servers_listener_send_without_delay() -> None:
    """The proxy and serve listen on a socket bound before uvicorn starts; a connection accepted from it must
    have TCP_NODELAY (asyncio sets it only when the socket says IPPROTO_TCP), or every streamed reply on a
    kept-alive connection waits for the client's delayed ACK."""
    listener = csp.bound_listener("127.0.0.1", 0)
    seen: list[int] = []

    async def check() -> None:
        done = asyncio.Event()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
            done.set()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            await asyncio.wait_for(done.wait(), 10)
            writer.close()

    asyncio.run(check())
    assert seen == [1]


def test_a_history_over_the_sdks_4_mib_default_is_served(tmp_path: Path) -> None:
    """The proxy's body cap (64 MiB, --max-body-bytes) applies to /mcp too: the SDK's default, 4 MiB, is a
    2,000-message agent session, which stdio serves."""
    history = [{"role": "user", "content": f"line {k} " * 1000} for k in range(700)]  # about 6 MB of JSON
    with started("serve", log=tmp_path / "log", env={"CONTEXT_SHRINK_ROOT": str(tmp_path)}) as base:

        async def go() -> dict[str, Any]:
            async with client(base, headers={}) as mcp:
                return structured(await mcp.call_tool("estimate_context", {"messages": history}))

        measured = anyio.run(go)
    assert len(json.dumps(history)) > 5 * 2**20 and measured["message_count"] == 700
