"""Small requests while one large one is shrunk (#34): does one 100k-message request stall the proxy?

Starts ``context_shrink.py proxy`` (this checkout's, or ``--module PATH``: another version's, to compare)
in front of a scripted upstream in this process, sends one large chat request (``--messages`` messages, far
over the window), and while the proxy works on it sends a small request every 50 ms. Prints a Markdown
table: the small requests' latency with the proxy idle (the baseline, same run) and during the large one,
p50 and max, and their ratio.

    .venv/bin/python bench/stall.py [--messages 100000] [--module OLD/context_shrink.py]
"""

from __future__ import annotations

import argparse
import contextlib
import os
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

import httpx2
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROOT = Path(__file__).resolve().parents[1]
REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 10, "completion_tokens": 1}}  # fmt: skip


async def answer(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse(REPLY)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def upstream() -> Iterator[str]:
    port = free_port()
    app = Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True


@contextlib.contextmanager
def proxy(module: Path, base: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "tiktoken"}
    archive = tempfile.mkdtemp(prefix="stall-archive-")  # archived as by default, not in the user's folder
    command = [sys.executable, str(module), "proxy", "--upstream", base, "--port", str(port), "--window", "32768",
               "--rungs", "diet,clear,trim", "--archive-dir", archive]  # fmt: skip
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
        shutil.rmtree(archive, ignore_errors=True)


def history(n: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = [{"role": "system", "content": "You are a coding agent."}]
    for k in range(n // 2):
        said = f"file_{k}.py defines parse_{k}() and calls it {k} times."
        out += [{"role": "user", "content": f"step {k}: look at file_{k}.py and tell me what it does"},
                {"role": "assistant", "content": said}]  # fmt: skip
    return out


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--module", type=Path, default=ROOT / "context_shrink.py")
    args = parser.parse_args()
    big = {"model": "m", "messages": history(args.messages), "max_tokens": 64}
    with upstream() as base, proxy(args.module, base) as url:
        idle = small_latencies(url, threading.Event(), seconds=3)
        stop, during = threading.Event(), []

        def measure() -> None:
            during.extend(small_latencies(url, stop))

        watcher = threading.Thread(target=measure)
        started = time.perf_counter()
        watcher.start()
        httpx2.post(url + "/chat/completions", json=big, timeout=600)
        large = time.perf_counter() - started
        stop.set()
        watcher.join()
    print(f"module: {args.module}; large request: {args.messages:,} messages, {large:.1f} s through the proxy\n")
    print("| small requests | n | p50 ms | max ms |")
    print("|---|---|---|---|")
    for name, values in (("proxy idle (baseline)", idle), ("during the large request", during)):
        print(f"| {name} | {len(values)} | {statistics.median(values):.1f} | {max(values):.1f} |")
    print(f"\nmax during ÷ p50 idle: {max(during) / statistics.median(idle):.0f}x")


if __name__ == "__main__":
    main()
