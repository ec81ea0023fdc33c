"""Cache-friendly shrinking: replay histories turn by turn and count the prompt tokens a server must prefill.

    python bench/replay.py [--budgets 8192 16384 32768] [--no-server] [--no-door]

Replayed: every transcript (bench/workloads.py), and generated agent shapes (test/py/agent_shapes.py,
seed 1, sized for each budget): a Codex-style single-turn loop of 50-300 steps, a giant read just before a
short question, Claude-Code-style turns, tau-bench turns that reuse call ids, and everything mixed. A request
is made before every assistant message and at the end (the history so far), shrunk by: a sliding window (the
newest whole units that fit: what LangChain's trim_messages does), trim_context with target_ratio 1.0 and 0.6, and
compact_context with a given summary (target_ratio 0.5, the tool's default, and the proxy's), and trim_context
at 0.6 through the MCP door as users call it (a real stdio server, the official Python SDK client). For each
request, prefill = its tokens minus the longest common token prefix with the previous request (a server's
prompt cache reuses that prefix). The floor is what is new since the previous request. Reported per history
and budget: total prefill, the floor, the excess over the floor relative to the sliding window's excess
(target at 32k: 0.3 or less), the mean and the minimum budget use of the requests that needed shrinking
(mean 0.5 or more), how often the prefix changed, and backward moves: requests that bring back a message an
earlier request had dropped (target 0). Then one transcript is replayed against the real llama.cpp server
(cache_prompt on) and its own count of processed prompt tokens (timings.prompt_n) is summed, to check the
simulation against a real cache.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from agent_shapes import agent_history  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402
from plots import lines  # noqa: E402
from prefill import (  # noqa: E402
    TOK,
    Messages,
    Shrink,
    Shrunk,
    mcp_door,
    replay,
    request_points,
    sliding,
    trim_in_process,
    trim_through,
)
from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def compact(ratio: float) -> Shrink:
    def shrink(messages: Messages, budget: int) -> Shrunk:
        options = {"max_context_tokens": budget, "max_summary_tokens": 512, "target_ratio": ratio}
        plan = cs.compact_messages(messages, TOK, summary=None, **options)
        if not plan["needs_summary"]:
            return plan["messages"] or messages, list(range(len(messages)))
        start, end = plan["summarize_from_index"], plan["kept_from_index"]
        digest = hashlib.sha256(json.dumps(messages[start:end], sort_keys=True).encode()).hexdigest()[:12]
        summary = f"- the work so far, summarised (span {digest}): goals, files, commands, errors and next steps"
        done = cs.compact_messages(messages, TOK, summary=summary, **options)
        return done["messages"], [*range(start), *done["pinned_indices"], *range(end, len(messages))]

    return shrink


STRATEGIES: dict[str, Shrink] = {
    "sliding window": sliding,
    "trim 1.0": trim_in_process(1.0),
    "trim 0.6": trim_in_process(0.6),
    "compact 0.5 (summary given)": compact(0.5),
    f"compact {cs.Policy().compact_ratio} (the proxy's)": compact(cs.Policy().compact_ratio),
}
DOOR = "trim_context 0.6 over stdio (the MCP door)"  # what users call: an option the door lost shows only here
GENERATED = ("codex", "giant_before_question", "claude", "tau", "mixed")


def server_replay(messages: Messages, budget: int) -> dict[str, int]:
    """Processed prompt tokens reported by llama.cpp (timings.prompt_n), per strategy, cache_prompt on."""
    import httpx2
    from tiny_llama import llama_server, write_tiny_gguf

    totals = {}
    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_gguf(Path(folder) / "tiny.gguf", n_ctx_train=32768)
        with llama_server(model, n_ctx=32768) as url:
            for name, shrink in STRATEGIES.items():
                total = 0
                for i in request_points(messages):
                    request, _ = shrink(messages[:i], budget)
                    body = {"messages": request, "max_tokens": 1, "cache_prompt": True, "temperature": 0}
                    reply = httpx2.post(f"{url}/chat/completions", json=body, timeout=300)
                    if reply.status_code != 200:
                        continue  # e.g. a history ending on an unanswered tool call
                    total += reply.json()["timings"]["prompt_n"]
                totals[name] = total
    return totals


def histories(budget: int) -> dict[str, Messages]:
    """The shared transcripts and the generated shapes for ``budget``, by name."""
    out = {p.stem[:36]: load(p) for p in transcript_paths()}
    out.update({f"generated {shape}": agent_history(1, budget, shape) for shape in GENERATED})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--no-door", action="store_true", help="skip the replay through the MCP tool over stdio")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        strategies = dict(STRATEGIES)
        if not args.no_door:  # the MCP tool, as users call it: a real stdio server
            env = {
                **os.environ,
                "CONTEXT_SHRINK_TOKENIZER": "tiktoken:cl100k_base",
                "CONTEXT_SHRINK_LOG_LEVEL": "ERROR",
            }
            params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "context_shrink.py")], env=env)
            strategies[DOOR] = trim_through(stack.enter_context(mcp_door(params)), 0.6)
        return report(args, strategies)


def prefill_figure(name: str, budget: int, results: dict[str, dict[str, Any]]) -> None:
    """The cumulative prefill of each strategy, request by request, over one history, beside the floor."""
    series = {}
    for strategy, result in results.items():
        steps = result["per_request"]
        series[strategy] = (list(range(1, len(steps) + 1)), list(itertools.accumulate(p for p, _ in steps)))
    steps = next(iter(results.values()))["per_request"]
    series["floor (what is new)"] = (list(range(1, len(steps) + 1)), list(itertools.accumulate(f for _, f in steps)))
    lines("prefill", f"what the server must prefill, request by request ({name[:24]}…, {budget // 1024}k)",
          "request (one before every assistant message)", "cumulative prefill, cl100k tokens", series)  # fmt: skip


def report(args: argparse.Namespace, strategies: dict[str, Shrink]) -> int:
    print("| history | budget | strategy | requests | prefill | floor | excess ÷ sliding's | budget use: mean "
          "| min | prefix changed | backward moves |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary: dict[tuple[str, int], list[float]] = {}
    worst: dict[tuple[str, int], float] = {}
    longest: tuple[int, str, int, dict[str, Any]] = (0, "", 0, {})  # the figure's history: the most requests
    for budget in args.budgets:
        for name, messages in histories(budget).items():
            requests = len(request_points(messages))
            if cs.count_messages(messages, TOK)[1] <= budget:
                continue  # never needs shrinking at this budget
            results = {s: replay(messages, budget, fn) for s, fn in strategies.items()}
            if budget == max(args.budgets) and requests > longest[0]:
                longest = (requests, name, budget, results)
            base = results["sliding window"]["prefill"] - results["sliding window"]["floor"]
            for s, r in results.items():
                excess = (r["prefill"] - r["floor"]) / base if base > 0 else 0.0
                summary.setdefault((s, budget), []).append(excess)
                worst[s, budget] = max(worst.get((s, budget), 0.0), excess)
                use = f"{r['use']:.2f} | {r['min_use']:.2f}" if r["use"] is not None else "— | —"
                print(
                    f"| {name} | {budget // 1024}k | {s} | {requests} | {r['prefill']:,} | {r['floor']:,} | "
                    f"{excess:.2f} | {use} | {r['changes']} | {r['backward']} |",
                    flush=True,
                )
    print("\nExcess over the floor, relative to the sliding window: median (worst) over the histories:\n")
    print("| strategy | " + " | ".join(f"{b // 1024}k" for b in args.budgets) + " |")
    print("|---|" + "---:|" * len(args.budgets))
    for s in strategies:
        cells = [(summary.get((s, b)), worst.get((s, b))) for b in args.budgets]
        print(f"| {s} | " + " | ".join(f"{statistics.median(c):.2f} ({w:.2f})" if c else "—" for c, w in cells) + " |")
    if longest[3]:
        prefill_figure(*longest[1:])
    if args.no_server:
        return 0
    name = "openhands_llama-4-maverick_ponyc-45"
    sessions = {p.stem[:36]: load(p) for p in transcript_paths()}
    chosen = next((m for n, m in sessions.items() if n.startswith(name)), next(iter(sessions.values())))
    budget = 8192
    simulated = {s: replay(chosen, budget, fn)["prefill"] for s, fn in STRATEGIES.items()}
    real = server_replay(chosen, budget)
    print(f"\nReal llama.cpp server, {name}…, budget {budget} (cl100k), cache_prompt on:\n")
    print("| strategy | simulated prefill (cl100k) | ÷ sliding | llama.cpp prompt_n (its tokenizer) | ÷ sliding |")
    print("|---|---:|---:|---:|---:|")
    for s in STRATEGIES:
        print(
            f"| {s} | {simulated[s]:,} | {simulated[s] / simulated['sliding window']:.2f} | {real[s]:,} | "
            f"{real[s] / real['sliding window']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
