"""One conversation sent turn by turn through proxies that keep what they learn in a store (``--state``): one
proxy throughout, one restarted mid-conversation, or two replicas taking the turns in turn. What the upstream
(the suite's scriptable server) received is the measure: its summary requests, and the bytes of every other
request, which must not depend on which process sent them."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from fake_openai import FakeOpenAI, serve
from proxy_helpers import proxy

import context_shrink as cs

WORDS = ("parser", "token", "window", "cache", "replica", "summary", "request", "model", "server", "store",
         "lease", "archive", "index", "query", "commit", "branch", "test", "fixture", "module", "function")  # fmt: skip


def turns(count: int = 30, tokens: int = 600, seed: int = 3) -> list[list[dict[str, Any]]]:
    """The request of each turn of one conversation: the history so far, ending on the turn's user message
    (a turn is about ``tokens`` cl100k tokens: an ask and a long answer)."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    requests = []
    for n in range(count):
        ask = f"Turn {n}: look at src/mod_{n}.py and " + " ".join(rng.choice(WORDS) for _ in range(60))
        history.append({"role": "user", "content": ask})
        requests.append([dict(m) for m in history])
        answer = f"In src/mod_{n}.py I found " + " ".join(rng.choice(WORDS) for _ in range(tokens - 90))
        history.append({"role": "assistant", "content": answer})
    return requests


@dataclasses.dataclass
class Run:
    summary_calls: int
    bodies: list[bytes]  # what the upstream received for each turn (the last request of each)
    headers: list[dict[str, str]]


def summary_call(body: dict[str, Any]) -> bool:
    return any(m.get("content") in (cs.SUMMARY_PROMPT, cs.MERGE_PROMPT) for m in body.get("messages", []))


@contextlib.contextmanager
def proxies(upstream: str, states: list[str], log: Path, *flags: str) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(proxy(upstream, "--state", s, "--no-archive", *flags, log=log)) for s in states]


def run(mode: str, state: str, log: Path, count: int = 30, restart_at: int = 20, *flags: str) -> Run:
    """The conversation through ``mode``: ``one`` proxy, one ``restart``-ed before turn ``restart_at``, or two
    ``replicas`` on the same ``state`` alternating; what the upstream received."""
    fake = FakeOpenAI(window=4096)
    fake.usage_ratio = 1.0
    bodies, headers = [], []
    with serve(fake) as upstream, httpx2.Client(timeout=120) as client:
        fronts = contextlib.ExitStack()
        urls = fronts.enter_context(proxies(upstream, [state] * (2 if mode == "replicas" else 1), log, *flags))
        for n, messages in enumerate(turns(count)):
            if mode == "restart" and n == restart_at:
                fronts.close()
                urls = fronts.enter_context(proxies(upstream, [state], log, *flags))
            before = len(fake.requests)
            reply = client.post(f"{urls[n % len(urls)]}/chat/completions",
                                json={"model": "m", "messages": messages, "max_tokens": 256})  # fmt: skip
            assert reply.status_code == 200, reply.text
            sent = [r for r in fake.requests[before:] if not summary_call(r["body"])]
            bodies.append(sent[-1]["raw"])
            headers.append(dict(reply.headers))
        fronts.close()
    return Run(sum(summary_call(r["body"]) for r in fake.requests), bodies, headers)
