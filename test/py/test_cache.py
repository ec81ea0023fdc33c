"""Cache-friendly shrinking: stable cuts across turns, byte-stable replacements, summaries reused."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any

import anyio
import pytest
from builders import conversation
from checks import check_trim
from fake_openai import FakeOpenAI, serve
from mcp import Client
from mcp_calls import ok

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast


def grow(turns: int) -> list[list[dict[str, Any]]]:
    """The history as an agent resends it: after each turn, everything so far."""
    full = conversation(turns, size=60)
    return [full[: 1 + 5 * k] for k in range(1, turns + 1)]


def cuts(histories: list[list[dict[str, Any]]], tok: cs.Tokenizer, ratio: float, budget: int) -> list[int]:
    return [check_trim(h, tok, budget, target_ratio=ratio)["kept_from_index"] for h in histories]


def test_stable_cuts_move_rarely_and_in_big_steps(tok: cs.Tokenizer) -> None:
    histories = grow(40)
    budget = 3000
    plain = cuts(histories, tok, 1.0, budget)
    stable = cuts(histories, tok, 0.6, budget)
    moves = lambda xs: sum(1 for a, b in itertools.pairwise(xs) if a != b)  # noqa: E731
    assert moves(plain) >= 20  # a sliding window moves on almost every turn once over the budget
    assert 0 < moves(stable) <= moves(plain) // 3
    sizes = [cs.count_messages(h, tok)[1] for h in histories]
    moved = [k for k in range(1, len(stable)) if stable[k] != stable[k - 1]]
    assert all(sizes[b] - sizes[a] >= 0.4 * budget for a, b in itertools.pairwise(moved))  # a step of growth apart


def test_same_prefix_while_the_tail_fits(tok: cs.Tokenizer) -> None:
    histories = grow(40)
    budget = 3000
    outputs = [cs.trim_messages(h, tok, budget, target_ratio=0.6) for h in histories]

    def cleared(result: dict[str, Any]) -> int:
        return sum(t["messages"] for t in result["tiers"] if t["tier"] == "clear_tool_results")

    same = 0
    for before, after in itertools.pairwise(outputs):
        if before["kept_from_index"] == after["kept_from_index"] and cleared(before) == cleared(after):
            same += 1
            n = len(before["messages"])
            assert after["messages"][:n] == before["messages"]  # the previous request is a prefix
    assert same >= 0.6 * (len(outputs) - 1)
    for result in outputs:
        assert result["fits"]
        if result["tokens_before"] > budget:
            assert result["tokens_after"] >= 0.5 * budget  # sending little is not a win


def test_stable_mode_keeps_every_invariant(tok: cs.Tokenizer) -> None:
    for history in grow(30)[::3]:
        for ratio in (0.3, 0.6, 0.9):
            result = check_trim(history, tok, 2500, target_ratio=ratio, keep_last=2)
            assert result["fits"] and "grid_step" not in result


def test_cleared_results_are_byte_identical_across_turns(tok: cs.Tokenizer) -> None:
    histories = grow(24)
    outputs = [cs.trim_messages(h, tok, 4000, target_ratio=0.6)["messages"] for h in histories[-6:]]
    seen: dict[str, str] = {}
    for out in outputs:
        for m in out:
            if m["role"] == "tool" and str(m["content"]).startswith("[tool result cleared:"):
                assert seen.setdefault(m["tool_call_id"], m["content"]) == m["content"]
    assert seen


def test_a_long_single_turn_agent_loop_is_cut_stably(tok: cs.Tokenizer) -> None:
    """One user request and a growing agent loop (Claude Code's shape): stable mode keeps the request and
    drops the loop's oldest steps at grid points, so most requests extend the previous one."""
    full = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "fix src/app.py"}]
    for k in range(60):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "bash", "arguments": f'{{"n": {k}}}'}}
        full += [{"role": "assistant", "content": None, "tool_calls": [call]}]
        full += [{"role": "tool", "tool_call_id": f"c{k}", "content": f"output {k}\n" * 40}]
    histories = [full[: 2 + 2 * k] for k in range(1, 61)]
    outputs = [check_trim(h, tok, 3000, target_ratio=0.6, keep_last=2) for h in histories]
    same = 0
    for before, after in itertools.pairwise(outputs):
        assert after["fits"] and after["messages"][1]["content"] == "fix src/app.py"  # the request stays
        same += after["messages"][: len(before["messages"])] == before["messages"]  # the earlier request extended
    assert same >= 0.7 * (len(outputs) - 1)
    over = [r for r in outputs if r["tokens_before"] > 3000]
    assert over and all(r["budget_use"] >= 0.5 for r in over)
    assert all(r["pinned_user_index"] == 1 for r in over if r["dropped"])  # old steps go, the request stays
    assert all(r["tiers"][0]["tier"] == "clear_tool_results" for r in over)  # old results go before old steps


def test_compaction_cut_holds_when_keep_last_alone_exceeds_the_share(tok: cs.Tokenizer) -> None:
    """Long messages: the newest keep_last do not fit the kept share, yet the cut must not slide every turn."""
    history = [{"role": "system", "content": "s"}]
    for t in range(20):
        history += [{"role": "user", "content": f"q{t} " + "word " * 300}]
        history += [{"role": "assistant", "content": "ok " * 300}]
    plans = [
        cs.compact_messages(history[: 2 * k], tok, summary=None, max_context_tokens=5800, threshold=0)
        for k in range(10, 20)
    ]
    ends = [p["kept_from_index"] for p in plans]
    moves = sum(1 for a, b in itertools.pairwise(ends) if a != b)
    assert moves <= len(ends) // 2 and all(p["needs_summary"] for p in plans), ends


def test_target_ratio_is_validated(tok: cs.Tokenizer) -> None:
    with pytest.raises(cs.ContextShrinkError, match="target_ratio"):
        cs.trim_messages(conversation(2), tok, 1000, target_ratio=0)


def compaction_session(
    tmp_path: Path, url: str, histories: list[list[dict[str, Any]]], fake: FakeOpenAI | None = None
) -> list[dict[str, Any]]:
    """Compact each history in turn on one connection (the caches live as long as the server session);
    each result also carries the summariser requests its call made."""
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="fake", base_url=url))

    async def go() -> list[dict[str, Any]]:
        out = []
        async with Client(server) as client:
            for history in histories:
                seen = len(fake.requests) if fake else 0
                arguments = {"messages": history, "max_context_tokens": 3000, "max_summary_tokens": 200}
                result = ok(await client.call_tool("compact_context", arguments))
                out.append({**result, "requests": fake.requests[seen:] if fake else []})
        return out

    return anyio.run(go)


def test_repeated_compaction_of_the_same_span_makes_no_model_call(tmp_path: Path) -> None:
    histories = grow(30)[18:26]
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as url:
        results = compaction_session(tmp_path, url, histories, fake)
    assert all(r["compacted"] for r in results)
    same = [(a, b) for a, b in itertools.pairwise(results) if a["kept_from_index"] == b["kept_from_index"]]
    assert len(same) >= 2, "the cut should stay put for a few turns"
    for before, after in same:
        assert after["model_calls"] == 0 and after["summary_cached"] and after["requests"] == []
        assert after["messages"][1] == before["messages"][1]  # the summary message, byte for byte
        n = len(before["messages"])
        assert after["messages"][:n] == before["messages"]  # the whole previous request is a prefix


def test_a_moved_cut_folds_the_earlier_summary(tmp_path: Path) -> None:
    histories = grow(40)[20:40]
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as url:
        results = compaction_session(tmp_path, url, histories, fake)
    moved = [(a, b) for a, b in itertools.pairwise(results) if b["kept_from_index"] != a["kept_from_index"]]
    assert len(moved) >= 3 and all(a["compacted"] and b["compacted"] for a, b in moved)
    for before, after in moved:
        assert after["previous_summary_folded"]
        fold = after["requests"][-1]["body"]["messages"][1]["content"]
        head = f"{cs.TRANSCRIPT_BEGIN}\n[summary of the conversation before this part]\n{before['summary']}"
        assert fold.startswith(head)  # folded, first
        # Only the newly evicted messages were summarised again, in one request.
        assert after["model_calls"] == 1 and before["summary"].split("\n")[0] not in fold[len(head) :]


def test_a_cached_summary_is_sent_byte_identical_at_another_calibration(tok: cs.Tokenizer) -> None:
    """The proxy recalibrates after every reply; a summary filed for a span must come back as it was sent
    (re-anchoring it at the new scale changed its identifier list, and the server re-read the whole prompt)."""
    history = [{"role": "system", "content": "s"}]
    for t in range(12):
        history += [{"role": "user", "content": f"look at src/module_{t}.py and run `pytest -k case_{t}` " * 8}]
        history += [{"role": "assistant", "content": f"ok, fixed src/module_{t}.py " * 8}]
    plan = cs.compact_messages(history, tok, summary=None, max_context_tokens=1500, threshold=0)
    assert plan["needs_summary"]

    async def call(prompt: list[dict[str, Any]], max_tokens: int) -> str:
        return "The user asked for fixes; several modules were fixed."  # no identifiers: anchoring appends them

    summariser = cs.Summariser("fake", call, 100_000)
    cache = cs.SummaryCache()
    out = []
    for scale in (1.0, 0.8, 0.6, 3.0):
        scaled = dataclasses.replace(tok, scale=scale)
        out.append(
            anyio.run(lambda t=scaled: cs.summarise_span(history, plan, t, summariser, cache, max_summary_tokens=300))
        )
    first = out[0]["summary"]
    assert "src/module_10.py" in first and not out[0]["summary_cached"]  # anchored when written
    assert all(o["summary"] == first and o["summary_cached"] for o in out[1:3])  # sent as filed while it fits
    bigger = out[3]["summary"]  # at three times the size it no longer fits: anchored again, within the budget
    assert bigger != first and math.ceil(tok.count(bigger) * 3.0) <= 300
