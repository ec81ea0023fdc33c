"""Run ``context-shrink proxy`` (or ``serve``) as a real subprocess on 127.0.0.1, the way a user starts it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tiny_llama import free_port

MODULE = Path(__file__).resolve().parents[2] / "context_shrink.py"


@contextlib.contextmanager
def proxy(upstream: str, *flags: str, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start the proxy in front of ``upstream``; yields its base URL (``.../v1``). Its stderr goes to ``log``."""
    with started("proxy", "--upstream", upstream, *flags, log=log, env=env) as base:
        yield base + "/v1"


@contextlib.contextmanager
def started(*arguments: str, log: Path, env: dict[str, str] | None = None, module: Path | None = None) -> Iterator[str]:
    """Run ``context_shrink.py <arguments> --port P`` (this checkout's, or ``module``) until it listens; yields
    ``http://127.0.0.1:P``."""
    port = free_port()
    command = [sys.executable, str(module or MODULE), *arguments, "--port", str(port)]
    environment = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "tiktoken", **(env or {})}
    with log.open("ab") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=environment)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if process.poll() is not None:
                raise RuntimeError(f"{arguments[0]} exited with {process.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{arguments[0]} did not start listening within 30 s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
