"""How often an agent's next request only appends to its previous one: the case the proxy's remembered
plans serve (a stable replay goes on where the previous turn's stopped; a summary and every memo of a
message's text are found again).

    python bench/appends.py [--steps 12]

Each real agent (OpenCode on Chat Completions, Codex CLI on Responses, Claude Code on Anthropic Messages,
installed by ./test/test.sh in test/agents) runs the suite's task straight against its scripted server
(test/py/agent_upstream.py) with a window large enough that nothing is refused, and every request it sent
is read as the proxy reads it (its chat view). A request *appends* when its messages start with every
message of the previous request of the same conversation, equal by value; else the table says where the
two first differ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from agent_upstream import request_view  # noqa: E402
from agents import Setup, binary, run_session  # noqa: E402

import context_shrink_state as cst  # noqa: E402


def appends(agent: str, steps: int) -> tuple[int, int, list[str]]:
    """(requests that followed another of their conversation, those that appended to it, why the others
    did not)."""
    with tempfile.TemporaryDirectory() as folder:
        session = run_session(agent, Path(folder), proxied=False, steps=steps, setup=Setup(window=10_000_000))
    last: dict[str, list[dict]] = {}
    followed, appended, why = 0, 0, []
    for path, body in session.upstream.log:
        messages = request_view(path, body).messages
        if not messages:
            continue
        conversation = cst.conversation_id(messages)
        before = last.get(conversation)
        last[conversation] = messages
        if before is None:
            continue
        followed += 1
        if messages[: len(before)] == before:
            appended += 1
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(before, messages, strict=False)) if a != b),
            min(len(before), len(messages)),
        )
        why.append(f"{len(before)} -> {len(messages)} messages, first difference at {first}"
                   f" ({before[first]['role'] if first < len(before) else 'end'})")  # fmt: skip
    return followed, appended, why


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print("| agent (API) | requests after another of the conversation | appended only | share | not appended |")
    print("|---|---:|---:|---:|---|")
    for agent, api in (("opencode", "chat"), ("codex", "responses"), ("claude", "messages")):
        binary(agent)
        followed, appended, why = appends(agent, args.steps)
        share = f"{appended / followed:.2f}" if followed else "—"
        print(f"| {agent} ({api}) | {followed} | {appended} | {share} | {'; '.join(why[:3]) or '—'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
