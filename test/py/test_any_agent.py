"""Any agent, any window (#49): an agent whose system prompt and tools fill most of the window gets its tools'
descriptions cut to their first sentence, by a rule that cannot change what a tool is (names, parameters, types,
enums, required lists), the same bytes every request, the rest one recall away; through the real proxy on each
wire API."""

from __future__ import annotations

import json
import random
import re
import tempfile
import types
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from agent_requests import chat_request, claude_request, codex_request
from agent_upstream import request_view
from fake_openai import serve
from generated_agents import USER_FACTS, Run, Shape, drive
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp_calls import call, ok
from mcp_calls import run as run_mcp
from proxy_helpers import proxy
from recalling import RecallingModel

import context_shrink as cs
import context_shrink_fit as csf
import context_shrink_state as cst
import context_shrink_wire as csw

WORDS = ("file", "path", "read", "write", "the", "agent", "must", "never", "always", "line", "offset", "limit",
         "absolute", "relative", "workspace", "command", "output", "tool", "result", "when", "before")  # fmt: skip


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def long_text(rng: random.Random, sentences: int = 6) -> str:
    text = " ".join(sentence(rng, rng.randint(8, 16)) for _ in range(sentences))
    return text + "\n\nUsage:\n- " + "\n- ".join(sentence(rng, 10) for _ in range(4))


def wide_tool(api: str, k: int, rng: random.Random) -> dict[str, Any]:
    """A tool as an agent with long descriptions writes it, in ``api``'s shape."""
    schema = {"type": "object", "properties": {
        "path": {"type": "string", "description": long_text(rng, 3)},
        "mode": {"type": "string", "enum": ["fast", "full"], "default": "fast", "description": long_text(rng, 2)},
        "description": {"type": "string", "description": "What this call is for."},  # a parameter named so
        "ranges": {"type": "array", "items": {"type": "object", "properties": {
            "start": {"type": "integer", "description": long_text(rng, 2)}}}},
    }, "required": ["path"], "additionalProperties": False}  # fmt: skip
    name, text = f"tool_{k}", long_text(rng)
    if api == "chat":
        return {"type": "function", "function": {"name": name, "description": text, "parameters": schema}}
    if api == "responses":
        return {"type": "function", "name": name, "description": text, "parameters": schema}
    return {"name": name, "description": text, "input_schema": schema}


def without_descriptions(node: Any) -> Any:
    """``node`` with every string under a ``description`` key left out: what a tool *is*."""
    if isinstance(node, list):
        return [without_descriptions(item) for item in node]
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    return node


def descriptions(node: Any, found: list[str] | None = None) -> list[str]:
    found = [] if found is None else found
    if isinstance(node, list):
        for item in node:
            descriptions(item, found)
    elif isinstance(node, dict):
        for k, v in node.items():
            if k == "description" and isinstance(v, str):
                found.append(v)
            elif k not in ("enum", "const", "default", "examples", "example"):
                descriptions(v, found)
    return found


# ------------------------------------------------------------------------------------------ the rule, pure

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=300),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                               st.sampled_from(["description", "type", "name", "x"]), inner, max_size=3),
                           max_leaves=12)  # fmt: skip
SCHEMAS = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"])},
                          optional={"description": st.text(max_size=400), "enum": st.lists(JSON_VALUES, max_size=3),
                                    "default": JSON_VALUES}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        st.sampled_from(["description", "path", "enum", "items", "default"]), inner, max_size=4)},
        optional={"description": st.text(max_size=400), "items": inner, "required": st.lists(st.text(max_size=8))}),
    max_leaves=10)  # fmt: skip


@st.composite
def tool_lists(draw: Any) -> list[Any]:
    tools = []
    for k in range(draw(st.integers(0, 4))):
        api = draw(st.sampled_from(["chat", "responses", "messages", "other"]))
        text, schema = draw(st.text(max_size=600)), draw(SCHEMAS)
        tools.append({"chat": {"type": "function", "function": {"name": f"t{k}", "description": text,
                                                                 "parameters": schema}},
                      "responses": {"type": "function", "name": f"t{k}", "description": text, "parameters": schema},
                      "messages": {"name": f"t{k}", "description": text, "input_schema": schema},
                      "other": draw(JSON_VALUES)}[api])  # fmt: skip
    return tools


@settings(max_examples=300, deadline=None)
@given(tool_lists(), st.booleans())
def test_cutting_descriptions_never_changes_what_a_tool_is(tools: list[Any], recall: bool) -> None:
    before = json.dumps(tools, sort_keys=True)
    short, whole = csf.lean_tools(tools, recall)
    assert json.dumps(tools, sort_keys=True) == before  # the agent's list is not touched
    assert without_descriptions(short) == without_descriptions(tools)  # names, types, enums, required, defaults
    assert csf.lean_tools(tools, recall) == (short, whole)  # the same every request
    for old, new in zip(descriptions(tools), descriptions(short), strict=True):
        if new != old:  # cut to the first sentence, marked, and kept whole for the recall tool
            assert new.startswith(csf.first_sentence(old)) and new.endswith("]") and len(new) < len(old)
            assert any(old in text for text in whole.values())


def test_a_long_description_keeps_its_first_sentence_and_says_where_the_rest_is() -> None:
    tool = wide_tool("messages", 0, random.Random(1))
    short, whole = csf.lean_tools([tool])
    first = tool["description"].split(". ")[0] + "."
    assert short[0]["description"] == f'{first} [… the rest: {cs.RECALL_TOOL} "tool_0"]'
    assert short[0]["input_schema"]["properties"]["description"] == tool["input_schema"]["properties"]["description"]
    assert whole["tool_0"].startswith("The tool tool_0, described in full:\n" + tool["description"])
    assert "Parameter ranges.start: " in whole["tool_0"]
    assert csf.lean_tools([tool], recall=False)[0][0]["description"] == f"{first} […]"


# ------------------------------------------------------------------------------------------ through the proxy

BUILDERS = {"chat": ("/chat/completions", chat_request), "responses": ("/responses", codex_request),
            "messages": ("/messages", claude_request)}  # fmt: skip


def wide_request(api: str, tools: int = 14, turns: int = 2) -> dict[str, Any]:
    """An agent's request whose tools take over half a window of 8,192: ``tools`` wide ones and its shell."""
    body = BUILDERS[api][1](turns, 20)
    rng = random.Random(7)
    return {**body, "tools": [*body["tools"], *(wide_tool(api, k, rng) for k in range(tools))]}


def tool_name(tool: dict[str, Any]) -> str:
    return str(tool.get("name") or (tool.get("function") or {}).get("name"))


@pytest.mark.parametrize("api", list(BUILDERS))
def test_a_fixed_part_over_half_the_window_is_sent_with_short_descriptions(api: str, tmp_path: Path) -> None:
    path = BUILDERS[api][0]
    model = RecallingModel(8192, "tool_3")  # it asks for one tool's whole description
    first, grown = wide_request(api), wide_request(api, turns=6)
    fixed = csf.fixed_tokens(request_view(api, first).messages[:1], first["tools"], cs.HEURISTIC.count)
    assert fixed > csf.LEAN_SHARE * 8192  # the case: the agent's own part takes over half the window
    with serve(model) as upstream, proxy(upstream, "--window", "8192", "--no-archive", log=tmp_path / "log") as url:
        replies = [httpx2.post(url + path, json=body, timeout=60) for body in (first, first, grown)]
        stats = httpx2.get(url.removesuffix("/v1") + "/context-shrink/stats", timeout=30).json()
    assert [r.status_code for r in replies] == [200, 200, 200], replies[0].text
    header = replies[0].headers["x-context-shrink"]
    assert "lean=14 tools described by their first sentence (-" in header and "recalled=1" in header
    assert not model.refused
    tools = [[t for t in body["tools"] if tool_name(t) != cs.RECALL_TOOL] for _, body in model.log]
    assert all(without_descriptions(sent) == without_descriptions(first["tools"]) for sent in tools)  # as defined
    assert len({json.dumps(sent) for sent in tools}) == 1  # the same bytes in every request: the prefix stays cached
    short = json.dumps(tools[0], ensure_ascii=False)
    assert f'[… the rest: {cs.RECALL_TOOL} \\"tool_3\\"]' in short and len(short) < len(json.dumps(first["tools"])) / 2
    assert model.recalled and model.recalled[0].startswith("The tool tool_3, described in full:")
    whole = first["tools"][4] if api != "chat" else first["tools"][4]["function"]
    assert whole["description"] in model.recalled[0]  # tool_3's own words, verbatim
    assert all(r.get("lean", "").startswith("14 tools") for r in stats["recent"])  # on the live page's data
    assert "lean=14 tools" in (tmp_path / "log").read_text()  # and in the log


@pytest.mark.parametrize("api", list(BUILDERS))
def test_a_small_fixed_part_or_the_flag_off_sends_the_tools_as_they_came(api: str, tmp_path: Path) -> None:
    path = BUILDERS[api][0]
    small, wide = wide_request(api, tools=2), wide_request(api)
    for body, flags in ((small, ()), (wide, ("--lean-tools", "off"))):
        model = RecallingModel(8192, "tool_1")
        with serve(model) as upstream, proxy(upstream, "--window", "8192", "--no-archive", *flags,
                                             log=tmp_path / "log") as url:  # fmt: skip
            reply = httpx2.post(url + path, json=body, timeout=60)
        assert reply.status_code == 200 and "lean=" not in reply.headers.get("x-context-shrink", "")
        assert model.log[0][1]["tools"] == body["tools"]  # as the agent sent them


def with_system_text(api: str, body: dict[str, Any], text: str) -> dict[str, Any]:
    if api == "chat":
        return {**body, "messages": [{"role": "system", "content": text}, *body["messages"][1:]]}
    if api == "responses":
        return {**body, "instructions": text}
    return {**body, "system": [{"type": "text", "text": text}]}


def system_text(api: str, body: dict[str, Any]) -> str:
    if api == "chat":
        return body["messages"][0]["content"]
    return body["instructions"] if api == "responses" else body["system"][0]["text"]


@pytest.mark.parametrize("api", list(BUILDERS))
def test_a_system_prompt_of_repeated_boilerplate_keeps_every_line_it_sends_verbatim(api: str, tmp_path: Path) -> None:
    rng = random.Random(3)
    rules = [f"- {sentence(rng, 12)}" for _ in range(12)]
    prompt = "\n".join(["You are a coding agent.", *rules, "## Again, the rules", *rules, "## And once more", *rules])
    body = with_system_text(api, wide_request(api), prompt)
    model = RecallingModel(8192, "tool_1", times=0)
    with serve(model) as upstream, proxy(upstream, "--window", "8192", "--no-archive", log=tmp_path / "log") as url:
        replies = [httpx2.post(url + BUILDERS[api][0], json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200]
    sent = [system_text(api, b) for _, b in model.log]
    assert sent[0] == sent[1] and len(sent[0]) < len(prompt) * 0.5  # the same bytes every request
    original = prompt.split("\n")
    kept = [line for line in sent[0].split("\n") if not (line.startswith("[… ") and line.endswith(" cut …]"))]
    assert all(line in original for line in kept) and set(kept) == set(original)  # verbatim, every line once
    assert "the system prompt 24 lines shorter (-" in replies[0].headers["x-context-shrink"]


PROSE = st.text(st.sampled_from("abcdefgh .,!?:-#`~<>/\t"), max_size=200)


def paragraph(kind: str, rng: random.Random) -> str:
    if kind == "heading":
        return f"{'#' * rng.randint(1, 4)} {sentence(rng, 3)}\n{long_text(rng, 3)}"
    if kind == "tag":
        return f"<rules>\n{long_text(rng, 2)}\n</rules>"
    if kind == "bullets":
        return "\n".join(f"- {sentence(rng, 14)} {sentence(rng, 9)}" for _ in range(4))
    if kind == "fence":
        return f"Run it so:\n```sh\n{long_text(rng, 3)}\n```"
    return long_text(rng, rng.randint(1, 6))


@st.composite
def system_prompts(draw: Any) -> str:
    """Prompts of paragraphs: headings, tag lines, bullets, prose of several sentences, code fences, any text."""
    paragraphs = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["heading", "tag", "bullets", "prose", "fence", "any"]))
        rng = random.Random(draw(st.integers(0, 10**6)))
        paragraphs.append(draw(PROSE) if kind == "any" else paragraph(kind, rng))
    prompt = draw(st.sampled_from(["\n\n", "\n \n", "\n\n\n"])).join(paragraphs)
    return prompt.replace("\n", draw(st.sampled_from(["\n", "\r\n", "\r"])))  # Windows' and CR-only line ends too


def prompt_lines(text: str) -> list[str]:
    return re.split(r"\r\n|\r|\n", text)


@settings(max_examples=200, deadline=None)
@given(system_prompts(), st.booleans())
def test_an_outline_keeps_every_heading_and_each_paragraphs_start_as_written(prompt: str, recall: bool) -> None:
    """Each line of an outline is a line of the prompt, or a line's start to a sentence's end and ``[…]``, or
    ``[…]`` alone, and the note that says so; headings, tag lines and code fences are kept whole; the first line
    of every paragraph begins as it did; the same prompt gives the same bytes."""
    short = csf.outlined(prompt, recall)
    if short is None:
        return
    assert short == csf.outlined(prompt, recall) and len(short) < len(prompt) + len(csf.OUTLINE_NOTE) + 80
    body, note = short.rsplit("\n\n", 1)
    assert note.startswith(csf.OUTLINE_NOTE.format("")[:-1]) and (cs.RECALL_TOOL in note) == recall
    lines = prompt_lines(prompt)
    for line in prompt_lines(body):
        start = line.removesuffix(" […]")
        assert line in lines or line == "[…]" or (line.endswith(" […]") and any(
            whole.startswith(start) and whole != start for whole in lines)), line  # fmt: skip
    kept = [line for line in lines if re.match(r"[ \t]*(#{1,6}\s|</?[A-Za-z][\w-]*>\s*$)", line)]
    assert all(line in prompt_lines(body) for line in kept)
    for paragraph in re.split(r"(?:\r\n|\r(?!\n)|\n)[ \t]*(?:\r\n|\r(?!\n)|\n)", prompt):
        if "```" in paragraph or "~~~" in paragraph:
            assert paragraph in body
        opening = [line for line in prompt_lines(paragraph) if line.strip() and line not in kept]
        assert not opening or opening[0][:20] in body  # each paragraph begins as it did


def test_a_short_or_fenced_prompt_is_not_outlined() -> None:
    assert csf.outlined("You are an agent. Be brief.") is None
    rng = random.Random(5)
    assert csf.outlined(f"Run it so:\n```sh\n{long_text(rng, 6)}\n```") is None


@pytest.mark.parametrize("eol", ["\n", "\r"])
@pytest.mark.parametrize("api", list(BUILDERS))
def test_a_fixed_part_still_over_half_the_budget_sends_the_system_prompt_outlined(
    api: str, eol: str, tmp_path: Path
) -> None:
    """After the tools' cut, instructions alone over half the budget (Codex CLI's at 8k) go as their outline: the
    same bytes every request, said in the header; the model's recall finds what a paragraph left out. A prompt
    with CR-only line ends (#58) is outlined by its paragraphs too (it was cut to its first sentence)."""
    rng = random.Random(11)
    paragraphs = [f"## Rule {k}\n{long_text(rng, 5)}" for k in range(30)]
    paragraphs[17] += "\nAlways run the zebra-lint check before you commit."
    prompt = ("You are a coding agent.\n\n" + "\n\n".join(paragraphs)).replace("\n", eol)
    body = with_system_text(api, wide_request(api, tools=2), prompt)
    model = RecallingModel(8192, "zebra-lint")
    with serve(model) as upstream, proxy(upstream, "--window", "8192", "--no-archive", log=tmp_path / "log") as url:
        replies = [httpx2.post(url + BUILDERS[api][0], json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200]
    sent = [system_text(api, b) for _, b in model.log]
    assert len(set(sent)) == 1 and sent[0] == csf.outlined(prompt)  # the same bytes every request
    assert "zebra-lint" not in sent[0] and all(f"## Rule {k}" in sent[0] for k in range(30))
    assert len(sent[0]) < len(prompt) / 3
    header = replies[0].headers["x-context-shrink"]
    assert "the system prompt outlined (-" in header and "recalled=1" in header
    assert model.recalled and "Always run the zebra-lint check before you commit." in model.recalled[0]


@pytest.mark.parametrize("api", list(BUILDERS))
def test_a_prompt_without_line_breaks_is_recalled_by_its_sentences(api: str, tmp_path: Path) -> None:
    """A system prompt of one line (no line break at all) is outlined to its first sentence; the recall of what it
    left out returned only ``[… cut: the recall's limit]`` (the one line was over the limit). A long line is
    searched and returned by its sentences (#58)."""
    rng = random.Random(12)
    sentences = [sentence(rng, rng.randint(8, 16)) for _ in range(400)]
    sentences[260] = "Always run the zebra-lint check before you commit."
    prompt = "You are a coding agent. " + " ".join(sentences)
    body = with_system_text(api, wide_request(api, tools=2), prompt)
    model = RecallingModel(8192, "zebra-lint")
    with serve(model) as upstream, proxy(upstream, "--window", "8192", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + BUILDERS[api][0], json=body, timeout=60)
    assert reply.status_code == 200 and "the system prompt outlined (-" in reply.headers["x-context-shrink"]
    assert "zebra-lint" not in system_text(api, model.log[0][1])
    assert model.recalled and "Always run the zebra-lint check before you commit." in model.recalled[0]


# ------------------------------------------------------------------------------------------ the agent's opening


def opening_agent(turn: int, pairs: int, updated: bool) -> list[dict[str, Any]]:
    """An agent that sends ``pairs`` leading user/assistant exchanges before the conversation (few-shot examples,
    or files it re-sends, ``updated`` each turn), then its task and ``turn`` turns."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for k in range(pairs):
        text = f"Example {k}: rename x to y." if not updated else f"<files turn={turn}>\nsrc/m{k}.py v{turn}\n</files>"
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": f"ok {k}"}]
    history.append({"role": "user", "content": "The task: fix the parser."})
    for t in range(turn):
        history += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"Turn {t + 1}."}]
    return history


def opening_of(history: list[dict[str, Any]], tasks: dict[str, Any]) -> tuple[int, int]:
    return tuple(csf.agent_opening(history, tasks))[:2]  # type: ignore[return-value]  # (standing, before)


@pytest.mark.parametrize("pairs", [0, 1, 3])
def test_context_the_agent_sends_again_changed_is_its_opening_from_the_second_request(pairs: int) -> None:
    tasks: dict[str, Any] = {}
    got = [opening_of(opening_agent(t, pairs, updated=True), tasks) for t in range(6)]
    assert got == [(0, 2 * pairs)] + [(2 * pairs, 2 * pairs)] * 5  # first seen: history; changed: the agent's own


@pytest.mark.parametrize("pairs", [0, 1, 3])
def test_examples_that_open_every_conversation_are_never_the_users_words(pairs: int) -> None:
    tasks: dict[str, Any] = {}
    first = [opening_of(opening_agent(t, pairs, updated=False), tasks) for t in range(4)]
    assert first == [(0, 2 * pairs)] * 4  # one conversation: before its task, history, but not the user's
    another = [dict(m) for m in opening_agent(0, pairs, updated=False)]
    another[-1]["content"] = "The task: fix the lexer."
    assert opening_of(another, tasks) == (2 * pairs, 2 * pairs)  # the same run opens another: the agent's own


def test_a_history_first_seen_mid_way_is_history() -> None:
    tasks: dict[str, Any] = {}
    chat = [{"role": "system", "content": "s"}] + [{"role": "user" if k % 2 == 0 else "assistant", "content": f"m{k}"}
                                                   for k in range(9)]  # fmt: skip
    assert opening_of(chat, tasks) == (0, 8) and opening_of(
        [*chat, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}], tasks
    ) == (0, 8)
    midway = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "r", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c", "content": "x"}, {"role": "user", "content": "next"}]  # fmt: skip
    other: dict[str, Any] = {}
    assert opening_of(midway, other) == (0, 0) and other == {}


def test_the_ledger_never_quotes_an_example_as_the_user() -> None:
    examples = [m for k in range(3) for m in ({"role": "user", "content": f"Example {k}: rename x{k} to y{k}."},
                                              {"role": "assistant", "content": f"Renamed {k}."})]  # fmt: skip
    turns = [m for t in range(12) for m in ({"role": "user", "content": f"Turn {t}: keep E{7300 + t}."},
                                            {"role": "assistant", "content": "done " * 300})]  # fmt: skip
    history = [{"role": "system", "content": "s"}, *examples, *turns, {"role": "user", "content": "next"}]
    opening = cs.Opening(0, len(examples))
    result = anyio.run(lambda: cs.shrink(history, [], cs.HEURISTIC, 3000, cs.Policy(), None, None, opening))
    ledger = next(m["content"] for m in result["messages"] if m["content"].startswith(cs.LEDGER_MARKER))
    assert "Turn 0:" in ledger and "Example 0" not in ledger


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(200, 3000), st.integers(1000, 6000))
def test_an_opening_alone_over_its_room_is_elided_evenly(messages: int, size: int, room: int) -> None:
    run = [{"role": "user" if k % 2 == 0 else "assistant", "content": "line of text\n" * (size // 3 + k)}
           for k in range(messages)]  # fmt: skip
    count = lambda m: cs.count_messages([m], cs.HEURISTIC)[0][0]  # noqa: E731
    out = cs.evenly_elided(run, room, count)
    assert [m["role"] for m in out] == [m["role"] for m in run]
    if sum(map(count, run)) <= room:
        assert out == run
    else:
        assert sum(map(count, out)) <= room + 16 * messages and all("elided" in m["content"] for m in out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=4, max_size=60), st.integers(50, 1500), st.randoms(use_true_random=False))
def test_a_grown_opening_keeps_the_lines_this_turn_added_and_elides_the_older_first(
    old: list[bool], room: int, rng: Any
) -> None:
    """#59 2a, 2b: a block the agent re-sends grown (aider's files): when it is over its room, the lines sent before
    this turn (``seen``) are elided first, and every line the turn added is kept whenever those alone fit; each
    elided stretch says so and names the values it held."""
    lines = [f"{'old' if o else 'new'} line {k}: value E{rng.randint(1000, 9999)} in src/m{k}.py" for k, o in
             enumerate(old)]  # fmt: skip
    block = {"role": "user", "content": "\n".join(lines)}
    seen = frozenset(cs.line_print(line) for line, o in zip(lines, old, strict=True) if o)
    count = lambda m: cs.count_messages([m], cs.HEURISTIC)[0][0]  # noqa: E731
    out = cs.evenly_elided([block], room, count, seen)[0]
    new_only = "\n".join(line for line, o in zip(lines, old, strict=True) if not o)
    if count(block) <= room:
        assert out == block
    elif count({"role": "user", "content": new_only}) + 20 * (1 + sum(old)) <= room:  # the new lines and markers fit
        kept = out["content"].split("\n")
        assert all(line in kept for line, o in zip(lines, old, strict=True) if not o), out["content"]
        assert count(out) <= room and "sent before, elided" in out["content"]


@settings(max_examples=30, deadline=None)
@given(st.integers(200, 4000), st.lists(st.integers(0, 10**6), min_size=1, max_size=5, unique=True), st.integers(0, 99))
def test_a_files_values_elided_from_a_resent_block_are_named_however_long_the_stretch(
    lines: int, planted: list[int], at: int
) -> None:
    """#59 2c: a file inside a user message is mined for values like a tool result: the rare values of the lines
    elided from a block re-sent grown (aider's files) are named in the stretch's marker wherever they stood (not
    only in the head and tail a long text's scan looks at), the rarest shapes first, in a note of at most one
    character per 50 it replaced (at least a cleared result's)."""
    rng = random.Random(at)
    text = [f"def parse_{k % 97}(limit={rng.randint(1, 99)}): see tests/test_m{k % 89}.py::test_{k % 7}"
            for k in range(lines)]  # fmt: skip
    values = [f"snap-{v:06x}f{v % 7}c" for v in planted]
    for k, value in enumerate(values):
        text.insert(at * len(text) // 100 + k, f"# NOTE: restore from {value} when in doubt.")
    block = {"role": "user", "content": "\n".join([*text, "the new line of this turn"])}
    seen = frozenset(cs.line_print(line) for line in text)
    count = lambda m: cs.count_messages([m], cs.HEURISTIC)[0][0]  # noqa: E731
    out = cs.evenly_elided([block], count(block) // 20, count, seen)[0]["content"]
    markers = re.findall(r"\[… (\d+) lines sent before, elided(.*?) …\]", out)
    assert markers and "the new line of this turn" in out
    assert all(value in out for value in values), out[-2000:]
    notes = sum(len(note) - len("; it held: ") for _, note in markers)
    assert notes <= len(markers) * cs.VALUE_CHARS + len(block["content"]) // cs.NOTED_SHARE, markers


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 600), st.integers(5, 3000), st.booleans())
def test_an_old_user_message_keeps_the_users_words_whole_and_the_agents_blocks_shortened(
    blocks: int, lines: int, said: int, parts: bool
) -> None:
    """#59 2c: the least form of an old user message the agent wrapped in blocks of its own (Qwen Code's skills
    list and date before the prompt) keeps what the user typed whole while it is short (:data:`WORDS_KEPT`), each
    long block at its head and tail, its tags kept (so the words are still found); a message of the user's words
    alone, or of long ones, keeps its head and tail as before."""
    words = ("Turn 1: Remember: the deploy key is in vault path secret/deploy/prod-7741. " * 60)[:said].strip()
    texts = [f"<system-reminder>\nBlock {k}.\n" + "skill: does a thing\n" * lines + "</system-reminder>"
             for k in range(blocks)]  # fmt: skip
    content: Any = [{"type": "text", "text": t} for t in [*texts, words]] if parts else "\n".join([*texts, words])
    message = {"role": "user", "content": content}
    least = cs.least_form(message, "")
    text = cs.plain_content(content)
    if blocks and len(words) <= cs.WORDS_KEPT:
        assert least is None or (words in least[0]["content"] and cs.user_words(least[0]) == words), least
        assert least is not None or all(len(t) + 1 <= 2 * sum(cs.LEAST_TEXT) for t in texts)  # none long
    elif len(text) > 2 * sum(cs.LEAST_TEXT):
        assert least is not None and len(least[0]["content"]) < 400 and "tokens elided" in least[0]["content"]


def test_a_task_is_known_again_when_the_agent_writes_its_blocks_around_it_anew() -> None:
    """#59 2d: a conversation whose first prompt the agent sends inside blocks of its own it writes anew (Qwen
    Code resumed: another reminder, its content as parts) is the same conversation, by the user's words in it; a
    prompt too short to know a conversation by ("hi") is not taken for another's."""
    system = {"role": "system", "content": "You are an agent."}
    words = "Turn 1: read the notes and remember OPS-90417 for later."
    first = {"role": "user", "content": f"<system-reminder>\nToday is Monday.\n</system-reminder>\n{words}"}
    tasks: dict[Any, Any] = {}
    csf.agent_opening([system, first], tasks, "me")
    skills = "<system-reminder>\nSkills: a, b.\n</system-reminder>"
    again = {"role": "user", "content": [{"type": "text", "text": skills}, {"type": "text", "text": words}]}
    assert csf.task_found(tasks, "me", again) is not None
    assert csf.memory_task(tasks, "me", again) == csf.memory_task(tasks, "me", first)
    assert csf.task_found(tasks, "other", again) is None  # never across who asks
    hi = {"role": "user", "content": "<system-reminder>\nToday is Monday.\n</system-reminder>\nhi"}
    csf.agent_opening([system, hi], tasks, "me")
    hello = {"role": "user", "content": "<system-reminder>\nToday is Tuesday.\n</system-reminder>\nhi"}
    assert csf.task_found(tasks, "me", hello) is None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 900), st.integers(2, 14), st.integers(100, 900))
def test_the_carried_ledgers_room_is_left_beside_a_history_without_an_opening(
    carried: int, turns: int, size: int
) -> None:
    """#59 2e: the room of the ledger of what the agent dropped (Cline's own compaction: no opening) is left beside
    the history, as beside an opening: a request that must be shrunk is shrunk to the budget less that room, so
    the ledger the proxy adds after it fits (at 8k the user's fifth fact was cut from it): here a turn in progress
    over the budget alone is reduced to that."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for t in range(turns):
        call = {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "f{t}"}}'}}
        messages += [{"role": "user", "content": f"Turn {t}: read f{t}."},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{t}",
                      "content": "".join(f"line {k} of file {t}: {k * 31 % 101}\n" for k in range(size))},
                     {"role": "assistant", "content": "done"}]  # fmt: skip
    call = {"id": "now", "type": "function", "function": {"name": "read", "arguments": '{"path": "big"}'}}
    big = {
        "role": "tool",
        "tool_call_id": "now",
        "content": "".join(f"big line {k}: {k * 7919 % 10007} of {k**2 % 997}\n" for k in range(2000)),
    }
    messages += [{"role": "user", "content": "Now read big."}, {"role": "assistant", "content": None,
                 "tool_calls": [call]}, big]  # fmt: skip
    opening = cs.Opening(carried=carried)
    result = anyio.run(lambda: cs.shrink(messages, [], cs.HEURISTIC, 4000, cs.Policy(), None, None, opening))
    if result["action"] != "none" and result["fits"]:
        assert result["tokens_after"] <= 4000 - carried, (result["action"], result["tokens_after"])


# ------------------------------------------------------------------------------------------ agents as parameters

NAMED_SHAPES = {  # the agents of #49's report, at 16k, and two at 8k
    "fixed part 80 %, long tool descriptions": Shape(fixed_share=0.8),
    "context re-sent before the conversation, updated": Shape(resend="updated"),
    "context re-sent before the conversation, the same": Shape(resend="same"),
    "few-shot example exchanges": Shape(few_shot=3),
    "compacts its own history at turn 15": Shape(compacts_at=15),
    "compacts into its first message at turn 15, keeping its newest turns": Shape(compacts_at=15, compacts_keeping=2),
    "files re-sent in a user message, rules on the newest prompt, no tools": Shape(resend="updated", reminder=True),
    "its first prompt inside a block it writes anew each request": Shape(wraps=True),
    "all of them, reads one after the other": Shape(
        fixed_share=0.7, resend="same", few_shot=2, compacts_at=15, parallel=False
    ),
    "8k window, fixed part 85 %": Shape(window=8192, fixed_share=0.85),
    "8k window, updated context, few-shot, compacts": Shape(
        window=8192, fixed_share=0.5, resend="updated", few_shot=2, compacts_at=12
    ),
}


def check_run(run: Run) -> None:
    """What every agent shape must get (#49's Done-when): the turn's files sent whenever they fit beside the fixed
    part as sent (with the reply's reserve and a ledger), summary calls within one per 0.3 of the window of new
    history; and where every turn fits, no refusal and the user's five facts and eight of ten in the last request.
    (A shape whose fixed part cannot be made leaner and whose turn does not fit beside it can be served by no
    proxy: what is asked of it is the bound on summary calls.)"""
    said = run.shape.describe()
    fitting = [t for t in run.turns if run.fits(t)]
    assert not fitting or run.files_sent(fitting) >= 0.9, (run.files_sent(fitting), said)
    assert run.summary_calls <= 1 + run.new_history / (cs.SUMMARY_GROWTH * run.shape.window), (run.summary_calls, said)
    if run.fitting:
        users, facts = run.facts_in_last()
        assert run.refused == 0 and users == 5 and facts >= 8, (run.refused, users, facts, said)


@pytest.mark.parametrize("name", list(NAMED_SHAPES))
def test_an_agent_of_each_reported_shape_keeps_its_turns_files_and_the_users_facts(name: str, tmp_path: Path) -> None:
    run = drive(NAMED_SHAPES[name], 20, tmp_path)
    check_run(run)
    assert run.fitting and run.files_sent() >= 0.9, (run.files_sent(), name)  # each fits, its fixed part leaner


def test_what_the_user_typed_is_archived_when_first_seen_and_recalled_after_the_agent_compacts(
    tmp_path: Path,
) -> None:
    """The user's words are kept in the archive the request they first appear in, not only when folded: an agent
    that compacts its own history before the proxy ever folds anything leaves them recallable through the MCP
    tool (each kept once); the ledger carries them, and the proxy's recall tool answers from what it carries."""
    state = f"sqlite:{tmp_path / 'state.sqlite3'}"
    shape = Shape(window=32_768, fixed_share=0.1, compacts_at=6, file_share=0.02)
    run = drive(shape, 7, tmp_path, flags=("--state", state))
    actions = re.findall(r"action=([^;]+);", (tmp_path / "log").read_text())
    assert set(actions) == {"none", "ledger"} and actions[-1] == "ledger"  # nothing folded; the ledger carries them
    assert run.facts_in_last()[0] == 5
    store = cst.SqliteStore(tmp_path / "state.sqlite3", cs.upstream_namespace(run.upstream))
    searched, found = store.search("Remember", None, 20)
    store.close()
    assert searched == 7 and len(found) == 5 and {e["action"] for e in found} == {cst.TYPED}  # each turn's, once
    server = cs.build_server(cs.Config.from_env({"CONTEXT_SHRINK_STATE": state,
                                                 "CONTEXT_SHRINK_BASE_URL": run.upstream}))  # fmt: skip
    for fact in USER_FACTS:
        recalled = ok(run_mcp(call(server, "recall_context", {"query": f'"{fact}"'})))
        assert fact in recalled["entries"][0]["message"]["content"], (fact, recalled)


def test_the_users_messages_first_seen_are_named_once_and_carried_after_the_agents_compaction() -> None:
    tasks: dict[Any, Any] = {}
    state = types.SimpleNamespace(said={}, tasks=tasks)

    def remembered(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
        request = csf.ChatRequest.read({"messages": messages})
        return csf.remembered(state, request, csf.agent_opening(messages, tasks))  # type: ignore[arg-type]

    said = [{"role": "system", "content": "S"}, {"role": "user", "content": "Turn 1: remember OPS-90417."}]
    assert remembered(said) == ([], [1])
    said += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Turn 2: go on."}]
    assert remembered(said) == ([], [3])  # only the message first seen
    assert remembered(said) == ([], [])
    said += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Turn 3: more."}]
    assert remembered(said) == ([], [5])
    rewritten = [said[0], {"role": "user", "content": "Summary: work went on."}, {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": "Turn 4: and now?"}]  # fmt: skip
    carried, typed = remembered(rewritten)  # the agent's own summary in place of its turns
    assert [m["content"] for m in carried] == [m["content"] for m in said[1::2]] and typed == [3]
    assert "OPS-90417" in csw.recall_lines(carried, "OPS-90417", 400, cs.resolve_tokenizer("tiktoken").count)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), st.integers(1, 3), st.booleans(), st.booleans())
def test_a_conversation_is_known_again_by_the_turns_its_agent_kept_after_its_own_summary(
    turns: int, keeping: int, reminder: bool, calls: bool
) -> None:
    """#59 2d, 2e: an agent that puts its own summary in place of its history as the first user message, nothing
    before it but the system prompt (no opening run changed: Cline), and keeps its newest turns: the conversation
    goes on with its memory, and the user's words the summary dropped are carried; a new conversation that shares
    no message with it is not taken for it."""
    tasks: dict[Any, Any] = {}
    state = types.SimpleNamespace(said={}, tasks=tasks)

    def remembered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        request = csf.ChatRequest.read({"messages": messages})
        return csf.remembered(state, request, csf.agent_opening(messages, tasks))[0]  # type: ignore[arg-type]

    system, done, said = {"role": "system", "content": "S"}, [], []
    for t in range(turns):
        said.append(f"Turn {t}: keep OPS-{9000 + t} in mind.")
        turn = [{"role": "user", "content": said[-1]}]
        if calls:
            call = {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": f'{{"p": {t}}}'}}
            turn += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{t}", "content": f"file {t} " * 20}]  # fmt: skip
        turn.append({"role": "assistant", "content": f"Done with turn {t}: the file was read and is fine."})
        done.append(turn)
        assert remembered([system, *(m for d in done for m in d)]) == []
    kept = [m for d in done[-keeping:] for m in d]
    newest = {"role": "user", "content": "Turn next: go on." + (" <reminder>rules</reminder>" if reminder else "")}
    summary = {"role": "user", "content": "Summary: the session read files; nothing else to note."}
    carried = [m["content"] for m in remembered([system, summary, *kept, newest]) if m["role"] == "user"]
    gone = said[: max(0, turns - keeping)]
    assert set(gone) <= set(carried) and not set(said[len(gone) :]) & set(carried), (gone, carried)
    other = [system, *({"role": "user", "content": f"A new task, step {k}: list the files of folder {k}."}
                       if k % 2 == 0 else {"role": "assistant", "content": f"Here are the files of folder {k - 1}."}
                       for k in range(4 * turns + 12)), {"role": "user", "content": "And their sizes?"}]  # fmt: skip
    assert remembered(other) == []  # history within minutes, but it shares no message (and is not shorter)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(3, 8),
    st.integers(0, 3),
    st.integers(1, 3),
    st.sampled_from(["\n\n", "\r\n\r\n", "\n \n"]),
    st.sampled_from(["", "  \n", "\n"]),
)
def test_a_conversation_is_known_again_when_its_agent_appends_a_reminder_to_the_newest_prompt(
    turns: int, examples: int, paragraphs: int, gap: str, restored: str
) -> None:
    """#59 2d: an agent that appends its rules to the newest user message alone (aider) sends the task without
    them in every later request (aider: with two spaces and a line end); the task is still found there, what
    precedes it is the opening, and the conversation has one memory from its first request on (after the agent's
    own summary, every fact is carried)."""
    tasks: dict[Any, Any] = {}
    state = types.SimpleNamespace(said={}, tasks=tasks)
    system = {"role": "system", "content": "S"}
    shots = [m for k in range(examples) for m in ({"role": "user", "content": f"Example {k}: rename a{k}."},
                                                 {"role": "assistant", "content": f"Renamed a{k}."})]  # fmt: skip
    rules = gap.join(f"Rule {k}: keep the style of the repository." for k in range(4))
    history: list[dict[str, Any]] = []
    for t in range(turns):
        prompt = gap.join(f"Turn {t}, part {p}: keep OPS-{9000 + t} in mind." for p in range(paragraphs))
        messages = [system, *shots, *history, {"role": "user", "content": f"{prompt}{gap}{rules}"}]
        opening = csf.agent_opening(messages, tasks)
        assert opening.before == len(shots), t
        csf.remembered(state, csf.ChatRequest.read({"messages": messages}), opening)  # type: ignore[arg-type]
        history += [{"role": "user", "content": prompt + restored}, {"role": "assistant", "content": f"Done {t}."}]
    summary = [{"role": "user", "content": "Summary: files were read."}, {"role": "assistant", "content": "Going on."}]
    rewritten = [system, *shots, *summary, {"role": "user", "content": f"Turn next.{gap}{rules}"}]  # fewer messages
    request = csf.ChatRequest.read({"messages": rewritten})
    carried = csf.remembered(state, request, csf.agent_opening(rewritten, tasks))[0]  # type: ignore[arg-type]
    assert all(any(f"OPS-{9000 + t}" in m["content"] for m in carried) for t in range(turns)), carried  # one memory
    assert not any("Rule 0" in m["content"] for m in carried)  # the agent's reminder is not what the user said


def test_the_proxys_recall_tool_answers_from_what_the_ledger_carries(tmp_path: Path) -> None:
    """After an agent's own compaction the proxy's recall tool finds the user's words the agent no longer sends
    (nothing was folded: the ledger's source is what it answers from)."""
    model = RecallingModel(16_384, "OPS-90417")
    tools = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    said = [{"role": "system", "content": "S"}, {"role": "user", "content": "Turn 1: remember ticket OPS-90417."}]
    more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Turn 2: more."}]
    bodies = [said, [*said, *more], [*said, *more, {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "Turn 3: on."}]]  # fmt: skip
    summary = [{"role": "user", "content": "Summary: work went on."}, {"role": "assistant", "content": "ok"}]
    bodies.append([said[0], *summary, {"role": "user", "content": "Turn 4: the ticket?"}])
    with serve(model) as upstream, proxy(upstream, "--window", "16384", "--no-archive", log=tmp_path / "log") as url:
        replies = [httpx2.post(url + "/chat/completions", json={"model": "m", "tools": tools, "messages": m},
                               timeout=60) for m in bodies]  # fmt: skip
    assert [r.status_code for r in replies] == [200] * 4
    header = replies[3].headers["x-context-shrink"]
    assert "recalled=1" in header and "action=ledger" in header
    assert model.recalled and "Turn 1: remember ticket OPS-90417." in model.recalled[0]


SHAPES = st.builds(
    Shape,
    window=st.sampled_from([8192, 16_384]),
    fixed_share=st.sampled_from([0.1, 0.3, 0.5, 0.7, 0.9]),
    long_descriptions=st.booleans(),
    resend=st.sampled_from([None, "same", "updated"]),
    few_shot=st.integers(0, 3),
    parallel=st.booleans(),
    compacts_at=st.sampled_from([None, 8, 15]),
    compacts_keeping=st.integers(0, 2),
    reminder=st.booleans(),
    files=st.integers(2, 3),
)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)
@given(SHAPES)
def test_any_generated_agent_shape_keeps_its_turns_files_and_the_users_facts(shape: Shape) -> None:
    with tempfile.TemporaryDirectory() as where:
        check_run(drive(shape, 20, Path(where)))
