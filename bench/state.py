"""The state store (--state): summary calls across a restart and between two replicas, what a request costs
on each store, and recall over a large archive.

    python bench/state.py [--turns 30] [--archive 100000] [--queries 200] [--no-redis]

1. One conversation of ``--turns`` turns of about 600 cl100k tokens through `context-shrink proxy` in front of
   the suite's scriptable upstream (window 4,096): one proxy throughout, one restarted after two thirds of the
   turns, and two replicas taking the turns in turn; on ``memory`` (the baseline: what one process keeps), a
   SQLite file and a real redis-server. Summary calls the upstream received, and the turns whose forwarded
   bytes equal those of the proxy that ran throughout on memory. A bar figure, docs/img/state_calls.png.
2. The proxy's own time per request (the ``ms`` of its header) on each store, p50 and p95 over the turns.
3. ``recall_context``'s search over an archive of ``--archive`` messages: a word, a phrase, a prefix and an id,
   p50/p95 over ``--queries`` queries, on SQLite's FTS5 index and on Redis (a replica's FTS5 index of what the
   server keeps, read once: its first search is timed apart), and the floor it replaces measured in the same
   run: the earlier version's linear scan of a JSONL archive (five queries of each kind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py"), str(ROOT / "bench")]

from plots import bars, progress  # noqa: E402
from redis_helper import started_redis  # noqa: E402
from state_runs import run  # noqa: E402

import context_shrink as cs  # noqa: E402
import context_shrink_state as cst  # noqa: E402

MODES = ("one", "restart", "replicas")


def ms(headers: dict[str, str]) -> float:
    fields = dict(p.split("=", 1) for p in headers["x-context-shrink"].split("; ") if "=" in p)
    return float(fields.get("ms", "nan"))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def turns_table(folder: Path, turns: int, redis: str | None) -> None:
    stores = {"memory": lambda m: "memory", "sqlite": lambda m: f"sqlite:{folder / f'{m}.sqlite3'}"}
    if redis is not None:
        stores["redis"] = lambda m: f"{redis.rsplit('/', 1)[0]}/{MODES.index(m) + 1}"
    restart_at = 2 * turns // 3
    baseline = run("one", "memory", folder / "log", turns, restart_at)
    rows, calls, times = [], {name: [] for name in stores}, {}
    for name, spec in progress(list(stores.items()), len(stores), "stores"):
        for mode in MODES:
            done = run(mode, spec(mode), folder / "log", turns, restart_at)
            same = sum(a == b for a, b in zip(done.bodies, baseline.bodies, strict=True))
            rows.append(f"| {name} | {mode} | {done.summary_calls} | {same} of {turns} |")
            calls[name].append(done.summary_calls)
            times[name, mode] = [ms(h) for h in done.headers]
    print(f"\n### Summary calls over {turns} turns (restart before turn {restart_at + 1}; replicas alternate)\n")
    print("| store | proxies | summary calls | turns forwarded byte-identical to one proxy on memory |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print("\n### The proxy's own time per request (its header's ms), p50 / p95 over the turns\n")
    print("| store | one | restart | replicas |")
    print("|---|---|---|---|")
    for name in stores:
        cells = [f"{statistics.median(times[name, m]):.1f} / {pct(times[name, m], 0.95):.1f}" for m in MODES]
        print(f"| {name} | " + " | ".join(cells) + " |")
    bars("state_calls", f"Summary calls over {turns} turns", "summary calls", list(MODES), calls)


def archive_history(n: int, rng: random.Random) -> list[dict]:
    words = [f"w{k}" for k in range(5000)]
    files = [f"src/mod_{k}.py" for k in range(2000)]
    return [{"role": "tool" if k % 3 else "user", "tool_call_id": f"c{k}", "content": f"{rng.choice(files)}: "
             + " ".join(rng.choice(words) for _ in range(40))} for k in range(n)]  # fmt: skip


def old_scan(directory: Path, query: str, limit: int) -> list[dict]:
    """The earlier version's recall: every JSONL file read and each message's JSON scanned for the words."""
    entries = cst.read_archive(directory)
    words = query.lower().split()
    found = []
    for entry in reversed(entries):
        if all(w in json.dumps(entry["message"]).lower() for w in words):
            found.append(entry)
            if len(found) >= limit:
                break
    return found


def timed(search: Callable[[str], object], queries: list[str]) -> tuple[float, float]:
    spent = []
    for q in queries:
        started = time.perf_counter()
        search(q)
        spent.append((time.perf_counter() - started) * 1000)
    return statistics.median(spent), pct(spent, 0.95)


def recall_table(folder: Path, size: int, count: int, redis: str | None) -> None:
    rng = random.Random(5)
    history = archive_history(size, rng)
    entries = cst.archive_entries([*history, {"role": "user", "content": "now"}], [{"role": "user", "content": "now"}],
                                 "trim")  # fmt: skip
    stores: dict[str, cs.Store] = {"sqlite FTS5": cst.SqliteStore(folder / "archive.sqlite3")}
    if redis is not None:
        stores["redis"] = cst.RedisStore(redis, "bench")
    cold = {}
    for name, store in stores.items():
        started = time.perf_counter()
        for k in range(0, len(entries), 1000):
            store.archive(entries[k : k + 1000], 1 << 40, 365)
        print(f"{store.name}: {len(entries):,} archived in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        started = time.perf_counter()
        store.search("w1", None, 10)  # Redis: the replica's index reads what the server keeps, once
        cold[name] = time.perf_counter() - started
    jsonl = folder / "jsonl"
    jsonl.mkdir()
    with (jsonl / ("a" * 16 + ".jsonl")).open("w") as out:
        for e in entries:
            out.write(json.dumps({k: e[k] for k in ("id", "hash", "index", "action", "time", "message")}) + "\n")
    kinds = {
        "a word": [f"w{rng.randrange(5000)}" for _ in range(count)],
        "a phrase": [f'"w{rng.randrange(5000)} w{rng.randrange(5000)}"' for _ in range(count)],
        "a prefix": [f"w{rng.randrange(100, 500)}*" for _ in range(count)],
        "an id": [rng.choice(entries)["id"] for _ in range(count)],
    }
    print(f"\n### recall_context over {len(entries):,} archived messages, ms p50 / p95 ({count} queries each)\n")
    print("| query | " + " | ".join(stores) + " | earlier JSONL scan (floor) | FTS5 ÷ scan |")
    print("|---|" + "---|" * (len(stores) + 2))
    for kind, queries in kinds.items():
        cells, first = [], None
        for store in stores.values():
            p50, p95 = timed(lambda q, s=store: s.search(q, None, 10), queries)
            first = first or p50
            cells.append(f"{p50:.2f} / {p95:.2f}")
        scan = [q for q in queries[:5] if '"' not in q and "*" not in q] or queries[:5]
        floor = timed(lambda q: old_scan(jsonl, q.strip('"*'), 10), scan)[0]
        print(f"| {kind} | " + " | ".join(cells) + f" | {floor:.0f} | 1/{floor / first:.0f} |")
    print(
        "\nThe first search of each store (cold; on Redis the replica's index reads every archived message "
        "once): " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in cold.items())
    )
    for store in stores.values():
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--archive", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--no-redis", action="store_true", help="skip the redis-server columns")
    parser.add_argument("--only-recall", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with started_redis(folder) if not args.no_redis else contextlib.nullcontext() as redis:
            if not args.only_recall:
                turns_table(folder, args.turns, redis)
            recall_table(folder, args.archive, args.queries, redis)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
