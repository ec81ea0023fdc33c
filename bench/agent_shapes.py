"""Agents of every shape through the real proxy (#49): what the model was sent, per shape.

    python bench/agent_shapes.py [--turns 20] [--module OLD/context_shrink.py]

Each named shape of test/py/test_any_agent.py (an agent whose system prompt and tools fill most of the window,
one that re-sends context before the conversation, the same or updated, one with few-shot examples, one that
compacts its own history with a lossy summary, all of them at once; 16k and 8k windows) is driven for --turns
turns through a real `context-shrink proxy` in front of a scripted model (test/py/generated_agents.py). Per
shape: turns answered, refusals, the share of the turns' file lines the model was sent when it answered, the
user's facts (of 5) and all facts (of 10) in the last request, summary calls, and the fixed part as sent.
--module runs the proxy of another checkout in the same run, for the table before and after.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from generated_agents import Shape, drive  # noqa: E402

SHAPES = {
    "fixed part 80 %, long tool descriptions": Shape(fixed_share=0.8),
    "context re-sent, updated every request": Shape(resend="updated"),
    "context re-sent, the same": Shape(resend="same"),
    "few-shot example exchanges": Shape(few_shot=3),
    "compacts its own history at turn 15": Shape(compacts_at=15),
    "all of them, sequential reads": Shape(fixed_share=0.7, resend="same", few_shot=2, compacts_at=15, parallel=False),
    "8k: fixed part 85 %": Shape(window=8192, fixed_share=0.85),
    "8k: updated context, few-shot, compacts": Shape(
        window=8192, fixed_share=0.5, resend="updated", few_shot=2, compacts_at=12
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--module", type=Path, help="another checkout's context_shrink.py, measured beside")
    args = parser.parse_args()
    modules = [("now", None)] + ([("before", args.module)] if args.module else [])
    print("| shape | proxy | turns | refused | files sent | user facts | facts | summary calls | fixed part sent |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, shape in SHAPES.items():
        for label, module in modules:
            with tempfile.TemporaryDirectory() as where:
                try:
                    run = drive(shape, args.turns, Path(where), module=module)
                except AssertionError as exc:  # a turn the proxy did not get answered
                    print(f"| {name} | {label} | failed: {str(exc)[:80]} | | | | | | |", flush=True)
                    continue
            users, facts = run.facts_in_last()
            print(
                f"| {name} | {label} | {len(run.turns)} | {run.refused} | {run.files_sent():.0%} | {users}/5 | "
                f"{facts}/10 | {run.summary_calls} | {run.fixed_after:,} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
