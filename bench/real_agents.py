"""The real agents through the real proxy at small windows (#49): what the model was sent when it answered.

    python bench/real_agents.py [--windows 8192 16384] [--agents opencode codex claude qwen cline aider] [--turns 20]
                                [--module OLD/context_shrink.py]

Each agent (installed under test/agents: `./test/test.sh` installs them; all of them unless --agents) runs
--turns turns of the long-session plan (test/py/long_sessions.py: each turn reads two or three files of 1.6-3k
tokens with the agent's own file tool, aider is given them; ten facts planted in turns 1-5, five typed by the
user) through a real `context-shrink proxy` in front of a scripted llama.cpp-like model. Per agent and window:
turns finished, refusals, the share of the turns' file *lines* the model was sent when it answered (the text, not
the headers), the ceiling of that share (what the budget leaves beside the fixed part as sent, over the turn's
files, per answer: no proxy can send more), the share the model was sent in any request (at 16k, what the
agent's own reads carry: Cline cuts a read over 8,000 characters), the user's facts (of 5) and all facts (of 10)
in the last request, summary calls, and the fixed part as sent (system prompt and tools, cl100k tokens). --module
runs another checkout's proxy in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

import agents  # noqa: E402
import long_sessions  # noqa: E402
import proxy_helpers  # noqa: E402

import context_shrink as cs  # noqa: E402


def measure(agent: str, window: int, turns: int, module: Path | None) -> str:
    proxy_helpers.MODULE = module or Path(cs.__file__)
    with tempfile.TemporaryDirectory() as where:
        run = long_sessions.run_long(agent, Path(where), window, turns)
        users = sum(needle in run.last for _, needle in long_sessions.USER_FACTS)
        return (f"{run.finished}/{turns} | {len(run.upstream.refused)} | {run.text_sent():.0%} | "
                f"{run.text_ceiling():.0%} | {run.own_ceiling():.0%} | {users}/5 | {len(run.facts_kept())}/10 | "
                f"{long_sessions.summary_requests(run.upstream.log)} | {run.fixed_sent():,}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[8192, 16_384])
    parser.add_argument("--agents", nargs="+", default=list(agents.LONG_AGENTS), choices=list(agents.LONG_AGENTS))
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--module", type=Path, help="another checkout's context_shrink.py, measured beside")
    args = parser.parse_args()
    modules = [("now", None)] + ([("before", args.module)] if args.module else [])
    print(
        "| agent | window | proxy | turns | refused | file text sent | ceiling | sent in any request | user facts "
        "| facts | summary calls | fixed part sent |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for window in args.windows:
        for agent in args.agents:
            for label, module in modules:
                try:
                    row = measure(agent, window, args.turns, module)
                except Exception as exc:  # an agent that did not get through: said in the row
                    row = f"failed: {json.dumps(str(exc)[:80])} | | | | | | | | "
                print(f"| {agent} | {window:,} | {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
