"""Side by side: context-shrink against the trimmers people use today, on real and synthetic sessions.

    pip install -e '.[dev,bench]'        # langchain-core and litellm are optional; absent ones are skipped
    python bench/run.py [--runs 3] [--quick] [--only NAME ...] [--slow-max MESSAGES]
    python bench/run.py --tools-list     # the tools/list size alone

Workloads: every transcript (bench/workloads.py: test/data and bench/data/sessions) and synthetic sessions of
200, 2,000 and 10,000 messages from bench/gen_session.py, ending mid agent loop and on a user turn;
budgets 16k and 32k. Tools: context-shrink's trim (Python API, and the MCP stdio tool reading
messages_path), LangChain's trim_messages (a tiktoken counter and count_tokens_approximately, with and
without start_on="human"), LiteLLM's trim_messages, and a hand-written loop that drops the oldest
message until it fits. Every result is re-counted with one reference counter (cl100k, OpenAI
overheads) and checked for API validity. Also: the tools/list size and the stdio overhead of big
histories. Times are medians of this run on this machine; read them as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list on import otherwise

import anyio  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402
from plots import bars, progress  # noqa: E402
from workloads import generated, load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402

REFERENCE = cs.resolve_tokenizer("tiktoken:cl100k_base")
RAW_COUNT = REFERENCE.count.__self__._function  # the same encoder without context-shrink's cache, for the others
Messages = list[dict[str, Any]]
SLOW = ("hand-written loop", "LiteLLM trim_messages")  # quadratic: skipped above --slow-max messages


# --------------------------------------------------------------------------- workloads


def workloads(quick: bool) -> dict[str, Messages]:
    out: dict[str, Messages] = {}
    for path in transcript_paths():
        out[path.stem[:38]] = load(path)
    for n in (200, 2000) if quick else (200, 2000, 10000):
        for end in ("tool", "user"):
            out[f"synthetic {n:,} (ends on {end})"] = generated(n, end=end)
    return out


# --------------------------------------------------------------------------- the trimmers


def ours(messages: Messages, budget: int) -> Messages:
    cold = cs.Tokenizer(REFERENCE.name, cs.cached_count(RAW_COUNT))  # a fresh cache: no help from earlier runs
    return cs.trim_messages(messages, cold, budget)["messages"]


def hand_written(messages: Messages, budget: int) -> Messages:
    """The loop people write: drop the oldest non-system message, re-count everything, repeat."""
    out = list(messages)
    plain = cs.Tokenizer("tiktoken", RAW_COUNT)
    while cs.count_messages(out, plain)[1] > budget and len(out) > 1:
        first = next((i for i, m in enumerate(out) if m["role"] not in cs.SYSTEM_ROLES), None)
        if first is None:
            break
        del out[first]
    return out


def langchain_tools() -> dict[str, Callable[[Messages, int], Messages]]:
    try:
        from langchain_core.messages import BaseMessage, convert_to_messages, convert_to_openai_messages, trim_messages
        from langchain_core.messages.utils import count_tokens_approximately
    except ImportError:
        return {}

    def tiktoken_counter(messages: list[BaseMessage]) -> int:
        total = 3
        for m in messages:
            text = m.content if isinstance(m.content, str) else json.dumps(m.content)
            total += 3 + RAW_COUNT(m.type) + RAW_COUNT(text)
            for call in getattr(m, "tool_calls", None) or []:
                total += 3 + RAW_COUNT(call["name"]) + RAW_COUNT(json.dumps(call["args"]))
        return total

    def make(counter: Any, start_on: str | None) -> Callable[[Messages, int], Messages]:
        def run(messages: Messages, budget: int) -> Messages:
            kept = trim_messages(
                convert_to_messages(messages),
                max_tokens=budget,
                token_counter=counter,
                strategy="last",
                include_system=True,
                start_on=start_on,
            )
            return convert_to_openai_messages(kept)

        return run

    return {
        "LangChain, tiktoken counter": make(tiktoken_counter, None),
        "LangChain, tiktoken, start_on=human": make(tiktoken_counter, "human"),
        "LangChain, approximate counter": make(count_tokens_approximately, None),
        "LangChain, approximate, start_on=human": make(count_tokens_approximately, "human"),
    }


def litellm_tools() -> dict[str, Callable[[Messages, int], Messages]]:
    try:
        from litellm.utils import trim_messages as litellm_trim
    except ImportError:
        return {}

    def run(messages: Messages, budget: int) -> Messages:
        return litellm_trim([dict(m) for m in messages], model="gpt-4", trim_ratio=1.0, max_tokens=budget)

    return {"LiteLLM trim_messages": run}


class StdioTrimmer:
    """context-shrink's trim_context over real MCP stdio, reading messages_path and writing output_path."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(folder), "CONTEXT_SHRINK_TOKENIZER": "tiktoken:cl100k_base"}
        self.params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "context_shrink.py")], env=env)

    def run_many(
        self, jobs: list[tuple[str, Messages, int]], runs: int
    ) -> dict[tuple[str, int], tuple[float, Messages]]:
        results: dict[tuple[str, int], tuple[float, Messages]] = {}

        async def go() -> None:
            async with Client(self.params, read_timeout_seconds=600) as client:
                for name, messages, budget in jobs:
                    source = self.folder / "in.json"
                    source.write_text(json.dumps(messages))
                    times = []
                    for _ in range(runs):
                        started = time.perf_counter()
                        reply = await client.call_tool(
                            "trim_context",
                            {"messages_path": "in.json", "output_path": "out.json", "max_context_tokens": budget},
                        )
                        times.append(time.perf_counter() - started)
                        if reply.is_error:
                            raise RuntimeError(reply.content[0].text)
                    results[name, budget] = (
                        statistics.median(times),
                        json.loads((self.folder / "out.json").read_text()),
                    )

        anyio.run(go)
        return results


# --------------------------------------------------------------------------- checks


def checks(original: Messages, out: Messages, budget: int) -> dict[str, Any]:
    out = [m for m in out if isinstance(m, dict)]
    valid = bool(out) and not cs.api_problems(out)
    lead = list(original[: cs.leading_system(original)])
    system_kept = all(any(o.get("content") == m.get("content") and o["role"] == m["role"] for o in out) for m in lead)
    first = next((m for m in out if m.get("role") not in cs.SYSTEM_ROLES), None)
    users = [m for m in original if m["role"] == "user"]
    newest_user = not users or any(o.get("role") == "user" and o.get("content") == users[-1]["content"] for o in out)
    try:
        tokens = cs.count_messages(cs.validate_messages(out), REFERENCE)[1] if out else 0
    except cs.ContextShrinkError:
        tokens, valid = 0, False
    return {
        "valid": valid,
        "system": system_kept,
        "user_first": first is not None and first.get("role") == "user",
        "newest_user": newest_user,
        "fits": 0 < tokens <= budget,
        "use": tokens / budget,
    }


def timed(
    fn: Callable[[Messages, int], Messages], messages: Messages, budget: int, runs: int
) -> tuple[float, Messages]:
    times, out = [], []
    for k in range(runs):
        started = time.perf_counter()
        out = fn(messages, budget)
        times.append(time.perf_counter() - started)
        if times[-1] > 20 and k == 0:  # one run is enough to know it is slow
            break
    return statistics.median(times), out


# --------------------------------------------------------------------------- extras


def tools_list_size() -> list[tuple[str, int]]:
    """The ``tools/list`` reply as sent, and the part a client forwards to its model (name, description, input
    schema), for all the tools and for the core set."""
    rows = []
    for label, tools in ((f"all {len(cs.TOOL_NAMES)} tools", None), ("CONTEXT_SHRINK_TOOLS=core", cs.CORE_TOOLS)):
        server = cs.build_server(cs.Config(tools=tools))

        async def listing(server: Any = server) -> Any:
            async with Client(server) as client:
                return (await client.list_tools()).tools

        dumped = [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in anyio.run(listing)]
        rows.append((label, REFERENCE.count(json.dumps({"tools": dumped}, separators=(",", ":")))))
        model = [{k: t[k] for k in ("name", "description", "inputSchema")} for t in dumped]
        rows.append((f"{label}: what the model is sent", REFERENCE.count(json.dumps(model, separators=(",", ":")))))
    return rows


def tools_list_table() -> str:
    """:func:`tools_list_size` as a Markdown table under its heading."""
    rows = "\n".join(f"| {label} | {tokens:,} |" for label, tokens in tools_list_size())
    return f"## tools/list size (cl100k tokens, compact JSON as sent)\n\n| server | tokens |\n|---|---:|\n{rows}"


def stdio_overhead(sessions: dict[str, Messages], runs: int) -> list[str]:
    """estimate_context over stdio (history inline, and read from messages_path) against the same estimate
    in-process. Every measurement starts cold: a fresh cache in-process, a fresh server per row."""
    big = next((m for name, m in sessions.items() if name.startswith("synthetic 10,000")), None)
    big = big or max(sessions.values(), key=lambda m: len(json.dumps(m)))
    rows = []
    for megabytes in (1, 10):
        history, size = [], 0
        for m in big:
            history.append(m)
            size += len(json.dumps(m))
            if size >= megabytes * 1_000_000:
                break
        inproc = []
        for _ in range(runs):
            cold = cs.Tokenizer(REFERENCE.name, cs.cached_count(RAW_COUNT))
            started = time.perf_counter()
            cs.estimate_messages(history, cold, cs.MAX_CONTEXT_TOKENS_LIMIT)
            inproc.append(time.perf_counter() - started)
        inline: list[float] = []
        by_path: list[float] = []
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "h.json").write_text(json.dumps(history))
            env = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "tiktoken:cl100k_base", "CONTEXT_SHRINK_ROOT": folder}
            params = StdioServerParameters(command=sys.executable, args=[str(ROOT / "context_shrink.py")], env=env)
            for arguments, sink in (({"messages": history}, inline), ({"messages_path": "h.json"}, by_path)):
                for _ in range(runs):

                    async def go(
                        arguments: dict[str, Any] = arguments, sink: list[float] = sink, params: Any = params
                    ) -> None:
                        async with Client(params, read_timeout_seconds=600) as client:
                            started = time.perf_counter()
                            await client.call_tool("estimate_context", {**arguments, "max_context_tokens": 1_000_000})
                            sink.append(time.perf_counter() - started)

                    anyio.run(go)
        base = statistics.median(inproc)
        rows.append(
            f"| {size / 1e6:.1f} MB, {len(history):,} messages | {base * 1000:.0f} | "
            f"{statistics.median(inline) * 1000:.0f} ({statistics.median(inline) / base:.2f}x) | "
            f"{statistics.median(by_path) * 1000:.0f} ({statistics.median(by_path) / base:.2f}x) |"
        )
    return rows


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="skip the 10,000-message sessions")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="trimmers whose name contains one of these")
    parser.add_argument(
        "--slow-max", type=int, default=2000, metavar="MESSAGES", help=f"skip {' and '.join(SLOW)} above this"
    )
    parser.add_argument("--tools-list", action="store_true", help="the tools/list size table alone (seconds)")
    args = parser.parse_args()
    if args.tools_list:
        print(tools_list_table())
        return 0
    sessions = workloads(args.quick)
    trimmers: dict[str, Callable[[Messages, int], Messages]] = {
        "context-shrink (Python API)": ours,
        **langchain_tools(),
        **litellm_tools(),
        "hand-written loop": hand_written,
    }
    if args.only:
        trimmers = {k: v for k, v in trimmers.items() if any(n.lower() in k.lower() for n in args.only)}
    budgets = (16384, 32768)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ["context-shrink (MCP stdio)", *trimmers]}
    speed: dict[tuple[str, str, int], float] = {}
    cases = [(w, m, b) for w, m in sessions.items() for b in budgets]
    for wname, messages, budget in progress(cases, len(cases), "workload x budget cases"):
        for tname, fn in trimmers.items():
            if tname in SLOW and len(messages) > args.slow_max:
                continue  # minutes per call on long sessions
            try:
                seconds, out = timed(fn, messages, budget, args.runs)
            except Exception as exc:  # a trimmer that crashes on real input is a result too
                rows[tname].append({"error": f"{type(exc).__name__}: {str(exc)[:80]}", "workload": wname})
                continue
            rows[tname].append(
                {"workload": wname, "budget": budget, "seconds": seconds, **checks(messages, out, budget)}
            )
            speed[tname, wname, budget] = seconds
    stdio = not args.only or any(n.lower() in "context-shrink (mcp stdio)" for n in args.only)
    with tempfile.TemporaryDirectory() as folder:
        jobs = [] if not stdio else [(w, m, b) for w, m in sessions.items() for b in budgets]
        for (wname, budget), (seconds, out) in StdioTrimmer(Path(folder)).run_many(jobs, args.runs).items():
            rows["context-shrink (MCP stdio)"].append(
                {"workload": wname, "budget": budget, "seconds": seconds, **checks(sessions[wname], out, budget)}
            )
            speed["context-shrink (MCP stdio)", wname, budget] = seconds

    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; "
          f"{len(sessions)} workloads x budgets 16k and 32k; median of {args.runs} runs.\n")  # fmt: skip
    print("## Correctness and budget use (all workloads, both budgets)\n")
    print("| trimmer | runs | errors | API-valid | system kept | starts on user | newest user kept | fits "
          "| median budget use when it fits |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    figure: dict[str, list[float]] = {}
    for tname, results in rows.items():
        ok = [r for r in results if "error" not in r]
        if not results:
            continue

        def share(key: str, ok: list[dict[str, Any]] = ok) -> str:
            return f"{sum(r[key] for r in ok)}/{len(ok)}"

        uses = [r["use"] for r in ok if r["fits"]]
        use = f"{statistics.median(uses):.1%}" if uses else "—"
        figure[tname] = [statistics.median(u) if (u := [r["use"] for r in ok if r["fits"] and r["budget"] == b])
                         else 0.0 for b in budgets]  # fmt: skip
        print(
            f"| {tname} | {len(results)} | {len(results) - len(ok)} | {share('valid')} | {share('system')} | "
            f"{share('user_first')} | {share('newest_user')} | {share('fits')} | {use} |"
        )
    bars("budget_use", "median share of the budget a trimmed history fills (when it fits)", "budget use",
         [f"{b // 1024}k budget" for b in budgets], figure, hline=(1.0, "the budget"))  # fmt: skip
    print("\n## Speed at 32k (median ms; ratio to context-shrink's Python API in brackets)\n")
    names = [n for n in rows if rows[n]]
    print("| workload | messages | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for wname, messages in sessions.items():
        base = speed.get(("context-shrink (Python API)", wname, 32768))
        cells = []
        for n in names:
            seconds = speed.get((n, wname, 32768))
            cells.append("—" if seconds is None or not base else f"{seconds * 1000:.0f} ({seconds / base:.1f}x)")
        print(f"| {wname} | {len(messages):,} | " + " | ".join(cells) + " |")
    errors = [(t, r) for t, rs in rows.items() for r in rs if "error" in r]
    if errors:
        print("\nErrors:\n")
        for tname, r in errors[:12]:
            print(f"- {tname} on {r['workload']}: {r['error']}")
    print("\n" + tools_list_table())
    print("\n## MCP stdio overhead (estimate_context, cold; ratio to in-process in brackets)\n")
    print("| history | in-process ms | stdio, messages inline | stdio, messages_path |\n|---|---:|---:|---:|")
    print("\n".join(stdio_overhead(sessions, args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
