"""A tool call over streamable HTTP (`context-shrink serve`) against the same call over stdio.

    python bench/transports.py [--calls 200]

The official Python SDK client calls `estimate_context` on the example conversation (and `trim_context`
on a 2,000-message generated session) ``--calls`` times on one connection per transport: stdio (the
server as a subprocess), HTTP with MCP sessions, HTTP stateless, each a real `context-shrink` process on
this machine. It prints p50/p95 per transport and the ratio to stdio, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py"), str(ROOT / "bench")]

import anyio  # noqa: E402
import httpx2  # noqa: E402
from mcp import Client, StdioServerParameters  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from proxy_helpers import started  # noqa: E402
from workloads import generated  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.asynccontextmanager
async def connected(transport: str, log: Path, env: dict[str, str]) -> AsyncIterator[Client]:
    if transport == "stdio":
        params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "context_shrink.py")], env=env)
        async with Client(params) as client:
            yield client
        return
    flags = ["serve", "--token", TOKEN, *(["--stateless"] if transport == "HTTP stateless" else [])]
    with started(*flags, log=log, env=env) as base:
        async with (
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http,
            Client(streamable_http_client(base + "/mcp", http_client=http)) as client,
        ):
            yield client


async def timed(transport: str, calls: int, work: Path, arguments: dict[str, Any], tool: str) -> list[float]:
    env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(work), "CONTEXT_SHRINK_TOKENIZER": "tiktoken",
           "CONTEXT_SHRINK_LOG_LEVEL": "WARNING"}  # fmt: skip
    async with connected(transport, work / "log", env) as client:
        await client.call_tool(tool, arguments)  # warm: tokenizer loaded, session open
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            result = await client.call_tool(tool, arguments)
            times.append((time.perf_counter() - start) * 1000)
            assert not result.is_error, result.content[0].text
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    sample = json.loads((ROOT / "examples" / "sample-conversation.json").read_text())["messages"]
    cases = [
        ("estimate_context, example (12 messages)", "estimate_context", {"messages": sample}),
        ("trim_context, 2,000 generated messages", "trim_context",
         {"messages": generated(2000), "max_context_tokens": 32768}),
    ]  # fmt: skip
    transports = ["stdio", "HTTP sessions", "HTTP stateless"]
    print(f"A tool call through the Python SDK client, {args.calls} calls per cell (ms):\n")
    print("| call | " + " | ".join(f"{t} p50 | {t} p95" for t in transports) + " | HTTP ÷ stdio (p50) |")
    print("|---|" + "---:|---:|" * len(transports) + "---:|")
    with tempfile.TemporaryDirectory() as folder:
        for name, tool, arguments in cases:
            calls = args.calls if tool == "estimate_context" else max(5, args.calls // 20)
            cells, p50 = [], {}
            for transport in transports:
                times = anyio.run(timed, transport, calls, Path(folder), arguments, tool)
                p50[transport] = percentile(times, 0.5)
                cells += [f"{p50[transport]:.1f}", f"{percentile(times, 0.95):.1f}"]
            ratio = p50["HTTP sessions"] / p50["stdio"]
            print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
