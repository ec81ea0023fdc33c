"""Small requests while large ones are processed (#34, #58): does a large request stall the proxy?

Starts ``context_shrink.py proxy`` (this checkout's, or ``--module PATH``: another version's, to compare) in
front of a scripted upstream in this process, measures small requests with the proxy idle (the baseline, same
run), then sends each large request and, while the proxy works on it, a small chat request every 50 ms:

* ``messages``: a chat request of ``--messages`` messages (100,000), far over the window, trimmed;
* ``prompt``: a system prompt of ``--prompt-mb`` MB (13) the proxy makes leaner (the tools' cut, the verbatim
  diet, the outline) before it finds it cannot fit;
* ``recall``: a model that calls the recall tool with a query of ``--query-words`` words (1,500) over a history
  of 40,000 folded lines.

Prints a Markdown table: each case's large request time and the small requests' latency (p50, p95, max) and
what that adds to the idle p50, and beside it the latency of small requests sent straight to the upstream
meanwhile (the upstream's own share: it reads the large body too); the floor row is the small requests while
another process keeps one core busy (the proxy idle): what a machine this busy costs on its own.

    .venv/bin/python bench/stall.py [--cases messages prompt recall] [--module OLD/context_shrink.py]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[1]
REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 10, "completion_tokens": 1}}  # fmt: skip
WORDS = ("parser", "token", "window", "cache", "replica", "summary", "request", "model", "server", "store", "lease",
         "archive", "index", "query", "commit", "branch", "test", "fixture", "module", "function")  # fmt: skip
QUERY: list[str] = []  # the recall case's query, in the upstream's process


async def answer(request: Request) -> JSONResponse:
    """The upstream: ``ok``, or, to a request offering the recall tool that has not recalled yet, a recall call."""
    raw = await request.body()
    if b"context_recall" not in raw:
        return JSONResponse(REPLY)
    body = json.loads(raw)
    tools = [(t.get("function") or {}).get("name") for t in body.get("tools") or []]
    recalled = any(m.get("role") == "tool" and m.get("tool_call_id") == "recall-1" for m in body.get("messages", []))
    if "context_recall" in tools and not recalled and QUERY:
        asked = json.dumps({"query": " ".join(QUERY)})
        call = {"id": "recall-1", "type": "function", "function": {"name": "context_recall", "arguments": asked}}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return JSONResponse({"choices": [{"message": message, "finish_reason": "tool_calls"}]})
    return JSONResponse(REPLY)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_upstream(port: int, words: int) -> None:
    """The upstream's process (apart from the client's: parsing a large body holds its interpreter's lock)."""
    QUERY[:] = query(words)
    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")).run()


def query(words: int) -> list[str]:
    return [random.Random(k).choice(WORDS) + str(k % 97) for k in range(words)]


@contextlib.contextmanager
def upstream(words: int) -> Iterator[str]:
    port = free_port()
    server = multiprocessing.Process(target=serve_upstream, args=(port, words), daemon=True)
    server.start()
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.terminate()
    server.join()


@contextlib.contextmanager
def proxy(module: Path, base: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "tiktoken"}
    folder = tempfile.mkdtemp(prefix="stall-")  # archived and learnt as by default, not in the user's folder
    command = [sys.executable, str(module), "proxy", "--upstream", base, "--port", str(port), "--window", "32768",
               "--rungs", "diet,clear,trim", "--archive-dir", folder,
               "--state", f"sqlite:{folder}/state.sqlite3"]  # fmt: skip
    process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    try:
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def history(n: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = [{"role": "system", "content": "You are a coding agent."}]
    for k in range(n // 2):
        said = f"file_{k}.py defines parse_{k}() and calls it {k} times."
        out += [{"role": "user", "content": f"step {k}: look at file_{k}.py and tell me what it does"},
                {"role": "assistant", "content": said}]  # fmt: skip
    return out


def prompt_request(megabytes: float) -> dict[str, Any]:
    """A system prompt of paragraphs, many lines repeated, ``megabytes`` long; two tools; a short history."""
    rng = random.Random(5)
    paragraphs, size = [], 0
    while size < megabytes * 1e6:
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(6)]
        paragraphs.append("\n".join(lines))
        size += sum(map(len, lines)) + 8
    tool = {"type": "function", "function": {"name": "shell", "description": "Run a command. " * 40,
                                             "parameters": {"type": "object"}}}  # fmt: skip
    system = {"role": "system", "content": "\n\n".join(paragraphs)}
    return {"model": "m", "messages": [system, {"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 64}


def recall_request(lines: int) -> dict[str, Any]:
    """A history of tool results of ``lines`` lines in all, far over the window: most is folded away."""
    rng = random.Random(6)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "read every module"}]  # fmt: skip
    per = 200
    for k in range(lines // per):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "m{k}.py"}}'}}
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(per))
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{k}", "content": text}]  # fmt: skip
    messages.append({"role": "user", "content": "now summarise the store module"})
    tool = {"type": "function", "function": {"name": "read", "description": "Read a file.",
                                             "parameters": {"type": "object"}}}  # fmt: skip
    return {"model": "m", "messages": messages, "tools": [tool], "max_tokens": 64}


def small_latencies(url: str, stop: threading.Event, seconds: float | None = None) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    out: list[float] = []
    began = time.monotonic()
    with httpx2.Client(timeout=120) as client:
        while not stop.is_set() and (seconds is None or time.monotonic() - began < seconds):
            t = time.perf_counter()
            client.post(url + "/chat/completions", json=body)
            out.append((time.perf_counter() - t) * 1000)
            time.sleep(0.05)
    return out


def during(url: str, base: str, big: dict[str, Any]) -> tuple[float, list[float], list[float]]:
    """The large request's seconds through the proxy, the small requests' latencies meanwhile, and those of small
    requests sent straight to the upstream meanwhile (the upstream's own share: it reads the large body too). The
    large body is written before they start (this process writing megabytes of JSON would stall them itself)."""
    stop, latencies, straight, raw = threading.Event(), [], [], json.dumps(big).encode()
    watchers = [threading.Thread(target=lambda: latencies.extend(small_latencies(url, stop))),
                threading.Thread(target=lambda: straight.extend(small_latencies(base, stop)))]  # fmt: skip
    started = time.perf_counter()
    for watcher in watchers:
        watcher.start()
    httpx2.post(url + "/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=600)
    large = time.perf_counter() - started
    stop.set()
    for watcher in watchers:
        watcher.join()
    return large, latencies, straight


def spin(seconds: float) -> None:
    """A core kept busy (the floor: what a machine this busy costs a small request, the proxy idle)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def floor(url: str, seconds: float = 5.0) -> list[float]:
    busy = multiprocessing.Process(target=spin, args=(seconds,), daemon=True)
    busy.start()
    latencies = small_latencies(url, threading.Event(), seconds=seconds)
    busy.join()
    return latencies


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["messages", "prompt", "recall"],
                        choices=["messages", "prompt", "recall"])  # fmt: skip
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--prompt-mb", type=float, default=13.0)
    parser.add_argument("--query-words", type=int, default=1_500)
    parser.add_argument("--module", type=Path, default=ROOT / "context_shrink.py")
    args = parser.parse_args()
    bigs = {"messages": lambda: {"model": "m", "messages": history(args.messages), "max_tokens": 64},
            "prompt": lambda: prompt_request(args.prompt_mb), "recall": lambda: recall_request(40_000)}  # fmt: skip
    rows = []
    with upstream(args.query_words) as base, proxy(args.module, base) as url:
        idle = small_latencies(url, threading.Event(), seconds=3)
        rows.append(("(floor: one core kept busy by another process)", 5.0, floor(url), []))
        for case in args.cases:
            rows.append((case, *during(url, base, bigs[case]())))
    base_p50 = statistics.median(idle)
    print(f"module: {args.module}; idle: {len(idle)} small requests, p50 {base_p50:.1f} ms, max {max(idle):.1f} ms\n")
    print("| large request | its time s | small requests | p50 ms | p95 ms | max ms | added p50 / p95 / max ms | "
          "straight to the upstream meanwhile: p95 / max ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for case, large, values, straight in rows:
        p50, p95, most = statistics.median(values), quantile(values, 0.95), max(values)
        added = f"{p50 - base_p50:.0f} / {p95 - base_p50:.0f} / {most - base_p50:.0f}"
        upstream_own = f"{quantile(straight, 0.95):.1f} / {max(straight):.1f}" if straight else ""
        print(
            f"| {case} | {large:.1f} | {len(values)} | {p50:.1f} | {p95:.1f} | {most:.1f} | {added} | {upstream_own} |"
        )


if __name__ == "__main__":
    main()
