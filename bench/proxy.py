"""The proxy: added latency, time to shrink a 100k-token history, summariser calls and prefill over a replay.

    python bench/proxy.py [--requests 200] [--transcript openhands_llama-4-maverick_ponyc-458] [--only-latency]
    python bench/proxy.py --only-repeat --requests 30 [--guardian /path/to/context-guardian]

Everything runs against the test suite's real llama.cpp server (xllamacpp, tiny generated model, n_ctx
32768, one slot; its byte-level tokenizer needs about 3.4 tokens per cl100k token, so that is a window of
about 9.7k cl100k tokens) with `context-shrink proxy` started as a subprocess in front of it; summaries come from
the suite's scriptable fake server (instant, deterministic) so the numbers are about the proxy, not a model.

1. Added latency when nothing needs shrinking: the same small request sent directly, through a bare
   forwarder (starlette + httpx2 on the proxy's uvicorn settings: the floor of any Python proxy) and through
   the proxy, alternating, p50/p95, in the same run: on a new connection each (the whole reply), and
   streamed on a kept-alive connection (as agents send them).
2. Time to shrink and forward a history of about 100k cl100k tokens: the proxy's own time (the `ms` of
   its x-context-shrink header) and the client's wall time, cold (summaries written), warm (the same
   span: the summary is reused) and with the summariser down (trimmed).
3. A transcript replayed turn by turn (a request before every assistant message, history growing):
   summariser calls per turn, the processed prompt tokens llama.cpp reports (`timings.prompt_n`,
   cache_prompt on), proxy vs a sliding window sized to the same share of the window, and the share of
   the window llama.cpp counted (`usage.prompt_tokens`) on the requests the proxy shrank.
4. One agent-shaped session per wire API (OpenCode on chat completions, Codex CLI on Responses, Claude
   Code on Anthropic Messages), grown turn by turn against a second llama.cpp server (n_ctx 8192),
   directly and through the proxy: refusals either way, requests shrunk, window use, the proxy's time.
5. A must-shrink request of about 100k and 200k tokens repeated (the turn after one already shrunk), against
   the suite's instant fake upstream: the client's wall time straight to it, through context-shrink and
   through context-guardian (when its command is found: `pip install context-guardian` in a venv of its own,
   then --guardian PATH), alternating in the same run; a bar figure, docs/img/proxy_repeat.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py"), str(ROOT / "bench")]

import httpx2  # noqa: E402
from fake_openai import FakeOpenAI, serve  # noqa: E402
from plots import bars  # noqa: E402
from proxy_helpers import proxy  # noqa: E402
from replay import sliding  # noqa: E402
from tiny_llama import free_port, llama_server, write_tiny_gguf  # noqa: E402
from workloads import generated, load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402
import context_shrink_fit as csf  # noqa: E402
import context_shrink_proxy as csp  # noqa: E402

TOK = cs.resolve_tokenizer("tiktoken:cl100k_base")
N_CTX = 32768
Messages = list[dict[str, Any]]


def post(url: str, body: dict[str, Any]) -> tuple[httpx2.Response, float]:
    started = time.perf_counter()
    reply = httpx2.post(url + "/chat/completions", json=body, timeout=600)
    return reply, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def streamed(client: httpx2.Client, url: str, body: dict[str, Any]) -> float:
    """One streamed request on a kept-alive connection, as agents send them; seconds to the stream's end."""
    started = time.perf_counter()
    with client.stream("POST", url + "/chat/completions", json={**body, "stream": True}) as reply:
        for _ in reply.iter_bytes():
            pass
    return time.perf_counter() - started


@contextlib.contextmanager
def bare_forwarder(upstream: str) -> Iterator[str]:
    """The floor of any Python proxy on this stack, measured in the same run: starlette and httpx2 on the
    proxy's own uvicorn settings (``csp.serve_http``), relaying the body both ways and nothing else. It runs in a
    thread until the script ends; yields its base URL."""
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx2.AsyncClient(timeout=600)

    async def relay(request: Any) -> Any:
        sent = client.build_request("POST", upstream + "/chat/completions", content=await request.body(),
                                    headers={"content-type": "application/json"})  # fmt: skip
        reply = await client.send(sent, stream=True)
        kind = {"content-type": reply.headers.get("content-type", "application/json")}
        return StreamingResponse(reply.aiter_raw(), reply.status_code, headers=kind,
                                 background=BackgroundTask(reply.aclose))  # fmt: skip

    app = Starlette(routes=[Route("/v1/chat/completions", relay, methods=["POST"])])
    port = free_port()
    threading.Thread(target=csp.serve_http, args=(app, "127.0.0.1", port, (10.0, 5.0), "floor on {}"),
                     daemon=True).start()  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"


def latency(direct: str, front: str, requests: int) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there " * 40}], "max_tokens": 1}
    with bare_forwarder(direct) as floor:
        paths = {"direct": direct, "bare forwarder": floor, "proxy": front}
        for _ in range(5):  # warm every path
            for url in paths.values():
                post(url, body)
        names = ("new connection, whole reply", "kept-alive connection, streamed")
        rows: dict[str, dict[str, list[float]]] = {name: {who: [] for who in paths} for name in names}
        with contextlib.ExitStack() as stack:
            kept = {who: stack.enter_context(httpx2.Client(timeout=600)) for who in paths}
            for _ in range(requests):
                for who, url in paths.items():
                    rows["new connection, whole reply"][who].append(post(url, body)[1])
                    rows["kept-alive connection, streamed"][who].append(streamed(kept[who], url, body))
    print(f"\n1. Added latency, nothing to shrink ({requests} requests each, alternating; the bare forwarder is"
          " starlette + httpx2 on the same uvicorn settings, relaying and nothing else):\n")  # fmt: skip
    print("| request | direct p50 / p95 ms | bare forwarder p50 / p95 ms | proxy p50 / p95 ms | added p50 (p95) "
          "| added over the bare forwarder p50 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, times in rows.items():
        p50 = {who: 1000 * percentile(t, 0.5) for who, t in times.items()}
        p95 = {who: 1000 * percentile(t, 0.95) for who, t in times.items()}
        cells = " | ".join(f"{p50[who]:.1f} / {p95[who]:.1f}" for who in paths)
        added = f"{p50['proxy'] - p50['direct']:.1f} ({p95['proxy'] - p95['direct']:.1f})"
        print(f"| {name} | {cells} | {added} | {p50['proxy'] - p50['bare forwarder']:.1f} |")
    figure = {f"{who}, {q}": [1000 * percentile(times[who], share) for times in rows.values()]
              for who in paths for q, share in (("p50", 0.5), ("p95", 0.95))}  # fmt: skip
    bars("proxy_latency", f"a small request straight to llama.cpp, through a bare forwarder and through the proxy "
         f"({requests} each)", "milliseconds", list(rows), figure)  # fmt: skip


def big_history(target: int) -> Messages:
    """About ``target`` cl100k tokens: a generated coding session, or the transcripts one after another."""
    for n in (400, 800, 1600, 3200):
        messages = generated(n, end="user")
        if cs.count_messages(messages, TOK)[1] >= target:  # the tiny model has no vision: images become text
            return [cs.without_images(m)[0] for m in messages]
    messages = [{"role": "system", "content": "You are a coding agent."}]
    while cs.count_messages(messages, TOK)[1] < target:
        for path in transcript_paths():
            messages += [m for m in load(path) if m["role"] not in cs.SYSTEM_ROLES]
    return messages


def sized_history(target: int) -> Messages:
    """The shortest generated coding session (in steps of 25 messages) of at least ``target`` cl100k tokens."""
    for n in range(25, 3201, 25):
        messages = generated(n, end="user")
        if cs.count_messages(messages, TOK)[1] >= target:
            return [cs.without_images(m)[0] for m in messages]
    return big_history(target)


def shrink_big(front: str, front_down: str) -> None:
    messages = big_history(100_000)
    tokens = cs.count_messages(messages, TOK)[1]
    print(f"\n2. Shrink and forward {len(messages)} messages, {tokens:,} cl100k tokens (window {N_CTX}):\n")
    print("| case | status | action | summary cached | proxy ms (header) | client wall ms | tokens after | why |")
    print("|---|---:|---|---|---:|---:|---:|---|")
    body = {"model": "tiny", "messages": messages, "max_tokens": 1}
    cases = [("first", front), ("again (calibrated now)", front), ("again", front), ("summariser down", front_down)]
    for case, url in cases:
        reply, wall = post(url, body)
        header = dict(
            part.split("=", 1) for part in reply.headers.get("x-context-shrink", "").split("; ") if "=" in part
        )
        print(
            f"| {case} | {reply.status_code} | {header.get('action')} | {header.get('summary_cached', '—')} | "
            f"{header.get('ms')} | {1000 * wall:.0f} | "
            f"{header.get('tokens_after')} | {header.get('reason', '')[:80]} |"
        )


def replay(direct: str, front: str, fake: FakeOpenAI, messages: Messages, name: str) -> None:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    first = messages[: turns[0]]
    reply, _ = post(direct, {"messages": first, "max_tokens": 1})
    ratio = reply.json()["usage"]["prompt_tokens"] / cs.count_messages(first, TOK)[1]  # its tokens per cl100k
    budget = int(cs.Policy().trigger * (N_CTX - min(csf.PROXY_MAX_RESERVE, N_CTX // 8)) / ratio)
    totals = {"proxy": 0, "sliding window": 0}
    actions: dict[str, int] = {}
    uses: list[float] = []  # the window share llama.cpp counted, on the requests the proxy shrank
    calls_before = len(fake.requests)
    refused = 0
    for strategy, url in (("sliding window", direct), ("proxy", front)):
        for i in turns:
            history = messages[:i]
            request = sliding(history, budget)[0] if strategy == "sliding window" else history
            reply, _ = post(url, {"model": "tiny", "messages": request, "max_tokens": 1, "cache_prompt": True})
            if reply.status_code != 200:
                refused += strategy == "proxy"
                continue
            totals[strategy] += reply.json()["timings"]["prompt_n"]
            if strategy == "proxy":
                action = reply.headers["x-context-shrink"].split("action=")[1].split(";")[0]
                actions[action] = actions.get(action, 0) + 1
                if action != "none":
                    uses.append(reply.json()["usage"]["prompt_tokens"] / N_CTX)
    calls = len(fake.requests) - calls_before
    print(
        f"\n3. Replay of {name} ({len(turns)} requests), llama.cpp n_ctx {N_CTX}, its tokens ≈ {ratio:.2f} x cl100k:\n"
    )
    print("| strategy | llama.cpp prompt_n | ÷ sliding | summariser calls | calls per turn | refused | window use "
          "when shrunk: mean (min) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| sliding window ({budget:,} cl100k) | {totals['sliding window']:,} | 1.00 | — | — | — | — |")
    use = f"{sum(uses) / len(uses):.2f} ({min(uses):.2f})" if uses else "—"
    print(
        f"| proxy | {totals['proxy']:,} | {totals['proxy'] / totals['sliding window']:.2f} | {calls} | "
        f"{calls / len(turns):.2f} | {refused} | {use} |"
    )
    print("\nProxy actions: " + ", ".join(f"{k} {v}" for k, v in sorted(actions.items())))


API_CTX = 8192  # the agent-shaped replays run against a second server with this window


def agent_shapes() -> dict[str, tuple[str, Callable[[int], dict[str, Any]]]]:
    """One growing session per wire API, shaped like the agent that speaks it (test/py/test_proxy.py):
    OpenCode (chat: system prompt and tools ~75 % of the window in the tiny model's tokens, files attached
    to user turns), Codex CLI (Responses: function_call / function_call_output pairs) and Claude Code
    (Anthropic Messages: tool_use / tool_result blocks)."""
    from test_proxy import claude_request, codex_request, opencode_request

    return {
        "chat (OpenCode)": ("/chat/completions", lambda t: {**opencode_request(t, 20, system_size=300, tool_size=20),
                                                            "model": "tiny", "max_tokens": 8}),
        "responses (Codex CLI)": ("/responses", lambda t: {**codex_request(t, 60, reasoning=False), "model": "tiny",
                                                          "max_output_tokens": 8}),
        "messages (Claude Code)": ("/messages", lambda t: {**claude_request(t, 60, thinking=False), "model": "tiny",
                                                           "max_tokens": 8}),
    }  # fmt: skip


def agent_replays(direct: str, front: str) -> None:
    """Each agent's session grown turn by turn, sent directly and through the proxy: refusals either way,
    the requests the proxy shrank, the share of the window the server counted on those, the proxy's time."""
    print(f"\n4. Agent-shaped sessions per wire API, llama.cpp n_ctx {API_CTX} (20 requests each, growing):\n")
    print("| API (agent) | requests | refused direct | refused via proxy | shrunk | window use when shrunk: mean (min) "
          "| proxy ms p50 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (path, make) in agent_shapes().items():
        refused = {"direct": 0, "proxy": 0}
        uses, times = [], []
        for turns in range(2, 41, 2):
            body = make(turns)
            refused["direct"] += httpx2.post(direct + path, json=body, timeout=600).status_code != 200
            reply = httpx2.post(front + path, json=body, timeout=600)
            refused["proxy"] += reply.status_code != 200
            header = dict(p.split("=", 1) for p in reply.headers.get("x-context-shrink", "").split("; ") if "=" in p)
            if reply.status_code == 200 and header.get("action") not in (None, "none"):
                usage = reply.json().get("usage") or {}
                uses.append(usage.get("prompt_tokens", usage.get("input_tokens", 0)) / API_CTX)
                times.append(float(header.get("ms", 0)))
        use = f"{sum(uses) / len(uses):.2f} ({min(uses):.2f})" if uses else "—"
        p50 = f"{percentile(times, 0.5):.0f}" if times else "—"
        print(f"| {name} | 20 | {refused['direct']} | {refused['proxy']} | {len(uses)} | {use} | {p50} |")


@contextlib.contextmanager
def guardian(upstream: str, window: int, folder: Path, command: str) -> Iterator[str]:
    """context-guardian (installed apart, e.g. ``pip install context-guardian`` in its own venv) in front of
    ``upstream`` with ``window`` tokens; yields its base URL. Its data and log go to ``folder``."""
    port = free_port()
    env = {**os.environ, "GUARDIAN_UPSTREAM_URL": upstream, "GUARDIAN_NUM_CTX": str(window),
           "GUARDIAN_PORT": str(port), "GUARDIAN_HOST": "127.0.0.1", "GUARDIAN_DATA_DIR": str(folder),
           "GUARDIAN_VERBOSE": "0"}  # fmt: skip
    with (folder / "guardian.log").open("ab") as err:
        process = subprocess.Popen([command], stdout=err, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"http://127.0.0.1:{port}/guardian/stats", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=10)


REPEAT_WINDOW = 32768  # both proxies told this window (the fake upstream itself takes anything)


def repeated(folder: Path, requests: int, command: str | None) -> None:
    """A must-shrink request sent again and again (the turn after one the proxy already shrank): the client's
    wall time p50 and p95 straight to the upstream (which takes it: its window is large), through
    context-shrink and, when installed, through context-guardian, alternating, in the same run."""
    fake = FakeOpenAI(window=100_000_000)
    names = ["direct (no shrink)", "context-shrink"] + (["context-guardian 0.12"] if command else [])
    print(f"\n5. A repeated must-shrink request (window {REPEAT_WINDOW:,} told to each proxy; the summariser is the"
          f" instant fake upstream; {requests} requests each, alternating, after 3 to warm):\n")  # fmt: skip
    print("| history | " + " | ".join(f"{n} p50 / p95 ms (tokens sent)" for n in names)
          + " | context-shrink ms (header) |")  # fmt: skip
    print("|---|" + "---:|" * (len(names) + 1))
    figure: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(serve(fake))
        fronts = [up, stack.enter_context(proxy(up, "--window", str(REPEAT_WINDOW), "--no-archive",
                                                log=folder / "repeat.log"))]  # fmt: skip
        if command:
            fronts.append(stack.enter_context(guardian(up, REPEAT_WINDOW, folder, command)))
        for target in (100_000, 200_000):
            messages = sized_history(target)
            body = {"model": "m", "messages": messages, "max_tokens": 1000}
            times: dict[str, list[float]] = {n: [] for n in names}
            header: list[float] = []
            sent: dict[str, int] = {}
            with contextlib.ExitStack() as clients:
                kept = [clients.enter_context(httpx2.Client(timeout=600)) for _ in fronts]
                for _ in range(3):  # warm: the first request of each is summarised and counted
                    for client, url in zip(kept, fronts, strict=True):
                        client.post(url + "/chat/completions", json=body)
                for _ in range(requests):
                    for name, client, url in zip(names, kept, fronts, strict=True):
                        started = time.perf_counter()
                        reply = client.post(url + "/chat/completions", json=body)
                        times[name].append(1000 * (time.perf_counter() - started))
                        sent[name] = fake.requests[-1]["tokens"] - 1000  # what reached the upstream, max_tokens out
                        if name == "context-shrink":
                            got = reply.headers.get("x-context-shrink", "")
                            header.append(float(next(p[3:] for p in got.split("; ") if p.startswith("ms=")) or 0))
            tokens = cs.count_messages(messages, TOK)[1]
            cells = [f"{percentile(t, 0.5):.1f} / {percentile(t, 0.95):.1f} ({sent[n]:,})" for n, t in times.items()]
            print(f"| {len(messages)} messages, {tokens:,} tokens | " + " | ".join(cells)
                  + f" | {percentile(header, 0.5):.0f} |")  # fmt: skip
            figure[f"{tokens // 1000}k tokens"] = [percentile(t, 0.5) for t in times.values()]
    bars("proxy_repeat", f"a repeated must-shrink request, p50 of {requests} (window {REPEAT_WINDOW:,})",
         "milliseconds", list(figure), {n: [figure[k][i] for k in figure] for i, n in enumerate(names)})  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--transcript", default="openhands_llama-4-maverick_ponyc-458")
    parser.add_argument("--only-latency", action="store_true", help="section 1 only")
    parser.add_argument("--only-repeat", action="store_true", help="section 5 only")
    parser.add_argument("--guardian", default=shutil.which("context-guardian"),
                        help="context-guardian's command, for section 5 (default: on PATH, else left out)")  # fmt: skip
    args = parser.parse_args()
    if args.only_repeat:
        with tempfile.TemporaryDirectory() as folder:
            repeated(Path(folder), args.requests, args.guardian)
        return 0
    chosen = next((p for p in transcript_paths() if p.stem.startswith(args.transcript)), transcript_paths()[0])
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "proxy.log"
        model = write_tiny_gguf(Path(folder) / "tiny.gguf", n_ctx_train=32768)
        fake = FakeOpenAI(window=1_000_000)
        dead = f"http://127.0.0.1:{free_port()}/v1"
        with (
            llama_server(model, n_ctx=N_CTX, threads=2) as direct,
            serve(fake) as summariser,
            proxy(direct, "--summary-url", summariser, "--no-archive", log=log) as front,
            proxy(direct, "--summary-url", dead, "--no-archive", log=log) as front_down,
            llama_server(model, n_ctx=API_CTX, threads=2) as small,
            proxy(small, "--no-archive", log=log) as front_small,
        ):
            latency(direct, front, args.requests)
            if args.only_latency:
                return 0
            shrink_big(front, front_down)
            replay(direct, front, fake, load(chosen), chosen.stem)
            agent_replays(small, front_small)
        repeated(Path(folder), min(args.requests, 30), args.guardian)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
