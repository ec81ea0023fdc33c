"""Agent-shaped chat histories, deterministic from a seed, for property tests and benchmarks.

The shapes are the ones real agents send and trimmers break on: Codex-style single-turn tool loops of 50-300
steps after a system + developer pair and several consecutive user messages; multi-turn sessions with parallel
tool calls, reasoning fields, images and ``content`` null / string / parts; giant tool results (up to 1.5x the
budget) anywhere, also just before a short user question; a ``tool_call_id`` reused in a later turn (tau-bench
logs do it: pairing is by adjacency, not by id); a "continued session" summary in the middle; and histories
that cannot fit at all (the leading messages and the newest user message alone exceed the budget).

``agent_history(seed, budget)`` picks a shape and its sizes from the seed alone; ``cases()`` is the
hypothesis strategy over seeds, budgets and sizes (hypothesis shrinks the knobs, the seed keeps it exact).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import struct
from typing import Any

Message = dict[str, Any]

WORDS = [
    *[
        "config",
        "parser",
        "cache",
        "token",
        "budget",
        "window",
        "message",
        "session",
        "request",
        "handler",
        "retry",
        "timeout",
        "schema",
        "model",
    ],
    *[
        "client",
        "server",
        "router",
        "index",
        "archive",
        "summary",
        "chunk",
        "stream",
        "buffer",
        "queue",
        "worker",
        "pool",
        "lock",
        "manager",
    ],
    *[
        "loader",
        "registry",
        "plugin",
        "adapter",
        "encoder",
        "decoder",
        "validator",
        "metrics",
        "tracer",
        "logger",
        "assert",
        "error",
    ],
]
TOOLS = ("read_file", "bash", "grep", "edit_file", "list_dir", "get_reservation", "search_flights")
SHAPES = ("codex", "claude", "chat", "tau", "giant_before_question", "impossible", "mixed")
PNG = (
    "data:image/png;base64,"
    + base64.b64encode(
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR" + struct.pack(">II", 640, 480) + b"\x08\x02" + b"\x00" * 600
    ).decode()
)


class _Writer:
    """Builds one history; every random choice comes from ``rng``."""

    def __init__(self, rng: random.Random, budget: int, scale: float) -> None:
        self.rng, self.budget, self.scale = rng, budget, scale
        self.messages: list[Message] = []
        self.calls = 0
        self.reuse_ids = False

    def text(self, tokens: int) -> str:
        """About ``tokens`` cl100k tokens of log-like lines (about 4 characters a token)."""
        tokens = max(1, int(tokens))
        line = " ".join(self.rng.choice(WORDS) for _ in range(12))
        lines = max(1, tokens // 16)
        if lines == 1:
            return " ".join(self.rng.choice(WORDS) for _ in range(max(1, tokens * 3 // 4)))
        return "".join(f"{k:5d} {line}\n" for k in range(lines))

    def sized(self, share: float) -> int:
        """A size that is ``share`` of the budget, scaled by the history's size knob."""
        return max(1, int(self.budget * share * self.scale))

    def content(self, text: str) -> Any:
        kind = self.rng.random()
        if kind < 0.15:
            return [{"type": "text", "text": text}]
        if kind < 0.2:
            return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": PNG}}]
        return text

    def system(self, developer: bool) -> None:
        self.messages.append({"role": "system", "content": self.text(self.sized(0.04))})
        if developer:
            self.messages.append({"role": "developer", "content": self.text(self.sized(0.02))})

    def users(self, count: int, question: bool = False) -> None:
        for k in range(count):
            size = 8 if question else self.rng.choice([12, 40, 120, self.sized(0.03)])
            self.messages.append({"role": "user", "content": self.content(f"request {k}: " + self.text(size))})

    def summary(self) -> None:
        text = "This session is being continued from a previous conversation. Summary:\n" + self.text(self.sized(0.1))
        self.messages.append({"role": "user", "content": text})

    def step(self, giant: bool = False, parallel: int = 1) -> None:
        ids = []
        for _ in range(parallel):
            self.calls += 1
            ids.append(f"call_{self.calls % 3}" if self.reuse_ids else f"call_{self.calls}")
        assistant: Message = {
            "role": "assistant",
            "content": self.rng.choice([None, None, "", "Let me look. " + self.text(20)]),
            "tool_calls": [
                {
                    "id": i,
                    "type": "function",
                    "function": {
                        "name": self.rng.choice(TOOLS),
                        "arguments": json.dumps({"path": f"src/{self.rng.choice(WORDS)}.py", "n": k}),
                    },
                }
                for k, i in enumerate(ids)
            ],
        }
        if self.rng.random() < 0.25:
            assistant["reasoning_content"] = "Thinking: " + self.text(self.rng.choice([30, 200, self.sized(0.05)]))
        self.messages.append(assistant)
        for k, i in enumerate(ids):
            if giant and k == 0:
                size = self.sized(self.rng.uniform(0.3, 1.5))
            else:
                size = self.rng.choice([5, 30, 150, 600, self.sized(0.04), self.sized(0.12)])
            self.messages.append({"role": "tool", "tool_call_id": i, "content": self.content(self.text(size))})

    def answer(self) -> None:
        message: Message = {"role": "assistant", "content": self.text(self.rng.choice([20, 80, 300]))}
        if self.rng.random() < 0.3:
            message["reasoning_content"] = self.text(self.rng.choice([40, 400]))
        self.messages.append(message)

    def loop(self, steps: int, giant_rate: float) -> None:
        for _ in range(steps):
            self.step(giant=self.rng.random() < giant_rate, parallel=self.rng.choice([1, 1, 1, 2, 3]))


def agent_history(seed: int, budget: int = 8192, shape: str | None = None, scale: float = 1.0) -> list[Message]:
    """An agent-shaped history for ``budget``, chosen and sized from ``seed`` alone (see the module docstring).

    ``scale`` multiplies the sizes that are relative to the budget (larger: the history exceeds it more).
    """
    rng = random.Random(seed)
    shape = shape or rng.choice(SHAPES)
    w = _Writer(rng, budget, scale)
    if shape == "codex":  # system + developer, 1-4 users, one long tool loop
        w.system(developer=True)
        w.users(rng.randint(2, 4))
        w.loop(rng.randint(50, 300), giant_rate=0.01)
    elif shape == "claude":  # turns with parallel calls, reasoning, giant reads, maybe a continued session
        w.system(developer=False)
        if rng.random() < 0.5:
            w.summary()
        for _ in range(rng.randint(1, 6)):
            w.users(rng.randint(1, 2))
            w.loop(rng.randint(1, 40), giant_rate=0.03)
            if rng.random() < 0.7:
                w.answer()
    elif shape == "chat":  # plain turns, content parts and images
        if rng.random() < 0.7:
            w.system(developer=rng.random() < 0.3)
        for _ in range(rng.randint(2, 30)):
            w.users(1)
            w.answer()
    elif shape == "tau":  # short tool turns that reuse call ids
        w.reuse_ids = True
        w.system(developer=False)
        for _ in range(rng.randint(3, 25)):
            w.users(1)
            w.loop(rng.randint(1, 4), giant_rate=0.0)
            w.answer()
    elif shape == "giant_before_question":  # a huge read in the previous turn, then a short question
        w.system(developer=rng.random() < 0.5)
        for _ in range(rng.randint(1, 4)):
            w.users(1)
            w.loop(rng.randint(2, 12), giant_rate=0.0)
            w.answer()
        w.users(1)
        w.loop(rng.randint(0, 3), giant_rate=0.0)
        w.step(giant=True)
        w.users(1, question=True)
    elif shape == "impossible":  # the leading messages and the newest request alone exceed the budget
        w.system(developer=False)
        w.messages[0]["content"] += w.text(w.budget * rng.choice([0.5, 1.2]))
        w.users(1)
        w.loop(rng.randint(1, 10), giant_rate=0.1)
        w.messages.append({"role": "user", "content": w.text(w.budget * rng.choice([0.6, 1.1]))})
    else:  # mixed: everything at once
        w.system(developer=rng.random() < 0.5)
        w.reuse_ids = rng.random() < 0.3
        for t in range(rng.randint(1, 8)):
            if t and rng.random() < 0.15:
                w.summary()
            w.users(rng.randint(1, 4))
            w.loop(rng.randint(0, 60), giant_rate=0.05)
            if rng.random() < 0.5:
                w.answer()
    end = rng.random()
    if end < 0.2 and w.messages[-1]["role"] != "user":
        w.users(1, question=True)
    elif end < 0.3:
        w.step(parallel=2)
    return w.messages


@dataclasses.dataclass(frozen=True)
class Case:
    """A generated history's recipe: small to print, exact to rebuild (``case.build()``)."""

    seed: int
    budget: int
    shape: str
    scale: float

    def build(self) -> list[Message]:
        return agent_history(self.seed, self.budget, self.shape, self.scale)


BUDGETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def cases(min_budget: int = 1024, max_budget: int = 131072, shapes: tuple[str, ...] = SHAPES) -> Any:
    """A hypothesis strategy of :class:`Case` recipes (imported lazily: benchmarks need no hypothesis)."""
    from hypothesis import strategies as st

    return st.builds(
        Case,
        st.integers(0, 2**32 - 1),
        st.sampled_from([b for b in BUDGETS if min_budget <= b <= max_budget]),
        st.sampled_from(shapes),
        st.sampled_from([0.5, 1.0, 2.0]),
    )
