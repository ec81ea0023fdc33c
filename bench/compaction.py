"""Compaction benchmark: map-reduce against a local OpenAI-compatible server with a fixed latency per call.

    pip install -e '.[dev]'
    python bench/compaction.py [--latency 0.25] [--window 8192] [--concurrency 2 4]

On the largest shared transcript: the number of model calls, the largest request against the
summariser's window, and the wall time against the ideal map-reduce time
``(ceil(chunks / concurrency) + reduce steps) x latency`` (target ≤ 1.2). Measured in this run; no
assertion.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

import anyio  # noqa: E402
from fake_openai import FakeOpenAI, serve  # noqa: E402
from mcp import Client  # noqa: E402
from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--summary-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--fill", type=float, default=0.8, help="summary length as a share of max_summary_tokens")
    args = parser.parse_args()
    path = max(transcript_paths(), key=lambda p: p.stat().st_size)
    messages = load(path)
    print(
        f"{path.stem}: {len(messages)} messages; summariser window {args.window}, latency {args.latency} s, "
        f"summaries of ~{args.fill:.0%} of max_summary_tokens={args.summary_tokens}\n"
    )
    print(
        "| concurrency | chunks | reduce steps | calls | largest request / window | wall s | ideal s | wall ÷ ideal |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        fake = FakeOpenAI(window=args.window, latency=args.latency, fill=args.fill)
        with serve(fake) as url, tempfile.TemporaryDirectory() as root:
            config = cs.Config(
                root=Path(root), tokenizer="tiktoken", model="bench", base_url=url, summary_concurrency=concurrency
            )  # how hard the summariser is loaded is the server's setting (CONTEXT_SHRINK_SUMMARY_CONCURRENCY)
            server = cs.build_server(config)
            arguments = {
                "messages": messages,
                "force": True,
                "keep_last": 4,
                "summary_context_tokens": args.window,
                "max_summary_tokens": args.summary_tokens,
            }

            async def go(server: object = server, arguments: dict = arguments) -> dict:
                async with Client(server) as client:
                    started = time.perf_counter()
                    result = await client.call_tool("compact_context", arguments)
                    return {**result.structured_content, "wall": time.perf_counter() - started}

            result = anyio.run(go)
        ideal = (math.ceil(result["map_chunks"] / concurrency) + result["reduce_steps"]) * args.latency
        largest = max(r["tokens"] for r in fake.requests)
        print(
            f"| {concurrency} | {result['map_chunks']} | {result['reduce_steps']} | {result['model_calls']} | "
            f"{largest:,} / {args.window:,} | {result['wall']:.2f} | {ideal:.2f} | {result['wall'] / ideal:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
