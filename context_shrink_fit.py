"""context_shrink_fit: one chat request fitted to its server — the proxy's request path, without its HTTP.

A companion of :mod:`context_shrink` (it imports the core; the core never imports it at load time). The proxy
(:mod:`context_shrink_proxy`) hands each chat request to :func:`fit_request`: what precedes the conversation's
task (:func:`agent_opening`), what the conversation held that the agent no longer sends (:func:`remembered`,
carried in a ledger: :func:`with_carried`), the window (:func:`server_window`), one count (:func:`measure`, the
upstream's own near the limit, a calibration per model and class of text), the core's ladder
(:func:`context_shrink.shrink`) at that calibration with the summariser bound (:func:`shrink_counted`), and a
recount. What it learns lives in a :class:`ServerMemory` (the proxy's ``ProxyState`` keeps it in its store). The
agent's fixed part is made leaner first when it leaves the turn no room (:func:`lean_request`: the tools'
descriptions cut, the system prompt dieted, then outlined).
"""

from __future__ import annotations

__all__ = [
    "CALIBRATE_MOST",
    "CALIBRATION_LIMITS",
    "EXACT_RECHECK",
    "EXACT_ZONE",
    "LEANED_MOST",
    "LEAN_LEAST",
    "LEAN_MOST",
    "LEAN_SHARE",
    "MESSAGE_BYTES",
    "OFF_LOOP_BYTES",
    "OPENING_MOST",
    "OPENING_RUNS",
    "OUTLINE_NOTE",
    "PROXY_MAX_RESERVE",
    "REWRITE_SECONDS",
    "SAID_MOST",
    "TEXT_CLASS_TEXTS",
    "UNLEANED",
    "ChatRequest",
    "FitReport",
    "Lean",
    "Measured",
    "ServerMemory",
    "SystemEditor",
    "UpstreamSettings",
    "agent_opening",
    "calibrate",
    "calibrated",
    "caller_print",
    "first_sentence",
    "fit_request",
    "fixed_part",
    "fixed_part_problem",
    "fixed_tokens",
    "lean_request",
    "lean_tools",
    "leaner_request",
    "measure",
    "model_of",
    "off_loop",
    "outlined",
    "remembered",
    "request_budget",
    "server_summariser",
    "server_window",
    "shrink_counted",
    "task_key",
    "text_class",
    "upstream_count",
    "with_carried",
]

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import anyio
import httpx2

from context_shrink import (
    DIETED,
    NO_OPENING,
    RECALL_TOOL,
    RESULT_ROLES,
    TEXT_LABELS,
    Backend,
    BackendCaches,
    BackendError,
    ContextShrinkError,
    Opening,
    Policy,
    SpanSummary,
    StoredTable,
    SummaryCache,
    SummaryOptions,
    Tokenizer,
    WindowUnknown,
    backend_summariser,
    canonical_json,
    count_message,
    count_messages,
    count_tools,
    fact_ledger,
    fingerprint,
    leading_system,
    line_print,
    log,
    plain_content,
    pseudo_tool,
    ranked_values,
    ratio_key,
    secret_forms,
    shrink,
    span_hashes,
    summarise_span,
    text_values,
    user_words,
    validate_messages,
    validate_tools,
)

# =============================================================================
# 2. One request fitted to its server: the agent's opening, read, window, count once, calibrate, shrink,
#    recount; what a conversation held, carried when the agent no longer sends it
# =============================================================================

OFF_LOOP_BYTES = 1 << 20  # a request body this large is parsed and counted in a worker thread
ResultT = TypeVar("ResultT")


async def off_loop(size: int, work: Callable[[], ResultT]) -> ResultT:
    """``work()``, in a worker thread when ``size`` (the bytes it works on) is large, so that small requests are
    not held up behind it; a small one is done at once (a thread would cost more than the work: on a small
    request the hops to a worker thread were most of the proxy's added latency)."""
    return await anyio.to_thread.run_sync(work) if size >= OFF_LOOP_BYTES else work()


# --- the agent's opening: what precedes a conversation's task, by what its requests share -----------------
OPENING_MOST = 24  # messages: a longer run before the task is history first seen mid-way, not an opening
OPENING_RUNS = 16  # the different openings remembered per agent (its system prompt)


def task_key(message: Mapping[str, Any]) -> str:
    """How a conversation's task (a user message) is remembered: a digest of it."""
    return fingerprint(message)[:24]


def agent_opening(messages: Sequence[Mapping[str, Any]], tasks: MutableMapping[Any, Any], scope: str = "") -> Opening:
    """What precedes the conversation's task in ``messages``: the task is the last user message of the
    conversation's first request (nothing the model said through the proxy can precede it), which every later
    request keeps; found among the first user messages, else this is a first request and its task is remembered
    in ``tasks`` (under ``scope``: who asks and which agent, :attr:`ChatRequest.scope`) with a print of what
    precedes it. What precedes it (a run without tool calls or results, of at
    most :data:`OPENING_MOST` messages; else history first seen mid-way, 0) is never the user's words (example
    exchanges). It is the agent's opening, standing context, on evidence: the agent sent it changed while the
    conversation after it stayed (context it re-sends updated: files the user added, a repository map), or the
    same run opened another conversation of the same agent (few-shot examples, rules). Without evidence it is
    history like the rest (a chat first seen mid-way is summarised, not kept whole)."""
    lead, n = leading_system(messages), len(messages)
    users = [i for i in range(lead, min(n, lead + OPENING_MOST + 1)) if messages[i]["role"] == "user"]
    task, key = next(((i, k) for i in users if (k := task_found(tasks, scope, messages[i]))), (None, None))
    first = task is None
    if first:
        task = next((i for i in range(n - 1, lead - 1, -1) if messages[i]["role"] == "user"), None)
    standing = tasks.get((scope, "standing"))  # how long this agent's standing opening was last
    rewritten = False
    if first and task is not None and not _an_opening(messages[lead:task]) and isinstance(standing, int):
        after = lead + standing  # its opening then a history it rewrote itself (its own summary first)
        rewritten = standing > 0 and after < n and messages[after]["role"] == "user"
        rewritten = rewritten and _an_opening(messages[lead:after])
        task = after if rewritten else task
    if task is None or not _an_opening(messages[lead:task]):
        return Opening()
    key, run = key or (scope, task_key(messages[task])), fingerprint(messages[lead:task])[:24]
    if first:
        agent = (scope, fingerprint([plain_content(m.get("content")) for m in messages[:lead]])[:24])  # its prompt
        runs = list(tasks.get(agent) or [])
        tasks[key] = {"run": run, "standing": rewritten or (run in runs and task > lead), "task": key[1]}
        for alias in _task_prefixes(messages[task]):  # the task as later requests send it, without a reminder
            tasks.setdefault((scope, alias), tasks[key])
        if task > lead and run not in runs:
            tasks[agent] = [*runs, run][-OPENING_RUNS:]
        return _standing(tasks, scope, Opening(task - lead if tasks[key]["standing"] else 0, task - lead))
    record = tasks[key] if isinstance(tasks[key], dict) else {"run": run, "standing": False}
    if not record["standing"] and record["run"] != run:  # sent again, changed: the agent's own context
        tasks[key] = record = {**record, "run": run, "standing": True}
    return _standing(tasks, scope, Opening(task - lead if record["standing"] else 0, task - lead))


def _standing(tasks: MutableMapping[Any, Any], scope: str, opening: Opening) -> Opening:
    """``opening``, its standing length remembered for ``scope``: a request of that agent first seen whose run
    before its newest prompt is no opening (longer, or with tool calls) but starts with one that long, followed by
    a user message, is its conversation after the agent summarised its own history (aider: its opening re-sent,
    then its summary and the turns since): that message is its task and the opening stands."""
    if opening.standing and tasks.get((scope, "standing")) != opening.standing:
        tasks[scope, "standing"] = opening.standing
    return opening


_PARAGRAPH_BREAK = re.compile(r"\r?\n[ \t]*\r?\n")  # a blank line
TASK_PREFIXES = 8  # paragraphs of a task whose text up to them is remembered as the task too


def _task_prefixes(message: Mapping[str, Any]) -> list[str]:
    """:func:`_text_key` of the task's text up to each of its first :data:`TASK_PREFIXES` blank lines: an agent
    that appends a reminder (its rules, a date) to the newest user message alone sends the same message without it
    in every later request; and of the user's words alone (:func:`~context_shrink.user_words`): an agent that writes
    its tagged blocks around them anew (Qwen Code's reminders, resumed) sends the same words."""
    text, words = plain_content(message.get("content")), user_words(message)
    ends = [m.start() for m in itertools.islice(_PARAGRAPH_BREAK.finditer(text), TASK_PREFIXES)]
    return [_text_key(text[:end]) for end in ends if text[:end].strip()] + [_text_key(w) for w in _said(words)]


def _said(words: str) -> list[str]:
    """``[words]`` when they say enough to know a conversation by (32 characters: a "hi" starts many), else none."""
    return [words] if len(words) >= 32 else []


def _text_key(text: str) -> str:
    """A task's text as an agent may send it again: spaces and line ends around it left off (aider restores its
    history with two spaces and a line end after each message)."""
    return "text:" + task_key({"role": "user", "content": text.strip()})


def task_found(tasks: Mapping[Any, Any], scope: str, message: Mapping[str, Any]) -> tuple[str, str] | None:
    """The key ``tasks`` holds ``message`` under as a conversation's task: as it was sent, else as its text or the
    user's words in it (:func:`_task_prefixes`); None when it is no task of ``scope``."""
    return next(((scope, key) for key in _task_keys(message) if (scope, key) in tasks), None)


def _task_keys(message: Mapping[str, Any]) -> Iterator[str]:
    """:func:`task_found`'s keys, each worked out only when the one before is not known (the user's words last)."""
    yield task_key(message)
    yield _text_key(plain_content(message.get("content")))
    yield from map(_text_key, _said(user_words(message)))


def memory_task(tasks: Mapping[Any, Any], scope: str, message: Mapping[str, Any]) -> str:
    """The task a conversation's memory is kept under when ``message`` is its task: the first request's, also when
    the agent sends that message otherwise later (:func:`task_found`), else ``message``'s own :func:`task_key`."""
    found = task_found(tasks, scope, message)
    record = tasks.get(found) if found else None
    return record["task"] if isinstance(record, dict) and isinstance(record.get("task"), str) else task_key(message)


def _an_opening(run: Sequence[Mapping[str, Any]]) -> bool:
    return len(run) <= OPENING_MOST and not any(m.get("tool_calls") or m["role"] in RESULT_ROLES for m in run)


# --- one request fitted to its server: read, window, count once, calibrate, shrink, recount ----------------------
# The proxy's request path (its shrink_request is fit_request); the state it learns lives in a ServerMemory.

ReportT = TypeVar("ReportT", bound="FitReport")
MESSAGE_BYTES = 4096  # about what a message of an agent's history takes, to size a request before reading it
TEXT_CLASS_TEXTS = 4  # the longest texts of a request that decide its class
PROXY_MAX_RESERVE = 1024  # reserved for the reply when the request names no max_tokens
CALIBRATION_LIMITS = (0.25, 4.0)  # a per-model correction factor stays in this range (a safety net)
EXACT_ZONE = (0.5, 4.0)  # estimates from half the trigger to 4x the budget are counted by the upstream, if it can
EXACT_RECHECK = 0.85  # a shrunk request estimated above this share of the budget is counted too
CALIBRATE_MOST = 8  # windows: a first request larger than this is not sent to the upstream to be counted


def text_class(texts: Iterable[str]) -> str:
    """The class of a request's text as the heuristic tells classes apart, by its longest texts: the script of
    most of their characters when it has a good share of them (``Han``, ``Cyrillic (U+0400-U+043F)``...), else
    their kind (``ascii``, ``code``, ``escaped``, ``json``, ``latin``, ``plain``). Calibrations are learnt per
    class."""
    shares: collections.Counter[str] = collections.Counter()
    for text in heapq.nlargest(TEXT_CLASS_TEXTS, texts, key=len):
        shares[TEXT_LABELS[text]] += len(text)
    return shares.most_common(1)[0][0] if shares else "ascii"


def calibrated(factor: float | None, estimate: int, actual: int) -> float:
    """The next per-model correction factor: the server's prompt count over our estimate, smoothed."""
    ratio = min(max(actual / max(1, estimate), CALIBRATION_LIMITS[0]), CALIBRATION_LIMITS[1])
    return ratio if factor is None else round(0.5 * factor + 0.5 * ratio, 4)


def model_of(body: Mapping[str, Any]) -> str | None:
    """The model a request body names, if it names one."""
    return body.get("model") if isinstance(body.get("model"), str) else None


def caller_print(credentials: Iterable[str | None]) -> str:
    """Who asks, as a print: a digest of the credentials a client sent (its key, in whichever header), never the
    key itself; empty for a client that sent none."""
    given = "\n".join(c for c in credentials if c)
    return hashlib.sha256(given.encode("utf-8", "surrogatepass")).hexdigest()[:24] if given else ""


_NUMBERS = re.compile(r"\d+")


def _ends(text: str, most: int = 1 << 16) -> str:
    """A text's head and tail when it is long (an identity need not read megabytes), with its length."""
    return text if len(text) <= most else f"{text[: most // 2]}…{len(text)}…{text[-most // 2 :]}"


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A chat-shaped request as the proxy reads it: its messages and tools checked, its model, and who asks
    (``caller``: :func:`caller_print`)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    model: str | None
    caller: str = ""
    size: int = 0  # its bytes, as the door read them: what decides where its work runs (:func:`off_loop`)

    @functools.cached_property
    def scope(self) -> str:
        """Whose conversations this request's can be: the caller and the agent's fixed part (its leading system
        messages' text, with every number blanked: a date or a count in it changes from day to day, and its
        tools' names). What a conversation held is remembered under it and its task, never under a message
        alone: a client never meets another's words, nor an agent another agent's."""
        lead = leading_system(self.messages)
        texts = [_NUMBERS.sub("0", _ends(plain_content(m.get("content")))) for m in self.messages[:lead]]
        names = sorted(str((t.get("function") or {}).get("name")) for t in self.tools)
        return fingerprint([self.caller, texts, names])[:24]

    @functools.cached_property
    def calibration(self) -> tuple[str | None, str]:
        """The key its count is calibrated by: the model, and the class of its text (:func:`text_class`)."""
        return self.model, text_class(plain_content(m.get("content")) for m in self.messages)

    @classmethod
    def read(cls, body: dict[str, Any], caller: str = "", size: int = 0) -> ChatRequest:
        """Raises :class:`ContextShrinkError` for a body whose messages or tools do not read as chat."""
        tools = body.get("tools") or []
        if isinstance(tools, list):  # a tool of another kind (``custom``, a server's own) counted as its JSON
            tools = [pseudo_tool(t) if isinstance(t, dict) and t.get("type", "function") != "function" else t
                     for t in tools]  # fmt: skip
        messages = validate_messages(body.get("messages"))
        size = max(size, len(messages) * MESSAGE_BYTES)
        return cls(body, messages, validate_tools(tools), model_of(body), caller, size)


@dataclasses.dataclass(frozen=True)
class Measured:
    """A request counted once: per message in the local tokenizer (``counts``), and the whole in the upstream's
    tokens (``tokens``: its own count when ``exact``, else the local one calibrated). ``tools_cost`` is what the
    tools add in the upstream's tokens once it counted them (None: they are counted as the messages are, in
    ``local_tools`` local tokens)."""

    counts: list[int]
    raw: int
    tokens: int
    tools_cost: int | None
    exact: bool
    local_tools: int = 0
    source: str = ""  # what counted: the upstream's endpoint, or the local tokenizer, the text's class, the calibration
    key: tuple[str | None, str] = (None, "ascii")  # the calibration it was counted at: the model and the text's class


@dataclasses.dataclass
class FitReport:
    """What :func:`fit_request` did with one request: measured (``tokens_before``, the ``window``, the capped
    ``reserve``, ``count`` exact or estimated, ``tools_tokens``) and shrunk (``action``, ``tokens_after``,
    ``reason``, the summary's cost, ``ms``). The proxy's report adds what forwarding did."""

    tokens_before: int | None = None
    tokens_after: int | None = None
    action: str = "none"
    window: int | None = None
    reserve: int | None = None  # the reply's reserve, when the one asked was capped
    count: str = "estimated"  # exact: the upstream counted the request
    counted_by: str | None = None  # the upstream's endpoint that counted, or the local tokenizer [class] x factor
    estimated_as: str = "ascii"  # the class of the request's text, whose calibration a reply's usage teaches
    tools_tokens: int | None = None  # in the upstream's tokens, once it counted them (None: as the messages are)
    reason: str | None = None
    ms: int | None = None
    summary_cached: bool | None = None
    summary_calls: int = 0
    fixed_tokens: int | None = None  # the agent's fixed part, when it alone cannot fit the budget
    typed: list[int] = dataclasses.field(default_factory=list)  # the user's messages first seen (their indices)
    carried: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what a ledger drew from (remembered)


class UpstreamSettings(Protocol):
    """What fitting a request reads of its door's settings (the proxy's ``ProxyConfig``)."""

    @property
    def base(self) -> str: ...  # the upstream's base URL, ending in /v1
    @property
    def window(self) -> int | None: ...  # None: discovered from the upstream
    @property
    def summary_url(self) -> str | None: ...
    @property
    def summary_model(self) -> str | None: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def summary_options(self) -> SummaryOptions: ...


class ServerMemory:
    """What a door knows of its upstream and learns from its requests, for :func:`fit_request`: its settings,
    one HTTP client, the tokenizer and policy, and tables (any mapping; the proxy's live in its store): the
    learnt ``windows``, the calibration ``factors`` by model and text class, the upstream's ``counts`` by message
    prefix and what its ``tool_costs`` are, the ``tasks`` conversations began with and what each ``said`` (the
    user's words and the values seen). The proxy's ``ProxyState`` is one."""

    config: UpstreamSettings
    http: httpx2.AsyncClient
    tokenizer: Tokenizer
    policy: Policy
    caches: BackendCaches
    summaries: SummaryCache
    windows: MutableMapping[Any, Any]  # model -> learnt window
    factors: MutableMapping[Any, Any]  # (model, text class) and model -> calibration
    counts: StoredTable  # (model, tools, prefix hash) -> upstream count
    tool_costs: MutableMapping[Any, Any]  # (model, tools) -> upstream tokens
    tasks: MutableMapping[Any, Any]  # the tasks conversations began with (:func:`agent_opening`)
    said: MutableMapping[Any, Any]  # a conversation's user words and values, by its task (:func:`remembered`)

    def remember(self, table: MutableMapping[Any, Any], model: Any, value: Any) -> None:
        table[model] = value  # the newest last; the store bounds the table (STATE_TABLES)

    def factor(self, key: tuple[str | None, str]) -> float:
        """The calibration of a model's count on text of one class (:attr:`ChatRequest.calibration`); until that
        class has one, the model's last from any class."""
        return self.factors.get(key, self.factors.get(key[0], 1.0))

    def learn_factor(self, key: tuple[str | None, str], factor: float) -> None:
        self.remember(self.factors, key, factor)
        self.remember(self.factors, key[0], factor)

    def backend(self, url: str, authorization: str | None) -> Backend:
        """The upstream (or the summariser at ``url``) with the door's key, else the client's, redacted from
        every error like ours."""
        key, headers = self.config.api_key, {}
        if authorization and not key:
            scheme, _, token = authorization.partition(" ")
            key, headers = (
                (token, {}) if scheme.lower() == "bearer" and token else (None, {"Authorization": authorization})
            )
        secrets = secret_forms(authorization) + secret_forms(self.config.api_key)
        settings = ("--upstream" if url == self.config.base else "--summary-url", "--timeout")
        return Backend(self.http, url, key, headers, caches=self.caches, secrets=secrets, settings=settings)


WINDOW_HINT = (
    "requests are forwarded unshrunk until the upstream refuses one for its length: start the proxy with "
    "--window N (the server's context size: llama.cpp's -c/--ctx-size)"
)


async def server_window(state: ServerMemory, model: str | None, authorization: str | None) -> int | None:
    """The window for ``model``: learnt from a refusal, else configured, else discovered (said in the log once,
    and when it changes); None if unknown (said in the log once while the upstream's answer is kept,
    :data:`context_shrink.WINDOW_UNKNOWN_SECONDS`)."""
    if model in state.windows:
        return state.windows[model]
    if state.config.window:
        return state.config.window
    try:
        window, source = await state.backend(state.config.base, authorization).context_window(model)
    except WindowUnknown as exc:
        if not exc.repeated:
            log.warning("proxy: window unknown for %s (%s); %s", model, exc, WINDOW_HINT)
        return None
    except ContextShrinkError as exc:
        log.info("proxy: window unknown for %s (%s); %s", model, exc, WINDOW_HINT)
        return None
    if state.caches.announced.get(model) != window:  # said once, and again when it changes
        state.caches.announced[model] = window
        log.info("proxy: enforcing the window of %s, %d tokens (the upstream's %s; --window N sets another)", model,
                 window, source)  # fmt: skip
    return window


async def server_summariser(
    state: ServerMemory, model: str | None, window: int, authorization: str | None, tokenizer: Tokenizer,
    spent: collections.Counter[str],
) -> SpanSummary:  # fmt: skip
    """The door's summariser, bound for :func:`shrink`: the configured one (its window discovered once, else
    the upstream's) or the upstream's model; it counts with its own server when that server can count. Each
    call it makes is counted in ``spent["calls"]``, whether it succeeds or not."""
    config = state.config
    model = config.summary_model or model
    if not model:
        raise ContextShrinkError("no model to summarise with: the request names none and no summary model is set")
    backend = state.backend(config.summary_url or config.base, authorization)
    url = backend.base_url  # the summariser's name: its failures are filed under it
    if config.summary_url:
        key = f"summariser {url} {model}"
        if key not in state.windows:  # probed once, whatever the answer
            found = 0  # none found
            try:
                found = (await backend.context_window(model))[0]
            except BackendError as exc:  # no server answers: backed off at once, no request waits on retries
                if exc.down:
                    state.summaries.failed(f"model {model} @ {url}", str(exc))
            except ContextShrinkError:
                pass
            state.remember(state.windows, key, found)
        window = state.windows[key] or window

    summariser = backend_summariser(backend, model, window, spent)

    async def summarise(messages: list[dict[str, Any]], plan: dict[str, Any], limit: int, grown: int) -> dict[str, Any]:
        options = dataclasses.replace(config.summary_options, max_summary_tokens=limit, min_new_tokens=grown)
        return await summarise_span(messages, plan, tokenizer, summariser, state.summaries, options)

    return summarise


async def calibrate(
    state: ServerMemory, request: ChatRequest, raw: int, window: int, authorization: str | None
) -> bool:
    """Learn the model's calibration from the upstream's own count of a request over a quarter of the window
    (``raw``: its local count, messages and tools) and under :data:`CALIBRATE_MOST` windows, when the upstream can
    count (llama.cpp, vLLM, TGI), so the first shrunk request is sized right. True when the upstream counted it. (A
    request of many windows is not sent to be counted: the server would tokenise megabytes to tell a ratio a
    smaller request tells as well.)"""
    if not window // 4 < raw <= CALIBRATE_MOST * window:
        return False
    try:
        backend = state.backend(state.config.base, authorization)
        exact = (await backend.count_tokens(request.messages, request.tools, request.model))[0]
    except ContextShrinkError:
        return False
    state.learn_factor(request.calibration, calibrated(None, raw, exact))
    return True


async def upstream_count(
    state: ServerMemory,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    model: str | None,
    authorization: str | None,
    counts: Sequence[int],
) -> tuple[int, int, str] | None:
    """The upstream's own count of this request as ``(messages, what the tools add, how it was counted)`` —
    the tools' part is 0 when its chat template drops them — or None when it cannot count. Counts are
    remembered by message prefix: a request that extends one counted before costs no call while what it adds
    (``counts``: the messages' local counts, scaled) is under a quarter of the counted part."""
    chain, tools_print = await off_loop(
        len(messages) * MESSAGE_BYTES, lambda: (span_hashes(messages), fingerprint(tools))
    )
    k, found = state.counts.first([(model, tools_print, chain[k]) for k in range(len(messages), 0, -1)])
    if found is not None:
        (bare, cost, method), known = found, len(messages) - k
        added = sum(counts[known:])
        if added <= bare // 4:
            return bare + added, cost, method if not added else f"{method}, {added} added tokens estimated"
    backend = state.backend(state.config.base, authorization)
    try:
        total, method = await backend.count_tokens(messages, tools, model)
        bare = (await backend.count_tokens(messages, [], model))[0] if tools else total
    except ContextShrinkError:
        return None
    state.remember(state.counts, (model, tools_print, chain[-1]), (bare, max(0, total - bare), method))
    return bare, max(0, total - bare), method


def request_budget(body: Mapping[str, Any], window: int) -> tuple[int, int | None]:
    """The prompt's budget in ``window``: what the reply's ``max_tokens`` (else a reserve) leaves, and the
    reserve when the asked one was capped. An agent may ask for more than a local window can give (Claude
    Code asks 128,000): over half the window, an eighth is reserved (at least 1,024 tokens; llama.cpp ends such
    a reply at the window's end; a server that refuses prompt + max_tokens refuses it whatever the proxy
    cuts). A quarter left a 16k window less room than Claude Code's own prompt and tools need beside a turn."""
    asked = next((body[k] for k in ("max_completion_tokens", "max_tokens") if isinstance(body.get(k), int)), None)
    reserve = max(0, asked) if asked is not None else min(PROXY_MAX_RESERVE, window // 8)
    if reserve <= window // 2:
        return window - reserve, None
    capped = min(window // 2, max(1024, window // 8))
    return window - capped, capped


def _scaled(counts: Sequence[int], factor: float, priming: int) -> tuple[list[int], int]:
    """Local per-message counts in the upstream's tokens (``factor`` of them per local token), and the total."""
    scaled = [math.ceil(c * factor) for c in counts] if factor != 1.0 else list(counts)
    return scaled, sum(scaled) + priming


async def measure(
    state: ServerMemory, request: ChatRequest, budget: int, window: int, authorization: str | None
) -> Measured:
    """Count the request once: locally per message; near the limit the upstream counts it itself (the messages
    and the tools apart: a template may drop the tools), and that count decides and calibrates; a first long
    request of a model and text class calibrates it. ``source`` says what counted: the upstream's endpoint, or the
    local tokenizer with the text's class and the calibration it was scaled by."""
    tok, model = state.tokenizer, request.model

    def counted() -> tuple[list[int], tuple[str | None, str], str, int]:  # in proportion to the request's size
        tools = fingerprint(request.tools)
        tools_cost = state.tool_costs.get((model, tools)) if request.tools else 0  # the upstream's, once it said
        local = count_tools(request.tools, tok) if tools_cost is None else 0
        return [count_message(m, tok.count, tok.format) for m in request.messages], request.calibration, tools, local

    counts, key, tools_print, local_tools = await off_loop(request.size, counted)
    raw = sum(counts) + tok.format.priming
    tools_key = (model, tools_print)
    tools_cost = state.tool_costs.get(tools_key) if request.tools else 0
    factor = state.factor(key)
    scaled, total = _scaled(counts, factor, tok.format.priming)
    tools = math.ceil(local_tools * factor) if tools_cost is None else tools_cost
    trigger = state.policy.trigger * budget
    if EXACT_ZONE[0] * trigger <= total + tools <= EXACT_ZONE[1] * budget:
        if found := await upstream_count(state, request.messages, request.tools, model, authorization, scaled):
            state.learn_factor(key, calibrated(None, raw, found[0]))
            state.remember(state.tool_costs, tools_key, found[1])
            return Measured(counts, raw, found[0] + found[1], found[1], True, source=found[2], key=key)
    elif key not in state.factors:  # first sight of a long request of this class: the upstream counts it, if it can
        await calibrate(state, request, raw + local_tools, window, authorization)
    source = f"{tok.name} [{key[1]}]" + ("" if factor == 1.0 else f" x{factor:.3g} (calibrated on the upstream)")
    return Measured(counts, raw, total + tools, tools_cost, False, local_tools, source, key)


async def fit_request(
    state: ServerMemory, body: dict[str, Any], authorization: str | None, report: ReportT, window: int | None = None,
    caller: str = "", size: int = 0,
) -> tuple[dict[str, Any], ReportT]:  # fmt: skip
    """The request body to forward and its ``report``, filled in, in one direction: read, measure once
    (:func:`measure`), then, over the trigger, :func:`shrink` with the door's policy and the summariser bound to
    this request's model (:func:`shrink_counted`); and what earlier requests of the conversation held that the
    agent no longer sends kept in a ledger (:func:`remembered`, within what ``caller`` — :func:`caller_print` —
    and the agent's fixed part share: :attr:`ChatRequest.scope`; the report names what it drew from,
    ``carried``, and the user's messages first seen, ``typed``: the proxy archives them). ``size`` is the request's
    bytes as the door read them (what is in proportion to it runs in a worker thread when it is large: 0, estimated
    from its messages). Raises :class:`ContextShrinkError` for a body it does not understand (the caller forwards it
    as is)."""
    started = time.perf_counter()
    listed = body.get("messages")
    size = max(size, len(listed) * MESSAGE_BYTES if isinstance(listed, list) else 0)
    request = await off_loop(size, lambda: ChatRequest.read(body, caller, size))
    opening = await off_loop(size, lambda: agent_opening(request.messages, state.tasks, request.scope))
    report.carried, report.typed = await off_loop(size, lambda: remembered(state, request, opening))
    opening = await off_loop(size, lambda: opening_seen(state, request, opening))
    report.window = window or await server_window(state, request.model, authorization)
    if report.window is None:
        report.reason = "window unknown"
        return body, report
    budget, report.reserve = request_budget(body, report.window)
    opening = opening._replace(carried=_carried_room(state, report.carried, budget))  # left beside an opening
    sent, report = await _fitted(state, request, budget, authorization, report, opening, started)
    factor = state.factor(request.calibration)
    return await off_loop(size, lambda: with_carried(state, sent, report, report.carried, budget, factor)), report


async def _fitted(
    state: ServerMemory, request: ChatRequest, budget: int, authorization: str | None, report: ReportT,
    opening: Opening,
    started: float,
) -> tuple[dict[str, Any], ReportT]:  # fmt: skip
    """:func:`fit_request` once the budget is known: measured, and shrunk over the trigger."""
    body, window = request.body, cast(int, report.window)
    measured = await measure(state, request, budget, window, authorization)
    report.tokens_before = report.tokens_after = measured.tokens
    report.count, report.counted_by = "exact" if measured.exact else "estimated", measured.source
    report.estimated_as = measured.key[1]
    report.tools_tokens = measured.tools_cost
    log.debug("proxy: %s: %s messages, %s tokens (%s by %s); budget %s of the window %s, shrunk over %s",
              request.model, len(request.messages), measured.tokens, report.count, measured.source, budget,
              window, int(state.policy.trigger * budget))  # fmt: skip
    if measured.tokens <= state.policy.trigger * budget:
        return body, report
    if (fixed := fixed_part(state, request, measured)) >= budget:
        report.action, report.reason = "forwarded unchanged", fixed_part_problem(fixed, window, budget)
        report.fixed_tokens = fixed
        log.warning("proxy: %s", report.reason)
        return body, report
    result = await shrink_counted(state, request, measured, budget, window, authorization, opening)
    if result["action"] == "none":
        return body, report
    if result["action"].startswith("unchanged"):  # nothing could be cut: the original goes out, and says why
        report.action, report.reason = "forwarded unchanged", result["reason"]
        return body, report
    if not measured.exact:  # the estimate at the calibration the plan used
        report.tokens_before = result["tokens_before"]
    report.tokens_after, report.action, report.reason = result["tokens_after"], result["action"], result["reason"]
    report.summary_cached, report.summary_calls = result["summary_cached"], result["summary_calls"]
    report.ms = round(1000 * (time.perf_counter() - started))
    log.debug("proxy: %s: %s -> %s tokens, %s -> %s messages by %s in %s ms (%s summary calls)%s", request.model,
              report.tokens_before, report.tokens_after, len(request.messages), len(result["messages"]),
              report.action, report.ms, report.summary_calls,
              f"; {report.reason}" if report.reason else "")  # fmt: skip
    return {**body, "messages": result["messages"]}, report


# --- what a conversation held: the user's words and the values, carried when the agent no longer sends them ------
REWRITE_SECONDS = 600.0  # a conversation rewritten by its agent goes on within this long of its last request
SAID_MOST = (32, 96)  # the user's messages (the newest) and the values (the rarest shapes) a conversation keeps
PRINTED = 48  # its newest messages whose digests it keeps, to know it again when its agent rewrote what precedes


def remembered(state: ServerMemory, request: ChatRequest, opening: Opening) -> tuple[list[dict[str, Any]], list[int]]:
    """What earlier requests of this conversation held that this one no longer does (the agent left it out: it
    compacted its own history, or sends an updated block of context), as messages for :func:`fact_ledger`: the
    user's words (:func:`user_words`, after the agent's opening: examples are not the user's) and the values
    (:func:`text_values`) of tool results and of the opening; and the indices of the user's messages the
    conversation had not held before (first seen: the proxy archives them). The conversation's memory
    (``state.said``, by who asks and which agent, :attr:`ChatRequest.scope`, and its task: :func:`agent_opening`)
    is updated with what this one holds; nothing is ever read across scopes. A conversation first seen whose
    request already carries history (an assistant message before the newest user message) that is not the
    agent's fixed opening, and comes within :data:`REWRITE_SECONDS` of the newest conversation of the same scope,
    is that conversation rewritten by the agent itself (its own summary in place of its turns) when it opens
    differently in fewer messages, or holds a message that one held (the newest turns the agent kept after its
    summary: :func:`_shared`): it goes on with that one's memory. (A client that replays unrelated histories
    with the same key, system prompt and tools can be taken for such a rewrite: the ledger then names the other
    one's facts.)"""
    messages, lead = request.messages, leading_system(request.messages)
    start = lead + opening.before
    if start >= len(messages) or messages[start]["role"] != "user":
        return [], []
    scope, task = request.scope, memory_task(state.tasks, request.scope, messages[start])  # one memory
    run = fingerprint(messages[lead:start])[:24]
    memory, now = state.said.get((scope, task)), time.time()
    known = memory is not None  # what it held is in its memory: the newest of the user's words
    if memory is None:
        latest = state.said.get(scope)  # the task of the scope's newest conversation
        history = any(m["role"] == "assistant" for m in messages[lead:-1])
        inherited = state.said.get((scope, latest)) if latest and history else None
        recent = inherited and now - inherited.get("at", 0) < REWRITE_SECONDS
        reopened = recent and inherited.get("opening") != run and len(messages) < inherited.get("messages", 0)
        rewrite = reopened or (recent and _shared(messages[lead + opening.standing :][-PRINTED:], inherited))
        memory = dict(inherited) if rewrite else {"user": [], "values": []}
    said = [(i, w) for i, m in enumerate(messages[start:], start) if m["role"] == "user" and (w := user_words(m))]
    new = said[-SAID_MOST[0] :] if known else said  # older ones than its memory keeps were seen before
    users, typed = [w for _, w in said], [i for i, w in new if w not in memory["user"]]
    values = [v for i, m in enumerate(messages) if (m["role"] in RESULT_ROLES or lead <= i < start)
              for v in text_values(plain_content(m.get("content")))]  # fmt: skip
    present = "\n".join(plain_content(m.get("content")) for m in messages)
    carried = [{"role": "user", "content": u} for u in memory["user"] if u not in present]
    gone = [v for v in memory["values"] if v not in present]
    carried += [{"role": "tool", "content": "\n".join(gone)}] if gone else []
    typed_words, reminders = _typed(list(dict.fromkeys([*memory["user"], *users])), memory.get("reminders") or ())
    updated = {
        "user": typed_words[-SAID_MOST[0] :],
        "reminders": reminders,
        "values": ranked_values(list(dict.fromkeys([*memory["values"], *values])))[: SAID_MOST[1]],
        "opening": run,
        "messages": len(messages),
        "prints": _prints(messages[start:][-PRINTED:]),
        **{k: memory[k] for k in ("lines", "standing") if k in memory},  # :func:`opening_seen`'s
    }
    if {**updated, "at": memory.get("at")} != memory or now - memory.get("at", 0) > REWRITE_SECONDS / 4:
        state.said[scope, task] = {**updated, "at": now}
    if state.said.get(scope) != task:
        state.said[scope] = task
    return carried, typed


REMINDERS_KEPT = 4  # the reminders an agent appended to the newest message that a conversation remembers


def _typed(words: list[str], known: Sequence[str]) -> tuple[list[str], list[str]]:
    """The user's messages as typed, and the reminders known: where the agent sent one later as a paragraph's start
    of another (the reminder it appends to the newest message alone left off: :func:`_task_prefixes`), that
    reminder is cut from every message that ends with it, then and later (``known``)."""
    found = [w[len(u) :] for w in words for u in words
             if len(u) < len(w) and w.startswith(u) and _PARAGRAPH_BREAK.match(w, len(u))]  # fmt: skip
    tails = list(dict.fromkeys([*known, *found]))[-REMINDERS_KEPT:]
    cut = (next((w[: -len(t)] for t in tails if len(t) < len(w) and w.endswith(t)), w) for w in words)
    return list(dict.fromkeys(cut)), tails


def _prints(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Digests of a conversation's messages that say something (a tool call, or 32 characters of text: an "ok"
    is in every conversation), to know a rewrite of it by the turns it kept."""
    return [fingerprint(m)[:16] for m in messages
            if m.get("tool_calls") or len(plain_content(m.get("content"))) >= 32]  # fmt: skip


def _shared(messages: Sequence[Mapping[str, Any]], memory: Mapping[str, Any]) -> bool:
    """Whether ``messages`` hold one the conversation of ``memory`` held (:func:`_prints`): its agent kept its
    newest turns after its own summary."""
    prints = set(memory.get("prints") or ())
    return any(p in prints for p in _prints(messages))


OPENING_LINES = 16_384  # lines of an agent's opening whose prints a conversation keeps (6 characters each)


def opening_seen(state: ServerMemory, request: ChatRequest, opening: Opening) -> Opening:
    """``opening`` with the lines of it the conversation sent before this turn (``seen``: their
    :func:`~context_shrink.line_print`), so that what the turn added to a block the agent re-sends grown (aider's
    files) is kept whole and the older lines are elided first. Per conversation (its memory: :func:`remembered`)
    the prints of the opening as its previous turn last sent it are kept, and those of this request; a turn is
    its newest user message. The opening's length is kept too: a conversation the agent rewrote after its
    opening (its own summary of the history in place of the turns: the task is gone, so no opening is found) keeps
    that many messages standing."""
    messages, lead = request.messages, leading_system(request.messages)
    if lead + opening.before >= len(messages):
        return opening
    scope, task = request.scope, memory_task(state.tasks, request.scope, messages[lead + opening.before])
    if not isinstance(memory := state.said.get((scope, task)), dict):
        return opening
    known = memory.get("standing") if isinstance(memory.get("standing"), int) else 0
    if not opening.standing and 0 < known <= opening.before:  # the agent rewrote what follows its opening
        opening = opening._replace(standing=known)  # (its own summary of the history): the opening stands
    if not opening.standing:
        return opening
    run = messages[lead : lead + opening.standing]
    now = "".join(dict.fromkeys(line_print(line) for m in run for line in plain_content(m.get("content")).split("\n")))
    now = now[-6 * OPENING_LINES :]
    turn = task_key(next(m for m in reversed(messages) if m["role"] == "user"))
    lines = memory.get("lines") if isinstance(memory.get("lines"), dict) else {}
    before = lines.get("now" if lines.get("turn") != turn else "before")  # a new turn: the last one's are before
    lines = {"turn": turn, "before": before if isinstance(before, str) else "", "now": now}
    if lines != memory.get("lines") or known != opening.standing:
        state.said[scope, task] = {**memory, "lines": lines, "standing": opening.standing}
    before = lines["before"]
    return opening._replace(seen=frozenset(before[k : k + 6] for k in range(0, len(before), 6)))


def _carried_room(
    state: ServerMemory, carried: list[dict[str, Any]], budget: int, count: Callable[[str], int] | None = None
) -> int:
    """The room :func:`with_carried` gives a ledger of ``carried`` (0 without one; ``count``: the tokenizer's, or
    at a calibration): what an agent's opening is elided to leave (``Opening.carried``; the budget itself stays,
    so the cuts stay where they were)."""
    if not carried or not state.policy.ledger:
        return 0
    count = count or state.tokenizer.count
    return state.policy.ledger_tokens(budget, sum(count(m["content"]) + 2 for m in carried if m["role"] == "user"))


def with_carried(
    state: ServerMemory, body: dict[str, Any], report: FitReport, carried: list[dict[str, Any]], budget: int,
    factor: float = 1.0,
) -> dict[str, Any]:  # fmt: skip
    """``body`` with a ledger of ``carried`` (:func:`remembered`) after its leading system messages, within a
    ledger's room and what the budget leaves (nothing when less than 64 tokens), counted at the model's
    calibration ``factor`` (the budget is in the upstream's tokens)."""
    if not carried or not state.policy.ledger:
        return body
    count = dataclasses.replace(state.tokenizer, scale=factor).scaled
    room = min(_carried_room(state, carried, budget, count) or 64, budget - (report.tokens_after or budget))
    messages = body["messages"]
    text = fact_ledger(carried, messages, count, room, state.policy.recall) if room >= 64 else None
    if text is None:
        return body
    lead = leading_system(messages)
    report.tokens_after = (report.tokens_after or 0) + count(text) + 8
    report.action = "ledger" if report.action == "none" else f"{report.action}+ledger"
    return {**body, "messages": [*messages[:lead], {"role": "system", "content": text}, *messages[lead:]]}


def fixed_part(state: ServerMemory, request: ChatRequest, measured: Measured) -> int:
    """What no rung can shrink, in the upstream's tokens: the agent's leading system messages and its tools."""
    factor = state.factor(measured.key)
    local = sum(measured.counts[: leading_system(request.messages)]) + state.tokenizer.format.priming
    return math.ceil((local + measured.local_tools) * factor) + (measured.tools_cost or 0)


def fixed_part_problem(fixed: int, window: int, budget: int) -> str:
    """The plain words for an agent whose fixed part alone does not fit the window."""
    return (f"the agent's system prompt and tools need {fixed:,} tokens; the window is {window:,} tokens "
            f"({budget:,} after the reply's reserve): start the server with a larger window (llama.cpp: -c), or "
            "give the agent fewer tools (MCP servers, plugins)")  # fmt: skip


async def shrink_counted(
    state: ServerMemory, request: ChatRequest, measured: Measured, budget: int, window: int,
    authorization: str | None, opening: Opening = NO_OPENING,
) -> dict[str, Any]:  # fmt: skip
    """:func:`shrink` at the model's calibration, corrected at most once: when the shrunk request, counted by
    the upstream, is over the budget (after a deep cut the calibration from the whole request can be off for
    what is left), or when summarising taught the model's tokens per local token (its summariser is the
    upstream's model) and the model had no calibration yet; summaries are cached, so the second plan costs no
    model call. ``summary_calls`` is every call made to the summariser, those that failed included."""
    model, tools, key = request.model, request.tools, measured.key
    uncalibrated, spent = key not in state.factors, collections.Counter[str]()

    async def planned(factor: float) -> dict[str, Any]:
        tokenizer = dataclasses.replace(state.tokenizer, scale=factor)
        summarise = None
        with contextlib.suppress(ContextShrinkError):  # no model to summarise with: the trim rung does it
            summarise = await server_summariser(state, model, window, authorization, tokenizer, spent)
        counted = _scaled(measured.counts, factor, tokenizer.format.priming)[1]
        if measured.tools_cost is None:  # the tools counted as the messages are
            return await shrink(request.messages, tools, tokenizer, budget, state.policy, summarise, counted, opening)
        cost = measured.tools_cost
        result = await shrink(request.messages, [], tokenizer, budget - cost, state.policy, summarise, counted,
                              opening)  # fmt: skip
        return {
            **result,
            "tokens_before": result["tokens_before"] + cost,
            "tokens_after": result["tokens_after"] + cost,
        }

    result = await planned(state.factor(key))
    factor = None
    if result["tokens_after"] >= EXACT_RECHECK * budget and result["messages"] != request.messages:
        kept, raw = await off_loop(request.size, lambda: count_messages(result["messages"], state.tokenizer))
        scaled = _scaled(kept, state.factor(key), 0)[0]
        found = await upstream_count(state, result["messages"], tools, model, authorization, scaled)
        if found and found[0] + found[1] > budget:
            factor = calibrated(None, raw, found[0])
    same = not (state.config.summary_url or state.config.summary_model)  # the upstream's model summarised
    learnt = state.summaries.ratios.get(ratio_key(f"model {model} @ {state.config.base}", state.tokenizer))
    if factor is None and same and uncalibrated and learnt and abs(learnt - 1) > 0.1:
        factor = learnt  # the summariser's tokens are the model's
    if factor is not None:
        state.learn_factor(key, factor)
        result = await planned(factor)
    return {**result, "summary_calls": spent["calls"]}


# =============================================================================
# 3. The fixed part made leaner when it leaves the turn no room: the tools' descriptions cut, the system
#    prompt dieted, then outlined
# =============================================================================

# --- the fixed part, leaner when it leaves the turn no room -------------------------------------------------
# An agent's system prompt and tools are sent with every request. When they take more than LEAN_SHARE of the
# budget (the window less the reply's reserve), the tools' descriptions are cut to their first sentence (the
# tool's own to it and a marker naming RECALL_TOOL, which returns the whole of it): the only strings changed are
# those under a ``description`` key of a tool or of a schema in it, so names, parameters, types, enums, required
# lists and defaults are the agent's, byte for byte, by construction. The same tools give the same bytes on every
# request (the prefix stays cached).
LEAN_SHARE = 0.5  # of the budget: a fixed part above it has its tools' descriptions cut
LEAN_LEAST = 80  # characters a cut must save, else a description is kept whole
LEAN_MOST = 1 << 20  # characters of a system prompt the diet and the outline read, at most (a larger one, ~250k
# tokens, is over half of any window it could be made to fit: it goes as it is, and no request waits on seconds of it)
_VALUES_IN_SCHEMA = frozenset({"enum", "const", "default", "examples", "example"})  # data, never walked into
_SENTENCE_END = re.compile(r"(?<=[.!?])\s(?!\s*[a-z])|\n")  # a stop and a space, not before a small letter (i.e. so)


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (to its first stop and a space, or its first line break)."""
    text = text.strip()
    end = _SENTENCE_END.search(text)
    return text[: end.start()].rstrip() if end else text


def lean_tools(tools: Sequence[Any], recall: bool = True) -> tuple[list[Any], dict[str, str]]:
    """``tools`` (of any wire API: Chat Completions', Responses', Anthropic's) with every long description cut
    to its first sentence, and each changed tool's whole descriptions by its name (what :data:`RECALL_TOOL`
    returns); the tool's own description says where the rest is (``recall``: the recall tool is offered).
    Cached: an agent sends the same tools every request."""
    key = canonical_json([tools, recall])
    if (found := LEANED.get(key)) is None:
        found = LEANED[key] = _lean_tools(tools, recall)
        while len(LEANED) > LEANED_MOST:
            LEANED.pop(next(iter(LEANED)))
    return copy.deepcopy(found[0]), dict(found[1])


def fixed_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any], count: Callable[[str], int]) -> int:
    """An agent's fixed part as ``count`` (a local estimate: the same every request) sees it: the text of its
    leading system messages and its tools' JSON, in whatever wire format they came."""
    lead = leading_system(messages)
    texts = [plain_content(m.get("content")) for m in messages[:lead]]
    return sum(map(count, texts)) + (count(json.dumps(tools, ensure_ascii=False)) if tools else 0)


# When the tools cut and the system prompt's repeated lines removed still leave the fixed part over LEAN_SHARE of
# the budget (an 8k window beside an agent's 4k instructions), the system prompt is sent as its outline: each
# paragraph keeps its headings, its tag lines and its first sentence, as written; the rest is marked, and the
# whole is one recall away (the proxy's recall tool searches it). A paragraph holding a code fence stays whole.
_LINE_END = re.compile(r"\r\n|\r|\n")  # LF, CRLF, or CR alone (an old Mac's, a pasted text's)
_EOL = r"(?:\r\n|\r(?!\n)|\n)"  # one line end: a CRLF is one, never a CR and then an LF
_PARAGRAPHS = re.compile(rf"({_EOL}[ \t]*{_EOL}(?:[ \t]*{_EOL})*)")  # blank lines between paragraphs
_OUTLINE_KEPT = re.compile(r"[ \t]*(?:#{1,6}\s|</?[A-Za-z][\w-]*>\s*$)")  # a heading, a tag alone on its line
OUTLINE_NOTE = "[This system prompt is outlined to fit the window: each paragraph keeps its first sentence.{}]"


@functools.lru_cache(maxsize=16)  # an agent sends the same system prompt every request
def outlined(text: str, recall: bool = True) -> str | None:
    """``text`` (a system prompt) as its outline, with a note that says so (and, with ``recall``, that
    :data:`RECALL_TOOL` returns the rest); None when no paragraph is long enough to save :data:`LEAN_LEAST`
    characters. Every line it keeps is the text's own, or its start to the end of a sentence and ``[…]``."""
    parts = _PARAGRAPHS.split(text)  # paragraphs, and the blank lines between them (any line ends)
    short = [part if k % 2 else _outlined_paragraph(part) for k, part in enumerate(parts)]
    if short == parts:
        return None
    words = f" {RECALL_TOOL} with words from it returns the lines it leaves out." if recall else ""
    return "".join(short).rstrip("\n") + "\n\n" + OUTLINE_NOTE.format(words)


def _outlined_paragraph(paragraph: str) -> str:
    if "```" in paragraph or "~~~" in paragraph:
        return paragraph
    out, first, end = [], True, (found.group() if (found := _LINE_END.search(paragraph)) else "\n")
    for line in _LINE_END.split(paragraph):
        if _OUTLINE_KEPT.match(line):
            out.append(line)
        elif first and line.strip():
            sentence = first_sentence(line)
            out.append(line if sentence == line.strip() else line[: len(line) - len(line.lstrip())] + sentence + " […]")
            first = False
        elif line.strip() and out[-1:] != ["[…]"] and not out[-1].endswith("[…]"):
            out.append("[…]")
    short = end.join(out)  # its own line ends
    return short if len(paragraph) - len(short) >= LEAN_LEAST else paragraph


LEANED: dict[str, tuple[list[Any], dict[str, str]]] = {}
LEANED_MOST = 16  # tool lists kept leaned (agents, their versions)


def _lean_tools(tools: Sequence[Any], recall: bool) -> tuple[list[Any], dict[str, str]]:
    out, whole = [], {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = str((function if isinstance(function, dict) else tool).get("name") or "") if isinstance(
            tool, dict) else ""  # fmt: skip
        cut: list[tuple[str, str]] = []
        rest = f' [… the rest: {RECALL_TOOL} "{name}"]' if recall and name else " […]"
        out.append(_leaner(tool, None, cut, rest))
        if cut:
            whole[name] = "\n".join([f"The tool {name}, described in full:"] + [
                text if where is None else f"Parameter {where}: {text}" for where, text in cut])  # fmt: skip
    return out, whole


def _leaner(node: Any, where: str | None, cut: list[tuple[str, str]], rest: str) -> Any:
    """``node`` with its long descriptions cut (``where``: the parameter it describes, None for the tool)."""
    if isinstance(node, list):
        return [_leaner(item, where, cut, rest) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" and isinstance(value, str):
            short = first_sentence(value)
            if len(value) - len(short) >= LEAN_LEAST:
                cut.append((where, value))
                value = short + (rest if where is None else " […]")
            out[key] = value
        elif key in _VALUES_IN_SCHEMA:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _leaner(schema, name if where is None else f"{where}.{name}", cut, rest)
                        for name, schema in value.items()}  # fmt: skip
        else:
            out[key] = _leaner(value, where, cut, rest)
    return out


@dataclasses.dataclass(frozen=True)
class Lean:
    """A request body with its tools' descriptions cut (:func:`lean_request`), or as it came: ``whole`` the cut
    tools' whole descriptions by name (what :data:`RECALL_TOOL` returns), ``said`` what the door says of it."""

    body: dict[str, Any]
    whole: dict[str, str] = dataclasses.field(default_factory=dict)
    said: str | None = None
    system: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as it came, when sent outlined

    @property
    def recallable(self) -> bool:
        """Whether it cut anything the recall tool can return."""
        return bool(self.whole or self.system)


UNLEANED = Lean({})  # nothing cut


_DIET_MARKERS = re.compile(r"^\[… \d+ lines? cut …\]$", re.MULTILINE)  # :func:`diet_marker`'s lines
SystemEditor = Callable[[dict[str, Any], Callable[[str], str]], dict[str, Any]]  # a wire's ``with_system``


async def lean_request(
    state: ServerMemory, body: dict[str, Any], chat: Mapping[str, Any], authorization: str | None,
    with_system: SystemEditor | None = None, size: int = 0,
) -> Lean:  # fmt: skip
    """``body`` (in its wire's format; ``chat`` its chat view) with a leaner fixed part when the agent's system
    prompt and tools (:func:`fixed_tokens`, the local estimate: the same every request) take over
    :data:`LEAN_SHARE` of the budget (the window less the reply's reserve): its tools' descriptions cut to their
    first sentence (:func:`lean_tools`) and its system prompt's repeated lines removed by the verbatim diet
    (:func:`dieted_text`: every kept line as it was, each gap marked), written by the wire's ``with_system``; when
    that still leaves it over the share, the system prompt sent as its outline (:func:`outlined`; its whole text
    what the recall tool searches). As it is otherwise, with the policy's ``lean_tools`` off, when the window is
    unknown, or for a body it cannot read (the request path says why). The work runs in a worker thread for a
    request of ``size`` bytes or more (a system prompt of megabytes takes seconds: :func:`off_loop`)."""
    if not state.policy.lean_tools:
        return Lean(body)
    window = await server_window(state, model_of(chat), authorization)
    if window is None:
        return Lean(body)
    return await off_loop(size, lambda: leaner_request(state, body, chat, window, with_system))


def leaner_request(
    state: ServerMemory, body: dict[str, Any], chat: Mapping[str, Any], window: int,
    with_system: SystemEditor | None = None,
) -> Lean:  # fmt: skip
    """:func:`lean_request` once the ``window`` is known."""
    policy, tools = state.policy, body.get("tools") if isinstance(body.get("tools"), list) else []
    count = state.tokenizer.count
    try:
        messages = validate_messages(chat.get("messages"))
        tools_cost = fixed_tokens([], tools, count)  # counted once: for the decision and for what was saved
        system_cost = fixed_tokens(messages, [], count)
        budget = request_budget(chat, window)[0]  # what the reply's reserve leaves
        if system_cost + tools_cost <= LEAN_SHARE * budget:
            return Lean(body)
        short, whole = lean_tools(tools, policy.recall) if tools else ([], {})
    except (ContextShrinkError, TypeError, AttributeError, ValueError, RecursionError):
        return Lean(body)
    lines, saved, outline = [0], [0], [0]  # the system prompt's lines and tokens the diet takes out; the outline's

    def diet(text: str) -> str:
        if len(text) > LEAN_MOST or (lighter := DIETED[text]) is None:
            return text
        markers = len(_DIET_MARKERS.findall(lighter)) - len(_DIET_MARKERS.findall(text))
        lines[0] += text.count("\n") - lighter.count("\n") + markers  # the lines it took out
        saved[0] += count(text) - count(lighter)
        return lighter

    def outlined_text(text: str) -> str:
        if len(text) > LEAN_MOST or (lighter := outlined(text, policy.recall)) is None:
            return text
        outline[0] += count(text) - count(lighter)
        return lighter

    leaner = {**body, "tools": short} if whole else body
    dieted = with_system(leaner, diet) if with_system is not None else None
    leaner = dieted if dieted is not None and saved[0] > 0 else leaner
    tools_saved = tools_cost - fixed_tokens([], short, count) if whole else 0
    left = system_cost + tools_cost - saved[0] - tools_saved
    shorter = with_system(leaner, outlined_text) if with_system and left > LEAN_SHARE * budget else None
    leaner = shorter if shorter is not None and outline[0] > 0 else leaner
    if leaner is body:
        return Lean(body)
    said = [f"{len(whole)} tools described by their first sentence" if whole else "",
            f"the system prompt {lines[0]} lines shorter" if saved[0] else "",
            "the system prompt outlined" if leaner is shorter else ""]  # fmt: skip
    system = messages[: leading_system(messages)] if leaner is shorter else []
    cut = saved[0] + tools_saved + (outline[0] if leaner is shorter else 0)
    return Lean(leaner, whole, f"{', '.join(filter(None, said))} (-{cut} tokens)", system)
