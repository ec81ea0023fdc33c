"""What every shrink must satisfy, checked from the outside: shared by the property tests and the unit tests."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import context_shrink as cs

MARKERS = ("tokens elided …]", "[image removed: ")


def size(message: dict[str, Any], tok: cs.Tokenizer) -> int:
    return cs.count_messages([message], tok)[0][0]


def least_unit(messages: list[dict[str, Any]], start: int, end: int, tok: cs.Tokenizer) -> int:
    """The smallest the newest unit can honestly be: reasoning replaced by its marker, results by placeholders."""
    names = {c["id"]: c["function"]["name"] for c in messages[start].get("tool_calls") or []}
    total = 0
    for m in messages[start:end]:
        options = [m]
        if m["role"] == "assistant" and any(m.get(k) for k in cs.REASONING_KEYS):
            options.append(cs.without_reasoning(m))
        if m["role"] == "tool":
            options.append(cs.cleared_result(m, names.get(m["tool_call_id"], "tool")))
        total += min(size(o, tok) for o in options)
    return total


def core(messages: list[dict[str, Any]], tok: cs.Tokenizer, tools_tokens: int = 0) -> int:
    """The floor of P1: the leading system messages, the newest turn's opening user message(s), the newest unit
    in its smallest honest form, the reply priming and the tools."""
    lead = cs.leading_system(messages)
    users = [i for i in range(lead, len(messages)) if messages[i]["role"] == "user"]
    total = sum(size(m, tok) for m in messages[:lead]) + tok.format.priming + tools_tokens
    run_end = lead
    if users:
        start = users[-1]
        while start - 1 >= lead and messages[start - 1]["role"] == "user":
            start -= 1
        run_end = start
        while run_end < len(messages) and messages[run_end]["role"] == "user":
            run_end += 1
        total += sum(size(m, tok) for m in messages[start:run_end])
    start, end = cs.group_units(messages)[-1] if len(messages) > lead else (lead, lead)
    if run_end <= start < end:
        total += least_unit(messages, start, end, tok)
    return total


def sources(messages: list[dict[str, Any]], result: dict[str, Any]) -> list[int]:
    """The input index of every output message, from the report: leading messages, pins, then the cut on."""
    lead = cs.leading_system(messages)
    return [*range(lead), *result["pinned_indices"], *range(result["kept_from_index"], len(messages))]


def check_honest(messages: list[dict[str, Any]], result: dict[str, Any], tok: cs.Tokenizer) -> None:
    """P5 and P6: every kept message is the input's own, or a reduced copy with a visible marker that the report
    lists; the output is valid for the API whenever the input was; sizes are re-counted."""
    out = result["messages"]
    where = sources(messages, result)
    assert len(where) == len(out) and where == sorted(set(where)), "the report does not account for the output"
    changed = {c["index"]: c["change"] for c in result["changes"]}
    for i, m in zip(where, out, strict=True):
        original = messages[i]
        if m is original:
            assert i not in changed, f"messages[{i}] is listed as changed but is the input's own"
            continue
        assert i in changed, f"messages[{i}] changed silently"
        assert {k: v for k, v in m.items() if k not in ("content", "tool_calls", *cs.REASONING_KEYS)} == {
            k: v for k, v in original.items() if k not in ("content", "tool_calls", *cs.REASONING_KEYS)
        }
        for call, before in zip(m.get("tool_calls") or [], original.get("tool_calls") or [], strict=True):
            if call != before:  # only long arguments shortened, still JSON, with the marker
                assert call["id"] == before["id"] and call["function"]["name"] == before["function"]["name"]
                assert MARKERS[0] in call["function"]["arguments"] and json.loads(call["function"]["arguments"])
        if m.get("content") != original.get("content"):
            text = str(m["content"])
            assert text.startswith("[tool result cleared: ") or any(x in text for x in MARKERS) or " cut …]" in text
        for key in cs.REASONING_KEYS:
            if m.get(key) != original.get(key):
                assert str(m[key]).startswith("[reasoning removed: ~") or MARKERS[0] in m[key], m[key][:80]
    if not cs.api_problems(messages):
        assert cs.api_problems(out) == [], cs.api_problems(out)
    recount = cs.count_messages(out, tok)[1] + result["tools_tokens"]
    assert recount == result["tokens_after"], "tokens_after is not the re-counted size"
    assert result["fits"] == (recount <= result["max_context_tokens"] - result["reserve_tokens"])


def check_trim(messages: list[dict[str, Any]], tok: cs.Tokenizer, budget: int, **kwargs: Any) -> dict[str, Any]:
    """Trim, and check everything trimming promises (input untouched, honest, valid, fits when it can, the
    newest request and the leading messages kept, deterministic); return the result."""
    before = copy.deepcopy(messages)
    result = cs.trim_messages(messages, tok, budget, **kwargs)
    assert messages == before, "the input was mutated"
    if kwargs.get("alternate_roles"):
        assert result["tokens_after"] == cs.count_messages(result["messages"], tok)[1] + result["tools_tokens"]
    else:
        check_honest(messages, result, tok)
        lead = cs.leading_system(messages)
        assert all(result["messages"][i] is messages[i] for i in range(lead))
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if users:
            assert users[-1] in sources(messages, result), "the newest user message was dropped"
    tools = cs.count_tools(kwargs.get("tools") or [], tok)
    if kwargs.get("strategy", "auto") == "auto" and core(messages, tok, tools) <= budget - kwargs.get(
        "reserve_tokens", 0
    ):
        assert result["fits"], "the leading messages, the newest request and its newest step fit, the result does not"
    assert cs.trim_messages(messages, tok, budget, **kwargs) == result, "not deterministic"
    return result


def responses_problems(body: dict[str, Any]) -> list[str]:
    """What makes a Responses input invalid: an output without its call, a call without its output."""
    items = body["input"]
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    problems = [f"output {c} has no call" for c in outputs if c not in calls]
    return problems + [f"call {c} has no output" for c in calls if c not in outputs]


def anthropic_problems(body: dict[str, Any]) -> list[str]:
    """What makes a Messages request invalid: turns that do not alternate, a tool_result without its
    tool_use in the turn before, a tool_use not answered in the turn after. System messages between the
    turns (Claude Code sends its environment so) are set aside, but never between a tool_use and its result."""
    problems = [f"message {k} has role {m.get('role')!r}" for k, m in enumerate(body["messages"])
                if m.get("role") not in ("user", "assistant", "system")]  # fmt: skip
    for k, (a, b) in enumerate(itertools.pairwise(body["messages"])):
        if b.get("role") == "system" and a["role"] == "assistant" and "tool_use" in str(a["content"]):
            problems.append(f"message {k + 1}: a system message between a tool_use and its result")
    problems += [f"message {k} has empty content" for k, m in enumerate(body["messages"]) if not m.get("content")]
    turns = [m for m in body["messages"] if m.get("role") != "system"]
    problems += [f"turns {k} and {k + 1} are both {a['role']}" for k, (a, b) in enumerate(itertools.pairwise(turns))
                 if a["role"] == b["role"]]  # fmt: skip
    blocks = [[b for b in t["content"] if isinstance(b, dict)] if isinstance(t["content"], list) else [] for t in turns]
    for k, turn in enumerate(blocks):
        for block in turn:
            if block.get("type") == "tool_result" and not any(
                b.get("id") == block["tool_use_id"] for b in (blocks[k - 1] if k else []) if b.get("type") == "tool_use"
            ):
                problems.append(f"turn {k}: tool_result {block['tool_use_id']} without its tool_use")
            if block.get("type") == "tool_use" and not any(
                b.get("tool_use_id") == block["id"] for b in (blocks[k + 1] if k + 1 < len(blocks) else [])
            ):
                problems.append(f"turn {k}: tool_use {block['id']} not answered")
    return problems
