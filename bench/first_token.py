"""Time to the first words of a streamed reply while the proxy offers the model its recall tool, per wire API.

    python bench/first_token.py [--requests 5] [--delay 1.0] [--module OLD/context_shrink.py]

A scripted model (test/py/recalling.py) streams a few words, then takes --delay seconds to finish each reply; with
a recall, its first reply ends in a call to the recall tool, the proxy answers it and asks again, and the second
reply takes --delay too. Measured per API (Chat Completions, Responses, Anthropic Messages), in the same run:
straight to the model (no recall offered: the floor), and through a real `context-shrink proxy` whose request
folds something away, so that the recall tool is offered, without a recall and with one. Each cell is the
median of --requests: the time to the first words the client reads, and to the reply's end. --module runs the
proxy of another checkout (say, the one before the stream was relayed as it comes) for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

import httpx2  # noqa: E402
from agent_requests import claude_request, codex_request  # noqa: E402
from fake_openai import serve  # noqa: E402
from proxy_helpers import started  # noqa: E402
from recalling import PREAMBLE, SlowRecaller  # noqa: E402

WINDOW = 6000
APIS = {"Chat Completions": "/chat/completions", "Responses": "/responses", "Anthropic Messages": "/messages"}


def chat_request(turns: int, size: int) -> dict[str, Any]:
    """An OpenCode-like request: turns of a shell call and its output, then a new ask."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are opencode."}]
    for t in range(turns):
        call = {"id": f"c{t}", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "cat"}'}}
        messages += [{"role": "user", "content": f"read f{t}"}, {"role": "assistant", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{t}", "content": f"line {t}\n" * size}]  # fmt: skip
    messages.append({"role": "user", "content": "and now run the tests"})
    tool = {"type": "function", "function": {"name": "shell", "description": "Run.", "parameters": {"type": "object"}}}
    return {"model": "m", "messages": messages, "tools": [tool], "max_tokens": 512}


BODIES = {"Chat Completions": chat_request, "Responses": codex_request, "Anthropic Messages": claude_request}


def timed(url: str, body: dict[str, Any]) -> tuple[float, float]:
    """Seconds to the first words the client reads, and to the end of the reply."""
    start, first = time.perf_counter(), None
    with httpx2.stream("POST", url, json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if first is None and PREAMBLE in line:
                first = time.perf_counter() - start
    return (first if first is not None else float("nan")), time.perf_counter() - start


def median(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds each reply takes after its first words")
    parser.add_argument("--module", type=Path, help="the context_shrink.py of another checkout to run the proxy")
    args = parser.parse_args()
    print(f"| API | route | first words ms (median of {args.requests}) | reply's end ms | first ÷ end |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "proxy.log"
        for api, path in APIS.items():
            body = BODIES[api](24, 80)
            for route, recalls in (("straight to the model", None), ("proxy, recall offered", 0),
                                   ("proxy, one recall", 1)):  # fmt: skip
                model = SlowRecaller(WINDOW, "cat f0", times=recalls or 0, patience=args.delay)
                firsts, ends = [], []
                with serve(model) as upstream:
                    if recalls is None:
                        url = upstream + path
                        for _ in range(args.requests):
                            first, end = timed(url, body)
                            firsts.append(first), ends.append(end)
                    else:
                        flags = ("proxy", "--upstream", upstream, "--window", str(WINDOW), "--no-archive")
                        with started(*flags, log=log, module=args.module) as base:
                            for _ in range(args.requests):
                                first, end = timed(base + "/v1" + path, body)
                                firsts.append(first), ends.append(end)
                ratio = statistics.median(firsts) / statistics.median(ends)
                print(f"| {api} | {route} | {median(firsts)} | {median(ends)} | {ratio:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
