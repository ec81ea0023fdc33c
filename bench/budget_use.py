"""Budget use of trim_context on the shared transcripts: how much of the budget the kept history fills.

    python bench/budget_use.py

For every transcript larger than the budget, at 16k and 32k (cl100k counts): whether it fits, the
tokens kept as a share of the budget, which tiers ran, and the same for plain turn dropping
(strategy="drop"). Target: at least 95 % wherever it fits.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def main() -> int:
    tok = cs.resolve_tokenizer("tiktoken:cl100k_base")
    print("| transcript | tokens | budget | fits | budget use | tiers | drop only: fits | drop only: use |")
    print("|---|---:|---:|---|---:|---|---|---:|")
    for path in transcript_paths():
        messages = load(path)
        total = cs.count_messages(messages, tok)[1]
        for budget in (16384, 32768):
            if total <= budget:
                continue
            auto = cs.trim_messages(messages, tok, budget)
            drop = cs.trim_messages(messages, tok, budget, strategy="drop")
            tiers = ", ".join(f"{t['tier']} ({t['messages']})" for t in auto["tiers"]) or "—"
            print(
                f"| {path.stem[:44]} | {total:,} | {budget // 1024}k | {auto['fits']} | {auto['budget_use']:.1%} | "
                f"{tiers} | {drop['fits']} | {drop['budget_use']:.1%} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
