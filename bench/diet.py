"""The verbatim diet on real text: tool results of the real transcripts and a verbose pytest run.

    python bench/diet.py [--tests test/py/test_diet.py]   # default: the whole suite's log (about 30 minutes)

For each source: lines and cl100k tokens before and after the dedupe stages (exact lines and blocks,
then 0x-address near-duplicates), the reduction, and the time taken. Then the pytest log is packed
to a few budgets, and check_text confirms that every test's verdict survived (marker mode). No
assertion: the numbers are measured in this run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workloads import generated, load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def pytest_log(tests: str) -> str:
    """A real CI-style log: this project's suite (``tests``: all of ``test/py``, or one module) in verbose mode,
    with llama.cpp's own server log."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return run.stdout + run.stderr


def row(name: str, texts: list[str], tok: cs.Tokenizer) -> str:
    lines = sum(t.count("\n") + 1 for t in texts)
    before = sum(tok.count(t) for t in texts)
    started = time.perf_counter()
    results = [cs.shrink_text(t, tok) for t in texts]
    took = time.perf_counter() - started
    after = sum(r["output"]["tokens"] for r in results)
    kept = sum(r["output"]["lines"] for r in results)
    return (
        f"| {name} | {len(texts)} | {lines:,} | {kept:,} | {before:,} | {after:,} | {1 - after / before:.1%} | "
        f"{took * 1000:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default="test/py", help="the pytest run whose log is packed (default test/py, "
                        "the whole suite: about 30 minutes; test/py/test_diet.py for a quick one)")  # fmt: skip
    args = parser.parse_args()
    tok = cs.resolve_tokenizer("tiktoken:cl100k_base")
    print("## Dedupe (exact lines and blocks, then 0x near-duplicates)\n")
    print("| source | texts | lines | lines kept | tokens | tokens after | reduction | ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    everything: list[str] = []
    for path in transcript_paths():
        messages = load(path)
        texts = [m["content"] for m in messages if m["role"] == "tool" and isinstance(m["content"], str)]
        texts = [t for t in texts if len(t) >= 2000]  # what diet_tool_results touches
        if texts:
            everything += texts
            print(row(f"tool results: {path.stem[:40]}", texts, tok))
    print(row("tool results: all transcripts", everything, tok))
    texts = [m["content"] for m in generated(2000) if m["role"] == "tool" and len(m["content"]) >= 2000]
    print(row("tool results: synthetic 2,000-message session (build/test logs)", texts, tok))
    log = pytest_log(args.tests)
    print(row(f"pytest -v -s {args.tests} (this project's; llama.cpp's log included)", [log], tok))

    verdicts = re.findall(r"^(test/py/\S+::\S+) (PASSED|FAILED|SKIPPED)", log, re.MULTILINE)
    plan = [name.split("::", 1)[1] for name, _ in verdicts]
    print(f"\n## Packing the pytest log ({tok.count(log):,} tokens, {len(plan)} test verdicts)\n")
    print("| budget | tokens out | lines out | verdicts that survived (check_text, marker mode) | ms |")
    print("|---:|---:|---:|---:|---:|")
    for budget in (2000, 8000, 32000):
        started = time.perf_counter()
        packed = cs.shrink_text(log, tok, budget=budget, query="PASSED FAILED")
        took = time.perf_counter() - started
        checked = cs.check_text(packed["text"], plan, markers=["PASSED", "SKIPPED"], fail_markers=["FAILED"])
        survived = sum(1 for i in checked["items"] if i["status"] in ("passed", "failed"))
        print(
            f"| {budget:,} | {packed['output']['tokens']:,} | {packed['output']['lines']:,} | "
            f"{survived} of {len(plan)} | {took * 1000:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
