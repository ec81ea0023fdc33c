"""Agents that remember (#27), the pure parts: values kept by cleared results and by the fact ledger (the user's
own words first), the turn in progress protected, the agent's standing context kept, few summary calls, the copy
guard judging only the new span, every kind of tool counted, and the recall tool's search. The same rules through
the proxy and the real agents are in test_recall.py and test_long_sessions.py."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

import anyio
import pytest
from builders import assistant, tool, user
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import context_shrink as cs
import context_shrink_fit as csf
import context_shrink_wire as csw

pytestmark = pytest.mark.core
TOK = cs.HEURISTIC
COUNT = TOK.count

# Values of the kinds an agent must act on again, each inside the noise of a source file (as in #27's sessions).
VALUES = ["9f3e2d71c4ab", "E7319", "snap-0b7c4e91d2f5", "lic-03.internal.example:27009", "3c:22:fb:9a:41:0e",
          "OPS-90417", "ENABLE_LEDGER_V2", "@payments-oncall-eu", "10.20.30.40", "v2.14.3", "ba:be:fa:ce"]  # fmt: skip


def noisy_file(seed: int, fact: str | None = None, lines: int = 120) -> str:
    """Source-like text: function names, exceptions, paths and small numbers, with one fact line."""
    rng = random.Random(seed)
    words = ("parser", "cache", "budget", "window", "session", "handler", "retry", "schema")
    out = []
    for k in range(lines):
        a, b = rng.sample(words, 2)
        out.append(rng.choice([f"def {a}_{b}(request, limit={rng.randint(8, 99)}):",
                               f"    raise {a.title()}{b.title()}Error('src/{a}/{b}.py line {rng.randint(1, 900)}')",
                               f"    return self.{a}.{b}(timeout={rng.randint(1, 90)})"]))  # fmt: skip
        if fact and k == lines // 3:
            out.append(f"# NOTE: remember {fact} for later.")
    return "\n".join(out)


@pytest.mark.parametrize("value", VALUES)
def test_a_value_in_a_file_is_found_whole(value: str) -> None:
    assert value in cs.text_values(noisy_file(len(value), value))


def test_names_merely_seen_in_code_are_not_values() -> None:
    found = cs.text_values(noisy_file(3))
    assert not [v for v in found if re.fullmatch(r"[a-z_]+|[A-Z][a-zA-Z]+Error", v)], found


# Values of shapes generated from their parts (#49 item 5: by construction, not by a list of formats), and names.
HEX, B62 = "0123456789abcdef", string.ascii_letters + string.digits
NAME_WORDS = ("parser", "cache", "budget", "window", "session", "handler", "retry", "schema", "request", "token",
              "config", "manager", "factory", "stream", "response", "identifier", "international")  # fmt: skip


def _with_digit(draw: Any, alphabet: str, low: int, high: int) -> str:
    chars = draw(st.lists(st.sampled_from(alphabet), min_size=low - 1, max_size=high - 1))
    return "".join(chars) + draw(st.sampled_from("0123456789"))


@st.composite
def generated_values(draw: Any) -> str:
    n = draw(st.integers(0, 10**9))
    pick = draw(st.integers(0, 10))
    sep = draw(st.sampled_from(":-."))
    octets = [f"{b:02x}" for b in draw(st.lists(st.integers(0, 255), min_size=4, max_size=8))]
    if pick == 0:  # a MAC or a colon-separated hex value, either case
        return sep.join(octets).upper() if n % 2 else sep.join(octets)
    if pick == 1:  # a hex id: a commit, a digest, a snapshot
        return draw(st.sampled_from(["", "snap-", "sha256:", "vol-"])) + "".join(draw(st.permutations(
            _with_digit(draw, HEX, 7, 40))))  # fmt: skip
    if pick == 2:  # a UUID
        return str(__import__("uuid").UUID(int=n * 7919 + pick))
    if pick == 3:  # a version
        parts = draw(st.lists(st.integers(0, 300), min_size=2, max_size=4))
        version = draw(st.sampled_from(["", "v", "release-"])) + ".".join(map(str, parts))
        return version if len(version) >= 4 else f"v{version}"  # a shorter word is no value (``1.0``)
    if pick == 4:  # a timestamp or a date
        return f"20{n % 100:02d}-{n % 12 + 1:02d}-{n % 28 + 1:02d}" + ("" if n % 3 else f"T{n % 24:02d}:{n % 60:02d}Z")
    if pick == 5:  # a path with a number in it
        words = draw(st.lists(st.sampled_from(NAME_WORDS), min_size=1, max_size=3))
        return "/".join(words) + f"-{n % 1000}.log" + ("" if n % 2 else f":{n % 900 + 1}")
    if pick == 6:  # a code or a ticket
        return "".join(draw(st.lists(st.sampled_from(string.ascii_uppercase), min_size=1, max_size=5))) + \
            draw(st.sampled_from(["-", "_", ""])) + str(n % 10**6 + 100)  # fmt: skip
    if pick == 7:  # a host and port, or an address
        host = draw(st.sampled_from(NAME_WORDS)) + draw(st.sampled_from(["", "-03", ".internal.example"]))
        return f"{host}:{n % 60000 + 1000}" if n % 2 else ".".join(str(int(o, 16)) for o in octets[:4])
    if pick == 8:  # a number long enough to be an id (an order, a ticket)
        return str(n % 10**9 + 10**4)
    if pick == 9:  # a key of random letters and digits behind a prefix
        return draw(st.sampled_from(["sk_live_", "ghp_", "tok-", ""])) + "".join(draw(st.permutations(
            _with_digit(draw, B62, 16, 40))))  # fmt: skip
    rng = random.Random(n)  # a key of random letters alone: consonants, the case changing every one to three
    key, upper = "", False
    while len(key) < 20 + n % 20:
        key += "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(1, 3)))
        key = key[:-1] + (key[-1].upper() if upper else key[-1])
        upper = not upper
    return key


@st.composite
def generated_names(draw: Any) -> str:
    words = draw(st.lists(st.sampled_from(NAME_WORDS), min_size=1, max_size=4))
    style = draw(st.integers(0, 4))
    if style == 0:
        return "_".join(words)
    if style == 1:
        return words[0] + "".join(w.title() for w in words[1:])
    if style == 2:
        return "".join(w.title() for w in words) + draw(st.sampled_from(["", "Error", "Factory"]))
    if style == 3:
        return ".".join(words)  # an attribute path
    return str(draw(st.integers(0, 9999)))  # a small number: a count, a line, a year


@settings(max_examples=300, deadline=None)
@given(generated_values(), st.integers(0, 50))
def test_a_value_of_any_generated_shape_is_found_whole(value: str, seed: int) -> None:
    assert cs.is_value(value), value
    assert value in cs.text_values(noisy_file(seed, value))
    assert value in cs.text_values(f"The user said: remember {value}, it matters.")


@settings(max_examples=300, deadline=None)
@given(generated_names())
def test_a_generated_name_or_small_number_is_not_a_value(name: str) -> None:
    assert not cs.is_value(name), name
    assert name not in cs.text_values(f"    return self.{name}(request)\n# see {name} above")


def test_a_rare_value_comes_before_a_log_full_of_timestamps() -> None:
    rng = random.Random(7)
    lines = [f"2026-12-{d:02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z INFO ok"
             for d in range(1, 29) for _ in range(10)]  # fmt: skip
    lines.insert(150, "2026-12-15T10:00:00Z WARN restored from snap-0b7c4e91d2f5")
    text = "\n".join(lines)
    assert cs.text_values(text)[0].startswith("2026-12-01T")  # found in the text's order
    assert "snap-0b7c4e91d2f5" in cs.held_note(text)  # kept first in the 160 characters of a placeholder
    gone = [user("check the log"), assistant(None, "c1"), tool("c1", text), assistant("done")]
    ledger = cs.fact_ledger(gone, [], COUNT, 200)
    assert ledger is not None and "snap-0b7c4e91d2f5" in ledger
    assert cs.ranked_values(["2026-12-01", "2026-12-02", "E7319", "2026-12-03"])[0] == "E7319"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=string.printable, max_size=3000))
def test_values_are_words_of_the_text_in_order_once_each(text: str) -> None:
    found = cs.text_values(text)
    assert len(found) == len(set(found)) and all(v in text and 4 <= len(v) <= cs.VALUE_WORD for v in found)
    positions = [text.find(v) for v in found]
    assert positions == sorted(positions) or len(text) > sum(cs.VALUE_SCAN)


def test_a_cleared_result_keeps_the_values_it_held() -> None:
    message = tool("c1", noisy_file(1, "snap-0b7c4e91d2f5"))
    cleared = cs.cleared_result(message, "read")
    assert cleared["content"].startswith("[tool result cleared: read,") and "snap-0b7c4e91d2f5" in cleared["content"]
    assert cs.cleared_result(message, "read") == cleared  # the same bytes every turn


def test_user_words_leave_out_what_an_agent_wraps_in_its_own_tags() -> None:
    text = "<system-reminder>\nAttribution rules\n- end commits with a line\n</system-reminder>\n\nFix the parser."
    assert cs.user_words(user(text)) == "Fix the parser."
    assert cs.user_words(user("<environment_context>\n  <cwd>/x</cwd>\n</environment_context>")) == ""
    assert cs.user_words(user("use <b>bold</b> here")) == "use <b>bold</b> here"  # inline tags are the user's


def gone_history(seed: int, values: int = 60) -> list[dict[str, Any]]:
    """Five short user messages with a fact each, every turn reading a file full of values and names."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for t in range(5):
        out += [user(f"Turn {t}: remember {VALUES[t]}. Read the next file."), assistant(None, f"c{t}")]
        noise = " ".join(f"{rng.choice('abcdef')}{rng.randint(10**8, 10**9)}ff" for _ in range(values))
        out += [tool(f"c{t}", noisy_file(seed + t, VALUES[5 + t]) + "\n" + noise), assistant("done")]
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(96, 1200))
def test_the_ledger_keeps_the_user_first_and_stays_within_its_budget(seed: int, budget: int) -> None:
    gone = gone_history(seed)
    ledger = cs.fact_ledger(gone, [], COUNT, budget)
    assert ledger is not None and COUNT(ledger) <= budget and ledger.startswith(cs.LEDGER_MARKER)
    said = [cs.user_words(m) for m in gone if m["role"] == "user"]
    if budget >= 400:  # the five prompts are ~100 tokens: they fit a ledger of this size whatever the noise
        assert all(s in ledger for s in said)
    if "Values in tool output:" in ledger and ledger.index("Values in tool output:") > 0:
        assert "The user said:" not in ledger or ledger.index("The user said:") < ledger.index("Values in tool")


def test_the_ledger_ranks_values_used_later_first() -> None:
    gone = gone_history(0, values=200)
    later = [user("use snap-0b7c4e91d2f5 now")]
    small = cs.fact_ledger(gone, later, COUNT, 300)
    assert small is not None and "snap-0b7c4e91d2f5" in small


def test_the_ledger_says_the_rest_can_be_recalled() -> None:
    assert cs.RECALL_TOOL in (cs.fact_ledger(gone_history(1), [], COUNT, 800, recall=True) or "")
    assert cs.RECALL_TOOL not in (cs.fact_ledger(gone_history(1), [], COUNT, 800) or "")


def test_the_turn_in_progress_starts_at_the_user_after_the_last_answer() -> None:
    history = [{"role": "system", "content": "s"}, user("a"), assistant("answer"), user("b"), assistant(None, "c1"),
               tool("c1", "x"), assistant(None, "c2"), tool("c2", "y")]  # fmt: skip
    assert cs.turn_in_progress(history) == 3
    assert cs.turn_in_progress(history[:3]) == 3  # answered: nothing in progress
    long_turn = [user("go"), *[m for k in range(40) for m in (assistant(None, f"k{k}"), tool(f"k{k}", "r"))]]
    start = cs.turn_in_progress(long_turn)
    assert len(long_turn) - start <= cs.PROTECTED_MESSAGES and long_turn[start]["role"] == "assistant"


def summariser(spans: list[tuple[int, int]]) -> cs.SpanSummary:
    async def summarise(messages: list[dict[str, Any]], plan: dict[str, Any], limit: int, grown: int) -> dict[str, Any]:
        spans.append((plan["summarize_from_index"], plan["kept_from_index"]))
        return {"summary": "- earlier turns read files", "summary_cached": False, "model_calls": 1}

    return summarise


def reading_turn(t: int, files: int, lines: int) -> list[dict[str, Any]]:
    out = [user(f"Turn {t}: read {files} files")]
    for k in range(files):
        text = f"# file {t}_{k}\n{noisy_file(t * 10 + k, None, lines)}\n# end {t}_{k}"
        out += [assistant(None, f"r{t}_{k}"), tool(f"r{t}_{k}", text)]
    return out


def test_the_turn_in_progress_is_never_summarised_and_is_reduced_last() -> None:
    history = [{"role": "system", "content": "You are an agent."}]
    for t in range(6):
        history += [*reading_turn(t, 2, 60), assistant("done")]
    history += reading_turn(6, 3, 60)  # in progress: three reads, no answer yet
    protect = cs.turn_in_progress(history)
    turn = cs.count_messages(history[protect:], TOK)[1]
    spans: list[tuple[int, int]] = []
    result = anyio.run(lambda: cs.shrink(history, [], TOK, int(turn * 1.6), summarise=summariser(spans)))
    assert result["fits"] and all(end <= protect for _, end in spans)
    text = json.dumps(result["messages"])
    assert all(f"# end 6_{k}" in text for k in range(3))  # each read of this turn is there to its end


def test_when_the_turn_alone_is_over_the_budget_its_results_are_elided_not_summarised() -> None:
    history = [{"role": "system", "content": "s"}, *reading_turn(0, 2, 40), assistant("done"), *reading_turn(1, 3, 200)]
    protect = cs.turn_in_progress(history)
    budget = int(cs.count_messages(history[protect:], TOK)[1] * 0.6)
    spans: list[tuple[int, int]] = []
    result = anyio.run(lambda: cs.shrink(history, [], TOK, budget, summarise=summariser(spans)))
    assert result["fits"] and spans == []
    out = json.dumps(result["messages"])
    assert all(f"# file 1_{k}" in out for k in range(3))  # every read is there, its middle elided with a marker


def test_older_turns_go_before_the_turn_in_progress_is_reduced() -> None:
    """A turn in progress that fits alone but not beside the older turns a stable cut would keep is sent whole:
    the older history goes first (into the ledger), whatever the budget, with or without a summariser."""
    for share in (1.15, 1.4, 1.9):
        history = [{"role": "system", "content": "You are an agent."}]
        for t in range(8):
            history += [user(f"Turn {t}: remember code K{t}-{t * 7919}."), *reading_turn(t, 2, 30)[1:],
                        assistant("done")]  # fmt: skip
        history += reading_turn(8, 3, 60)
        protect = cs.turn_in_progress(history)
        budget = int(cs.count_messages([history[0], *history[protect:]], TOK)[1] * share) + 400
        for summarise in (None, summariser([])):
            result = anyio.run(lambda h=history, s=summarise, b=budget: cs.shrink(h, [], TOK, b, summarise=s))
            text = json.dumps(result["messages"])
            assert result["fits"] and all(json.dumps(m) in text for m in history[protect:]), (share, summarise)


def test_the_users_words_are_kept_before_the_turns_material() -> None:
    """Where the turn in progress alone is over the budget, what the user said earlier is still quoted whole
    (within a sixth of the budget): its words are the task; the turn's results are reduced to make room."""
    history = [{"role": "system", "content": "You are an agent."}]
    for t in range(10):
        said = f"Turn {t}: remember code K{t}-{t * 7919} for later, and keep the tests green while you read."
        history += [user(said), *reading_turn(t, 2, 30)[1:], assistant("done")]
    history += reading_turn(10, 3, 200)
    protect = cs.turn_in_progress(history)
    budget = int(cs.count_messages(history[protect:], TOK)[1] * 0.7)
    result = anyio.run(lambda: cs.shrink(history, [], TOK, budget, summarise=summariser([])))
    text = json.dumps(result["messages"])
    assert result["fits"] and all(f"K{t}-{t * 7919}" in text for t in range(10))
    assert all(f"# file 10_{k}" in text for k in range(3))  # every read of the turn is there, elided


def codex_shaped(turns: int) -> list[dict[str, Any]]:
    out = [{"role": "system", "content": "You are Codex."}, {"role": "developer", "content": "sandbox: on"},
           user("# AGENTS.md instructions\nRun the tests."), user("<environment_context>\n  <cwd>/w</cwd>\n"
                                                                 "</environment_context>")]  # fmt: skip
    for t in range(turns):
        out += [*reading_turn(t, 2, 60), assistant("done")]
    return out


def test_the_agents_standing_context_is_found_by_role_and_place() -> None:
    history = codex_shaped(3)
    size = lambda m: cs.count_messages([m], TOK)[0][0]  # noqa: E731
    assert cs.standing_context(history, 100_000, size) == [2, 3]
    mid = [*history[:8], {"role": "system", "content": "Working directory: /w"}, *history[8:]]
    assert cs.standing_context(mid, 100_000, size) == [2, 3, 8]
    ours = [*history, {"role": "system", "content": cs.SUMMARY_MARKER + " old"}]
    assert cs.standing_context(ours, 100_000, size) == [2, 3]
    assert cs.standing_context(history, 40, size) == []  # over its share of the budget: history like the rest


def test_the_standing_context_survives_a_cut() -> None:
    history = codex_shaped(12)
    budget = cs.count_messages(history, TOK)[1] // 3
    policy = cs.Policy(rungs=("compact", "trim"))
    result = anyio.run(lambda: cs.shrink(history, [], TOK, budget, policy, summariser([])))
    assert result["fits"] and result["action"] in ("compact", "trim")
    kept = [m for m in result["messages"] if m in history[2:4]]
    assert kept == history[2:4]


def growing(turns: int) -> list[list[dict[str, Any]]]:
    """The requests of a conversation turn by turn: each a user message, a read of ~600 tokens, an answer."""
    history, requests = [{"role": "system", "content": "You are an agent."}], []
    for t in range(turns):
        history += reading_turn(t, 1, 40)
        requests.append(list(history))
        history.append(assistant(f"done {t}"))
    return requests


def test_summary_calls_are_at_most_one_per_three_tenths_of_the_budget_of_growth() -> None:
    """With the real summarise_span (a scripted model behind it) and a cache across turns, as the proxy has."""
    budget, cache, calls = 4096, cs.SummaryCache(), []

    async def model(prompt: list[dict[str, Any]], max_tokens: int) -> str:
        calls.append(len(prompt))
        return "- The user had files read one by one; each was read and reported done."

    summariser = cs.Summariser("scripted", model, 32_000)

    async def summarise(messages: list[dict[str, Any]], plan: dict[str, Any], limit: int, grown: int) -> dict[str, Any]:
        options = cs.SummaryOptions(max_summary_tokens=limit, min_new_tokens=grown)
        return await cs.summarise_span(messages, plan, TOK, summariser, cache, options)

    requests = growing(100)
    for request in requests:
        result = anyio.run(lambda r=request: cs.shrink(r, [], TOK, budget, summarise=summarise))
        assert result["fits"], result["reason"]
    growth = cs.count_messages(requests[-1], TOK)[1] - budget
    assert len(calls) <= growth / (cs.SUMMARY_GROWTH * budget) + 1 and len(calls) <= 0.5 * len(requests)


def test_the_copy_guard_judges_only_the_new_span() -> None:
    previous = "\n".join(f"- Step {k}: the parser module was changed to read chunk {k} and its tests pass." for k in
                         range(12))  # fmt: skip
    new = "tool: ran pytest -q on tests/test_parser.py, 14 passed in 0.8s"
    reply = previous + "\n- Step 12: the tests were run again and 14 passed."
    source = f"[summary of the conversation before this part]\n{previous}\n{new}"
    assert cs.guard_summary(reply, source, 800, COUNT, keep=previous)[2]  # usable: it kept what it was asked to
    assert "copy" in cs.guard_summary(reply, source, 800, COUNT)[1]  # judged on all of it, it reads as a copy


def test_every_kind_of_tool_is_counted() -> None:
    namespace = {"type": "namespace", "name": "mcp__docs", "description": "Docs tools",
                 "tools": [{"type": "function", "name": f"t{k}", "description": "Looks things up. " * 20,
                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
                           for k in range(10)]}  # fmt: skip
    body = {"model": "m", "input": [{"type": "message", "role": "user", "content": "hi"}],
            "tools": [namespace, {"type": "web_search"}]}  # fmt: skip
    view = csw.responses_view(body)
    counted = cs.count_tools(view.tools, cs.resolve_tokenizer("tiktoken"))
    assert counted >= cs.resolve_tokenizer("tiktoken").count(json.dumps(namespace)) * (1 + cs.UNKNOWN_TOOL_MARGIN)
    anthropic = csw.messages_view(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        }
    )
    assert anthropic.tools[0]["function"]["kind"] == "web_search_20250305"
    chat = csf.ChatRequest.read({"messages": [{"role": "user", "content": "hi"}],
                                "tools": [{"type": "custom", "custom": {"name": "apply_patch"}}]})  # fmt: skip
    assert chat.tools[0]["function"]["name"] == "custom" and cs.count_tools(chat.tools, TOK) > 0


def test_a_recall_finds_a_file_by_its_name_and_lines_by_their_words_within_its_limit() -> None:
    folded = [user("read it"), {"role": "assistant", "content": None, "tool_calls": [
        cs.tool_call("c1", "read", json.dumps({"filePath": "/p/notes_01_a.txt"}))]},
        tool("c1", noisy_file(0, "snap-0b7c4e91d2f5", 400))]  # fmt: skip
    by_name = csw.recall_lines(folded, "notes_01_a.txt", 300, COUNT)
    assert by_name.startswith("[message 2, tool]") and COUNT(by_name) <= 300 and "[... cut" in by_name
    by_words = csw.recall_lines(folded, "remember snap", 300, COUNT)
    assert "snap-0b7c4e91d2f5" in by_words and COUNT(by_words) < 300
    assert "Nothing folded away" in csw.recall_lines(folded, "zebra", 300, COUNT)
    assert "no word" in csw.recall_lines(folded, "  ", 300, COUNT)


ARGUMENTS = json.dumps({"query": "notes"})
RESPONSES_CALL = {"type": "function_call", "call_id": "k", "name": cs.RECALL_TOOL, "arguments": ARGUMENTS}


def chat_delta(**call: Any) -> dict[str, Any]:
    return {"choices": [{"delta": {"tool_calls": [{"index": 0, **call}]}}]}


WHOLE = {
    "chat": {"choices": [{"message": {"tool_calls": [cs.tool_call("k", cs.RECALL_TOOL, ARGUMENTS)]}}]},
    "responses": {"output": [RESPONSES_CALL]},
    "messages": {"content": [{"type": "tool_use", "id": "k", "name": cs.RECALL_TOOL, "input": {"query": "notes"}}]},
}
STREAMED = {
    "chat": [chat_delta(id="k", function={"name": cs.RECALL_TOOL, "arguments": ARGUMENTS[:5]}),
             chat_delta(function={"arguments": ARGUMENTS[5:]})],
    "responses": [{"type": "response.output_item.done", "item": RESPONSES_CALL}],
    "messages": [{"type": "content_block_start", "index": 0,
                  "content_block": {"type": "tool_use", "id": "k", "name": cs.RECALL_TOOL}},
                 {"type": "content_block_delta", "index": 0,
                  "delta": {"type": "input_json_delta", "partial_json": ARGUMENTS}}],
}  # fmt: skip


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
def test_each_wire_reads_the_recall_call_back_streamed_or_whole(wire: str) -> None:
    room = csw.WIRES[wire]
    assert cs.RECALL_TOOL in json.dumps(room.with_tool({"tools": []})["tools"][-1])
    events = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in STREAMED[wire]) + b"data: [DONE]\n\n"
    for calls in (room.calls(json.dumps(WHOLE[wire]).encode(), False), room.calls(events, True)):
        assert [(c.id, c.name, c.query()) for c in calls] == [("k", cs.RECALL_TOOL, "notes")]
    base = {"messages": [user("hi")], "input": [{"type": "message", "role": "user", "content": "hi"}]}
    answered = room.answered(base, calls, ["the lines"])
    assert "the lines" in json.dumps(answered) and len(json.dumps(answered)) > len(json.dumps(base))
