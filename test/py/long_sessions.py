"""Long agent sessions that test memory (#27): twenty turns of a real agent, each reading two or three files of
1.6-3k tokens with the agent's own file tool, through the proxy, in front of a llama.cpp-like scripted model.
Ten facts are planted in turns 1-5: five the user states in the prompt, five inside the files read. Recorded:
what the model was sent when it answered each turn (which of the turn's files), the last request of the
session (which facts it still holds), the summary requests, and every refusal."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from agent_upstream import SUMMARY, AgentUpstream, read_call, request_view
from agents import AGENTS, LONG_AGENTS, Setup, Terminal, drive
from fake_openai import serve
from proxy_helpers import proxy

import context_shrink as cs
import context_shrink_fit as csf
import context_shrink_sessions as css
import context_shrink_wire as csw

USER_FACTS = [
    ("the deploy key is in vault path secret/deploy/prod-7741", "secret/deploy/prod-7741"),
    ("the staging API listens on port 48213", "48213"),
    ("page the on-call alias @payments-oncall-eu if it breaks", "@payments-oncall-eu"),
    ("keep the feature flag ENABLE_LEDGER_V2 off in production", "ENABLE_LEDGER_V2"),
    ("track the work under ticket OPS-90417", "OPS-90417"),
]
FILE_FACTS = [
    ("the fix landed in commit 9f3e2d71c4ab", "9f3e2d71c4ab"),
    ("the worker fails with error code E7319 on a cold start", "E7319"),
    ("restore from snapshot snap-0b7c4e91d2f5 when in doubt", "snap-0b7c4e91d2f5"),
    ("the license server is lic-03.internal.example:27009", "lic-03.internal.example:27009"),
    ("the build host has MAC address 3c:22:fb:9a:41:0e", "3c:22:fb:9a:41:0e"),
]
FACTS = [*USER_FACTS, *FILE_FACTS]
RECALL_QUERY = "notes_01_a.txt"  # the file whose first lines hold FILE_FACTS[0]
WORDS = ("parser", "cache", "budget", "window", "session", "handler", "retry", "schema", "router", "buffer")
COUNT = cs.resolve_tokenizer("tiktoken").count


def file_text(name: str, tokens: int, fact: str | None, seed: int) -> str:
    """A source-like file of about ``tokens`` cl100k tokens: functions, exceptions, paths and numbers (what
    crowds a summary's list of identifiers), one planted fact line, and a last line naming the file."""
    rng = random.Random(seed)
    lines, tok = [f"# {name}: notes on the {rng.choice(WORDS)} module"], cs.resolve_tokenizer("tiktoken")
    while tok.count("\n".join(lines)) < tokens:
        a, b = rng.sample(WORDS, 2)
        lines.append(rng.choice([
            f"def {a}_{b}_{rng.randint(1, 99)}(request, limit={rng.randint(8, 4096)}):",
            f"    raise {a.title()}{b.title()}Error('src/{a}/{b}.py line {rng.randint(1, 900)}')",
            f"    # see docs/{a}/{b}.md and tests/test_{a}_{b}.py::test_{b}_{rng.randint(1, 50)}",
            f"    return self.{a}.{b}({rng.randint(1, 10_000)}, timeout={rng.randint(1, 90)}s)",
        ]))  # fmt: skip
        if fact and len(lines) == 12:
            lines.append(f"# NOTE: {fact}.")
    return "\n".join([*lines, f"# end of {name}"]) + "\n"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The session: per turn, its prompt and the files it reads."""

    prompts: list[str]
    files: list[list[str]]


def plan(project: Path, turns: int, seed: int = 7) -> Plan:
    rng = random.Random(seed)
    prompts, files = [], []
    for t in range(1, turns + 1):
        names = [f"notes_{t:02d}_{c}.txt" for c in "abc"[: rng.choice((2, 3))]]
        for k, name in enumerate(names):
            fact = FILE_FACTS[t - 1][0] if t <= len(FILE_FACTS) and k == 0 else None
            (project / name).write_text(file_text(name, rng.randint(1600, 3000), fact, seed * 1000 + t * 10 + k))
        said = f"Remember: {USER_FACTS[t - 1][0]}. " if t <= len(USER_FACTS) else ""
        prompts.append(f"Turn {t}: {said}Read {', '.join(names)} one by one with your file tool, then say done.")
        files.append(names)
    return Plan(prompts, files)


class TurnUpstream(AgentUpstream):
    """The scripted model for many turns: it reads, one by one, the files the newest user message names that
    the turn has not read yet (in what it is sent: a read the proxy folded away is read again, as a model
    would), then answers ``done``; at most twice as many reads as files per turn. At each answer it records which of
    the turn's files it was sent whole. In turn ``recall_at``, before it answers, it asks the proxy's recall
    tool (when it is offered) for the first file of turn 1 by its name, once, and records what came back."""

    def __init__(self, window: int, project: Path, recall_at: int | None = None) -> None:
        super().__init__(window, [], 0)
        self.project = project
        self.answers: list[dict[str, Any]] = []  # per answer: the turn's files, those sent whole, the reads made
        self.reads: dict[str, int] = {}  # reads made per turn (by its prompt)
        self.recall_at = recall_at
        self.recalled: list[str] = []  # what each recall answered

    def untooled_reply(self, view: csw.ChatView) -> str:
        """An agent without tools (aider: the files are in its request) is answered ``done``; a summary request
        (the proxy's, or the agent's own) with a summary without the facts."""
        return SUMMARY if summary_request(view.messages) else "done"

    def next_call(self, tools: list[Any], view: csw.ChatView | None = None) -> tuple[str, str] | None:
        if view is None or (not tools and summary_request(view.messages)):
            return None
        readers = [t for t in tools if t[0] != cs.RECALL_TOOL]
        users = [k for k, m in enumerate(view.messages)
                 if m["role"] == "user" and "Turn " in cs.plain_content(m.get("content"))]  # fmt: skip
        if not users:
            return None
        said = re.findall(r"Turn \d+: .*?say done\.", cs.plain_content(view.messages[users[-1]].get("content")))
        prompt = said[-1] if said else ""  # the newest prompt (a ledger merged into its message quotes older ones)
        asked = re.findall(r"notes_\d\d_[abc]\.txt", prompt)
        made = json.dumps([m.get("tool_calls") for m in view.messages[users[-1] :]])
        left = [name for name in asked if name not in made]  # not read, in what it is sent
        reads = self.reads.setdefault(prompt, 0)
        if left and readers and reads < 2 * len(asked):  # a read it no longer sees is made again, twice at most
            self.reads[prompt] = reads + 1
            return read_call(tools, str(self.project / left[0]))
        if self.recall_at is not None and f"Turn {self.recall_at}:" in prompt:
            turn = view.messages[users[-1] :]
            ids = {c["id"] for m in turn for c in m.get("tool_calls") or [] if c["function"]["name"] == cs.RECALL_TOOL}
            answers = [cs.plain_content(m.get("content")) for m in turn if m.get("tool_call_id") in ids]
            if ids and not self.recalled:
                self.recalled.append(answers[-1] if answers else "")
            if not ids and any(name == cs.RECALL_TOOL for name, _ in tools):
                return cs.RECALL_TOOL, json.dumps({"query": RECALL_QUERY})
        text = json.dumps(view.messages)
        present = [n for n in asked if f"# {n}: notes" in text]  # its result is there, whole or elided
        whole = [n for n in present if f"# end of {n}" in text]
        lines = [json.dumps(line)[1:-1] for n in asked for line in (self.project / n).read_text().splitlines()]
        sent = sum(line in text for line in lines)  # the text it was sent, line by line (not the headers)
        self.answers.append({"files": asked, "present": present, "whole": whole, "reads": reads,
                             "lines": (sent, len(lines))})  # fmt: skip
        return None


AGENT_SUMMARY_PROMPTS = (
    "summarize this partial conversation",  # aider's, for its chat history over 1k tokens
    "you are compacting the earlier part of a conversation",  # Cline's, near 0.81 x 128k of its own estimate
    "summarize the provided coding session",  # Cline's too, in its other compaction mode
)


def proxy_summary(messages: list[dict[str, Any]]) -> bool:
    """The proxy's summary request (its summariser is the upstream's model)."""
    return any(m.get("content") in (cs.SUMMARY_PROMPT, cs.MERGE_PROMPT) for m in messages)


def agent_summary(messages: list[dict[str, Any]]) -> bool:
    """An agent's own summary request (its compaction)."""
    return any(p in cs.plain_content(m.get("content")).lower() for m in messages[:2] for p in AGENT_SUMMARY_PROMPTS)


def summary_request(messages: list[dict[str, Any]]) -> bool:
    """A summary request: the proxy's, or an agent's own."""
    return proxy_summary(messages) or agent_summary(messages)


def summary_requests(log: list[tuple[str, dict[str, Any]]]) -> int:
    """The proxy's summary requests."""
    return sum(1 for path, body in log
               if path == "chat" and not body.get("tools") and proxy_summary(body.get("messages", [])))  # fmt: skip


def turn_request(path: str, body: dict[str, Any]) -> bool:
    """A request of the agent's turn (not a summary request): with tools, or without, naming a turn's prompt."""
    return bool(body.get("tools")) or (not summary_request(request_view(path, body).messages)
                                       and "say done." in json.dumps(body))  # fmt: skip


@dataclasses.dataclass
class LongRun:
    upstream: TurnUpstream
    turns: int
    finished: int  # turns the agent finished (exit 0)
    last: str  # the last request of the session, as text
    proxy_log: str

    def own_ceiling(self) -> float:
        """The share of the turns' file lines the model was sent in any request, the measure of :meth:`text_sent`:
        where the proxy sends each read whole at least once (16k), what the agent's own reads carry (Cline cuts a
        read over 8,000 characters to its head and tail)."""
        texts = "\n".join(json.dumps(body) for _, body in self.upstream.log)
        lines = [json.dumps(line)[1:-1] for a in self.upstream.answers[-self.turns :] for n in a["files"]
                 for line in (self.upstream.project / n).read_text().splitlines()]  # fmt: skip
        return sum(line in texts for line in lines) / max(1, len(lines))

    def facts_kept(self) -> list[str]:
        return [needle for _, needle in FACTS if needle in self.last]

    def facts_after_compaction(self) -> list[str] | None:
        """The facts in the first request of a turn after the agent's own summary request (None: it made none)."""
        log = self.upstream.log
        own = next((k for k, (path, body) in enumerate(log) if agent_summary(request_view(path, body).messages)), None)
        if own is None:
            return None
        after = next((json.dumps(body) for path, body in log[own:] if turn_request(path, body)), None)
        return None if after is None else [needle for _, needle in FACTS if needle in after]

    def files_sent(self, kind: str = "present") -> float:
        """The share of the files its turns read that the model was sent when it answered (``present``: whole
        or elided with a marker; ``whole``)."""
        answered = self.upstream.answers[-self.turns :]
        return sum(len(a[kind]) for a in answered) / max(1, sum(len(a["files"]) for a in answered))

    def text_sent(self) -> float:
        """The share of the lines of the files its turns read that the model was sent when it answered."""
        answered = self.upstream.answers[-self.turns :]
        return sum(a["lines"][0] for a in answered) / max(1, sum(a["lines"][1] for a in answered))

    def last_request(self) -> tuple[str, dict[str, Any]]:
        """The session's last request of a turn (its API, its body): :func:`turn_request`."""
        return next((p, b) for p, b in reversed(self.upstream.log) if turn_request(p, b))

    def fixed_sent(self) -> int:
        """The agent's system prompt and tools as the model last got them (the recall tool left out), cl100k."""
        view = request_view(*self.last_request())
        tools = [t for t in view.tools if (t.get("function") or t).get("name") != cs.RECALL_TOOL]
        return csf.fixed_tokens(view.messages, tools, COUNT)

    def text_ceiling(self) -> float:
        """The most of the turns' file text any proxy could send: per answer, what the budget (the window less
        the reply's reserve) leaves beside the fixed part as sent, over the tokens of the files the turn read."""
        body = self.last_request()[1]
        asked = body.get("max_tokens", body.get("max_output_tokens"))
        budget = csf.request_budget({"max_tokens": asked} if isinstance(asked, int) else {}, self.upstream.window)[0]
        room, shares = max(0, budget - self.fixed_sent()), []
        for answer in self.upstream.answers[-self.turns :]:
            files = sum(COUNT((self.upstream.project / name).read_text()) for name in answer["files"])
            shares.append(min(1.0, room / max(1, files)))
        return sum(shares) / max(1, len(shares))


def run_long(
    agent: str, where: Path, window: int, turns: int = 20, flags: tuple[str, ...] = (), recall_at: int | None = None
) -> LongRun:
    """Run ``agent`` through ``turns`` turns of :func:`plan` through the proxy (its ``flags``), each turn a
    resumed session (the first a new one); the model recalls in turn ``recall_at`` (:class:`TurnUpstream`)."""
    home, project = where / "home", where / "project"
    home.mkdir(parents=True)
    project.mkdir()
    session = plan(project, turns)
    upstream = TurnUpstream(window, project, recall_at)
    finished, resume = 0, None
    with serve(upstream) as direct, proxy(direct, *flags, log=where / "proxy.log") as url:
        setup = Setup(window=window)
        command, extra = LONG_AGENTS[agent](project, home, url, False, setup)
        environment = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", **extra}
        environment.update({f"XDG_{k}_HOME": str(home / k.lower()) for k in ("CONFIG", "DATA", "CACHE", "STATE")})
        if agent == "cline":  # it goes on with a session only in its TUI: one, typed into, a turn at a time
            finished = in_terminal([*command, "--tui"], project, environment, upstream, session.prompts, where)
        for t, prompt in enumerate(session.prompts if agent != "cline" else []):
            if agent == "aider":  # no tools: it sends every file asked for so far; its history from its own file
                files = [a for names in session.files[: t + 1] for n in names for a in ("--read", n)]
                arguments = [*files, "--message", prompt, *(["--restore-chat-history"] if t else [])]
            else:  # the first turn a new session, the others go on with it
                go_on = {"opencode": ["--session", resume], "codex": ["resume", resume], "claude": ["--resume", resume],
                         "qwen": ["--continue"]}  # fmt: skip
                arguments = [prompt] if t == 0 else [*go_on[agent], prompt]
            returncode, _ = drive([*command, *arguments], project, environment, upstream, False)
            finished += returncode == 0
            resume = resume or session_id(agent, home)
    last = next(body for path, body in reversed(upstream.log) if turn_request(path, body))
    return LongRun(upstream, turns, finished, json.dumps(last), (where / "proxy.log").read_text())


QUIET = 3.0  # seconds without a request after the model's answer: the TUI's turn is over
PROMPT_LINES = ("What can I do for you?", "Ask anything")  # Cline's TUI where a prompt is typed (first, later)
POP_UP = "any other key to close"  # its pop-up at the start (Cline Desktop, ClinePass)
BUSY = "esc to cancel"  # what it shows while its turn goes on (a prompt typed then would be lost)


def in_terminal(command: list[str], project: Path, environment: dict[str, str], upstream: TurnUpstream,
                prompts: list[str], where: Path) -> int:  # fmt: skip
    """Run an agent's TUI (Cline's) in a pseudo-terminal and type each prompt into it once the previous turn is
    over (the model answered it, then :data:`QUIET` seconds without a request, the TUI no longer :data:`BUSY`:
    under load it may ask again later), the first once its prompt line shows (a pop-up at the start takes the
    first key: Escape). The turns answered within 300 s each."""
    terminal, finished = Terminal(command, project, environment, where / "tmux.sock"), 0
    try:
        ready = time.monotonic() + 120
        while time.monotonic() < ready and not any(line in (screen := terminal.screen()) for line in PROMPT_LINES):
            if POP_UP in screen:  # (one Escape: two open its history of messages)
                terminal.tmux("send-keys", "Escape")
            time.sleep(0.5)
        for prompt in prompts:
            answered, deadline = len(upstream.answers), time.monotonic() + 300
            terminal.type(prompt)
            while time.monotonic() < deadline and not (
                len(upstream.answers) > answered and time.monotonic() - upstream.last_request > QUIET
                and BUSY not in terminal.screen()
            ):  # fmt: skip
                time.sleep(0.2)
            finished += len(upstream.answers) > answered
    finally:
        (where / "agent.out").write_text(terminal.screen())
        terminal.close()
    return finished


def session_id(agent: str, home: Path) -> str | None:
    """The id of the agent's only session in ``home``, to resume it."""
    if agent not in AGENTS:
        return None
    environ = {"HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "CODEX_HOME": str(home / ".codex")}
    with contextlib.suppress(cs.ContextShrinkError):
        found = css.list_sessions([agent], environ)
        return found[0]["id"] if found else None
    return None
