"""Agents generated as parameters (#49): an agent is a shape (how much of the window its system prompt and tools
take, whether its tool descriptions are long, whether it sends context again before the conversation on every
request, identical or updated, few-shot example exchanges, parallel or sequential reads, whether it compacts its
own history with a lossy summary), driven for some turns through the real proxy against a scripted model.
Each turn the user types a message (the first five plant a fact each) and the agent reads two or three files
(the first five plant a fact in one). What is measured is what the model was sent: the text of the turn's files
(their lines, not their headers), the facts in the last request, the summary calls the proxy made."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import httpx2
from fake_openai import FakeOpenAI, serve
from proxy_helpers import started
from state_runs import summary_call

import context_shrink as cs

USER_FACTS = ["OPS-90417", "ENABLE_LEDGER_V2", "lic-03.internal.example:27009", "v2.14.3", "@payments-oncall-eu"]
FILE_FACTS = ["snap-0b7c4e91d2f5", "9f3e2d71c4ab", "10.20.30.40", "4E:91:7C:0B", "E7319"]
WORDS = ("parser", "cache", "budget", "window", "session", "handler", "retry", "schema", "request", "token")
COUNT = cs.resolve_tokenizer("tiktoken").count


@dataclasses.dataclass(frozen=True)
class Shape:
    """An agent, as parameters."""

    window: int = 16_384
    fixed_share: float = 0.3  # of the window: its system prompt and tools
    long_descriptions: bool = True  # its tools' descriptions are paragraphs (else one sentence each)
    resend: str | None = None  # "same": a context block re-sent before the conversation; "updated": the files the
    # user added (this turn's and the last turn's), re-sent before the conversation with every request
    few_shot: int = 0  # example exchanges before the conversation
    parallel: bool = True  # the turn's reads in one assistant message (else one after the other)
    compacts_at: int | None = None  # the turn at which the agent replaces its history with a lossy summary of its own
    compacts_keeping: int = 0  # its newest turns kept after the summary, which is then the first user message and
    # nothing precedes it but the system prompt (Cline's way; 0: a summary and an acknowledgement, nothing kept)
    reminder: bool = False  # the agent's rules appended to the newest user message alone (aider's, Claude Code's)
    wraps: bool = False  # the first prompt sent inside a tagged block of the agent's (a skills list, a date), which
    # it writes anew with each request (Qwen Code's reminders, resumed): the user's words alone stay the same
    files: int = 2  # read per turn
    file_share: float = 0.1  # of the window: each file

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def words(rng: random.Random, tokens: int, prefix: str) -> str:
    """Source-like lines of about ``tokens`` tokens, each unique (``prefix`` and its number)."""
    lines, used = [], 0
    while used < tokens:
        a, b = rng.sample(WORDS, 2)
        line = f"{prefix}.{len(lines)}: def {a}_{b}(value): return self.{b}.get(value, {rng.randint(1, 99)})"
        lines.append(line)
        used += COUNT(line) + 1
    return "\n".join(lines)


def sentences(rng: random.Random, count: int) -> str:
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(count))


def fixed_part(shape: Shape, rng: random.Random) -> tuple[str, list[dict[str, Any]]]:
    """The system prompt and tools of about ``fixed_share`` of the window (the tools about two thirds of it)."""
    target = int(shape.fixed_share * shape.window)
    system = "You are a coding agent.\n" + words(rng, target // 3, "rule")
    tools: list[dict[str, Any]] = []
    read = {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "The file's path."}},
        "required": ["path"]}}}  # fmt: skip
    tools.append(read)
    k = 0
    while COUNT(json.dumps(tools)) < target - COUNT(system):
        text = sentences(rng, 10) if shape.long_descriptions else sentences(rng, 1)
        param = sentences(rng, 4) if shape.long_descriptions else "A value."
        tools.append({"type": "function", "function": {"name": f"tool_{k}", "description": text, "parameters": {
            "type": "object", "properties": {"value": {"type": "string", "description": param},
                                             "mode": {"type": "string", "enum": ["a", "b"]}},
            "required": ["value"]}}})  # fmt: skip
        k += 1
    return system, tools


@dataclasses.dataclass
class Turn:
    files: list[str]  # the texts of the turn's files
    sent: dict[str, Any] | None = None  # the request the model answered, as the upstream got it
    material: int = 0  # tokens of what the agent sends of the turn (its reads; a re-sent block of files whole)
    status: int = 200  # what the agent got


@dataclasses.dataclass
class Run:
    shape: Shape
    turns: list[Turn]
    summary_calls: int
    refused: int
    fixed_after: int  # the fixed part as sent (its tools maybe leaner), in cl100k tokens
    new_history: int  # tokens of history the conversation made (what the agent did not send before)
    upstream: str = ""  # the scripted model's base URL (the proxy's store is named after it)

    def files_sent(self, turns: list[Turn] | None = None) -> float:
        """The share of the turns' file lines the model was sent when it answered."""
        total = present = 0
        for turn in turns or self.turns:
            text = json.dumps(turn.sent, ensure_ascii=False)
            for file in turn.files:
                lines = file.split("\n")
                total += len(lines)
                present += sum(json.dumps(line, ensure_ascii=False)[1:-1] in text for line in lines)
        return present / max(1, total)

    def facts_in_last(self) -> tuple[int, int]:
        """(user facts, all facts) in the last request."""
        text = json.dumps(self.turns[-1].sent, ensure_ascii=False)
        users = sum(f in text for f in USER_FACTS)
        return users, users + sum(f in text for f in FILE_FACTS)

    def fits(self, turn: Turn) -> bool:
        """Whether what the agent sends of the turn fits beside the fixed part as sent, the reply's reserve and a
        ledger."""
        return turn.material + 200 <= self.shape.window - 1024 - self.fixed_after - 512

    @property
    def fitting(self) -> bool:
        """Whether every turn fits (else no proxy can send it whole, nor always avoid a refusal)."""
        return all(self.fits(t) for t in self.turns)


def drive(
    shape: Shape, turns: int, where: Path, seed: int = 7, flags: tuple[str, ...] = (), module: Path | None = None
) -> Run:
    """``turns`` turns of an agent of ``shape`` through a real proxy process (this checkout's, or ``module``) in
    front of a scripted model."""
    rng = random.Random(seed)
    system, tools = fixed_part(shape, rng)
    model = FakeOpenAI(window=shape.window)
    history: list[dict[str, Any]] = []
    finished: list[list[dict[str, Any]]] = []  # the turns since the agent last compacted, each whole
    done: list[Turn] = []
    examples = [m for k in range(shape.few_shot) for m in (
        {"role": "user", "content": f"Example {k}: what does parser_{k} return?"},
        {"role": "assistant", "content": f"It returns the parsed value {k}."})]  # fmt: skip
    context = words(rng, int(0.08 * shape.window), "map") if shape.resend == "same" else None
    new_history, added = 0, []
    skills = words(rng, int(0.1 * shape.window), "skill") if shape.wraps else ""
    window = ("--window", str(shape.window), *flags)
    with serve(model) as upstream, started("proxy", "--upstream", upstream, *window, log=where / "log",
                                           module=module) as base:  # fmt: skip
        url = base + "/v1"
        for t in range(1, turns + 1):
            files = [words(rng, int(shape.file_share * shape.window), f"f{t}.{k}") for k in range(shape.files)]
            if t <= len(FILE_FACTS):
                files[0] = files[0].replace("\n", f"\n# NOTE: remember {FILE_FACTS[t - 1]} for later.\n", 1)
            fact = f" Remember {USER_FACTS[t - 1]}." if t <= len(USER_FACTS) else ""
            turn_messages: list[dict[str, Any]] = [{"role": "user", "content": f"Turn {t}: read the files.{fact}"}]
            opening: list[dict[str, Any]] = list(examples)
            if shape.resend == "updated":  # the added files go in the block the agent sends before the conversation
                block = "\n".join(f"<file name='m{k}.py'>\n{f}\n</file>" for k, f in enumerate([*added, *files]))
                added = files
                opening = [{"role": "user", "content": block}, {"role": "assistant", "content": "Noted."}, *opening]
            else:
                if context is not None:
                    opening = [{"role": "user", "content": context}, {"role": "assistant", "content": "Noted."},
                               *opening]  # fmt: skip
                calls = [{"id": f"c{t}_{k}", "type": "function",
                          "function": {"name": "read", "arguments": json.dumps({"path": f"m{k}.py"})}}
                         for k in range(shape.files)]  # fmt: skip
                results = [{"role": "tool", "tool_call_id": c["id"], "content": f}
                           for c, f in zip(calls, files, strict=True)]  # fmt: skip
                if shape.parallel:
                    turn_messages += [{"role": "assistant", "content": None, "tool_calls": calls}, *results]
                else:
                    for c, r in zip(calls, results, strict=True):
                        turn_messages += [{"role": "assistant", "content": None, "tool_calls": [c]}, r]
            if shape.compacts_at == t:  # the agent's own lossy summary replaces its history
                summary = "Summary of the session so far: files were read and questions answered. Continue."
                kept = [m for turn in finished[len(finished) - shape.compacts_keeping :] for m in turn]
                ack = [] if kept else [{"role": "assistant", "content": "Continuing."}]
                history = [{"role": "user", "content": summary}, *ack, *kept]
                finished = []
            newest = turn_messages
            if shape.reminder:  # sent on this request only: the history holds the prompt as the user typed it
                rules = "\n".join(f"- Rule {k}: answer in the repository's style, rule {k}." for k in range(12))
                newest = [{**turn_messages[0], "content": f"{turn_messages[0]['content']}\n\n{rules}"},
                          *turn_messages[1:]]  # fmt: skip
            messages = [{"role": "system", "content": system}, *opening, *history, *newest]
            if shape.wraps:  # the conversation's first prompt, its block written anew for this request
                first = 1 + len(opening)
                block = f"<system-reminder>\nRequest {t}. Skills:\n{skills}\n</system-reminder>\n"
                messages[first] = {**messages[first], "content": block + messages[first]["content"]}
            body = {"model": "m", "max_tokens": 1024, "tools": tools, "messages": messages}
            before = len(model.requests)
            reply = httpx2.post(url + "/chat/completions", json=body, timeout=120)
            sent = [r["body"] for r in model.requests[before:] if not summary_call(r["body"])]
            material = COUNT(json.dumps(opening[:1] if shape.resend == "updated" else turn_messages[1:]))
            done.append(Turn(files, sent[-1] if sent else None, material, reply.status_code))
            answer = {"role": "assistant", "content": f"Done with turn {t}.\n{words(rng, shape.window // 50, 'a')}"}
            new_history += sum(COUNT(cs.plain_content(m.get("content"))) for m in [*turn_messages, answer])
            history += [*turn_messages, answer]
            finished.append([*turn_messages, answer])
    sent_tools = done[-1].sent.get("tools") or [] if done[-1].sent else []
    sent_system = done[-1].sent["messages"][0]["content"] if done[-1].sent else ""
    calls = sum(summary_call(r["body"]) for r in model.requests)
    fixed = COUNT(json.dumps([t for t in sent_tools if (t.get("function") or {}).get("name") != cs.RECALL_TOOL]))
    refused = len(model.oversized) + sum(t.status != 200 for t in done)
    return Run(shape, done, calls, refused, fixed + COUNT(sent_system), new_history, upstream)
