"""A real redis-server on a free port of 127.0.0.1, nothing persisted (for the tests and bench/state.py)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def started_redis(folder: Path) -> Iterator[str]:
    """``redis-server`` from the PATH, its files in ``folder``, until the block ends; yields its URL."""
    with redis_process(folder) as (url, _):
        yield url


@contextlib.contextmanager
def redis_process(folder: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`started_redis`, and its process (to stop it, or freeze it, in the middle of a test)."""
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server on this machine (apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [found, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
               str(folder)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (exit {process.poll()})")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", process
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)  # a frozen one ends too
        process.terminate()
        process.wait(timeout=10)
