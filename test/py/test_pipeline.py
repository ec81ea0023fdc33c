"""Section 9, the shrinking pipeline: ``shrink`` called directly, rung by rung (diet, clear, compact, trim), with
a scripted summariser, and its properties over generated agent histories."""

from __future__ import annotations

import copy
import json
import types
from typing import Any

import anyio
import httpx2
import pytest
from agent_shapes import cases
from builders import assistant, conversation, tool, user
from hypothesis import HealthCheck, given, settings

import context_shrink as cs
import context_shrink_fit as csf

pytestmark = pytest.mark.core
TOK = cs.HEURISTIC


def shrink(messages: list[dict[str, Any]], budget: int, **options: Any) -> dict[str, Any]:
    return anyio.run(lambda: cs.shrink(messages, [], TOK, budget, **options))


def summariser(calls: list[Any], fail: Exception | None = None) -> cs.SpanSummary:
    async def summarise(messages: list[dict[str, Any]], plan: dict[str, Any], limit: int, grown: int) -> dict[str, Any]:
        calls.append((plan["summarize_from_index"], plan["kept_from_index"], limit))
        if fail is not None:
            raise fail
        return {"summary": "- the user fixed the parser; tests pass", "summary_cached": False, "model_calls": 1}

    return summarise


def test_below_the_trigger_nothing_changes() -> None:
    messages = conversation(2, size=20)
    result = shrink(messages, 100_000)
    assert result["action"] == "none" and result["messages"] == messages and result["fits"]


def test_the_diet_alone_when_it_is_enough() -> None:
    log = "\n".join(["PASSED test_x"] * 3000)  # one line repeated: the diet keeps it once
    messages = [user("run the tests"), assistant(None, "c1"), tool("c1", log), assistant("done")]
    budget = cs.count_messages(messages, TOK)[1] // 4
    result = shrink(messages, budget)
    assert result["action"] == "diet" and result["fits"] and result["tokens_after"] < budget


def test_old_tool_results_are_cleared_before_anything_is_dropped() -> None:
    history = [{"role": "system", "content": "s"}]
    for t in range(8):
        history += [user(f"turn {t}"), assistant(None, f"c{t}"), tool(f"c{t}", "output line\n" * 600), assistant("ok")]
    budget = int(cs.count_messages(history, TOK)[1] * 0.6)
    result = shrink(history, budget, policy=cs.Policy(rungs=("clear", "trim"), keep_last=2))
    assert result["fits"] and len(result["messages"]) == len(history)  # nothing dropped: results became markers
    assert sum(str(m.get("content")).startswith("[tool result cleared:") for m in result["messages"]) >= 3


def test_compaction_with_a_summariser_and_its_summary_in_the_request() -> None:
    messages = conversation(12, size=200)
    calls: list[Any] = []
    budget = cs.count_messages(messages, TOK)[1] // 4
    result = shrink(messages, budget, policy=cs.Policy(rungs=("compact", "trim")), summarise=summariser(calls))
    assert result["action"] == "compact" and result["fits"] and len(calls) == 1
    assert result["summary_calls"] == 1 and cs.api_problems(result["messages"]) == []
    assert any(cs.SUMMARY_MARKER in str(m.get("content")) for m in result["messages"])


@pytest.mark.parametrize(
    ("summarise", "reason"),
    [(None, "no summariser"), (summariser([], cs.ContextShrinkError("the model is down")), "summary failed")],
)
def test_without_a_summary_the_request_is_trimmed_and_says_why(summarise: Any, reason: str) -> None:
    messages = conversation(12, size=200)
    result = shrink(messages, cs.count_messages(messages, TOK)[1] // 4, summarise=summarise)
    assert result["action"].startswith("trim") and result["fits"] and reason in str(result["reason"])


def test_the_trim_rung_runs_once_on_the_same_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no summary to make, the clear rung's trim and the trim rung's are one each (the latter with the
    ledger's room kept)."""
    runs: list[int] = []
    real = cs.Rungs.trim
    monkeypatch.setattr(cs.Rungs, "trim", lambda *a: runs.append(1) or real(*a))
    messages = conversation(12, size=200)
    result = shrink(messages, cs.count_messages(messages, TOK)[1] // 4, policy=cs.Policy(rungs=("clear", "trim")))
    assert result["action"].startswith("trim") and runs == [1, 1]


def test_a_count_given_is_not_counted_again() -> None:
    messages = conversation(3, size=50)
    counted = cs.count_messages(messages, TOK)[1]
    assert shrink(messages, 100_000, counted=counted + 7)["tokens_before"] == counted + 7


def test_nothing_cut_is_said_as_it_is() -> None:
    huge = user("word " * 5000)  # the newest request alone is over the budget: it is never touched
    result = shrink([huge], 500)
    assert result["action"] == "unchanged (still too long)" and result["messages"] == [huge] and result["reason"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_budget=32768))
def test_properties_over_agent_histories(case: Any) -> None:
    """Over generated agent histories: the input is never changed; the result is API-valid, keeps the leading
    system messages and the newest user message, fits whenever trimming alone could fit, reports its size
    honestly, and is the same on a second run (summaries included: the summariser is deterministic)."""
    messages = case.build()
    frozen = copy.deepcopy(messages)
    calls: list[Any] = []
    first = shrink(messages, case.budget, summarise=summariser(calls))
    assert messages == frozen
    out = first["messages"]
    assert cs.api_problems(out) == [] or cs.api_problems(messages) != []
    lead = cs.leading_system(messages)
    assert out[:lead] == messages[:lead]
    users = [m for m in messages if m["role"] == "user"]
    assert not users or users[-1] in out
    trimmed = cs.trim_messages(messages, TOK, max(1, int(0.9 * case.budget)), target_ratio=0.6)
    if trimmed["fits"] and first["action"] != "none":
        assert first["fits"], (first["action"], first["reason"])
    assert first["tokens_after"] == cs.count_messages(out, TOK)[1]
    assert json.dumps(shrink(messages, case.budget, summarise=summariser([]))["messages"]) == json.dumps(out)


class Door(csf.ServerMemory):
    """A door of its own, not the proxy's: settings, tables in memory, an upstream behind ``handler``."""

    def __init__(self, handler: Any, window: int | None) -> None:
        self.config = types.SimpleNamespace(base="http://up/v1", window=window, summary_url=None, summary_model=None,
                                            api_key=None, summary_options=cs.SummaryOptions())  # fmt: skip
        self.http = httpx2.AsyncClient(transport=httpx2.MockTransport(handler))
        self.tokenizer, self.policy = TOK, cs.Policy(rungs=("trim",))
        self.caches, self.summaries, tables = cs.BackendCaches(), cs.SummaryCache(), cs.MemoryTables()
        self.windows, self.factors, self.counts, self.tool_costs, self.tasks, self.said = (
            cs.StoredTable(tables, name) for name in ("windows", "factors", "counts", "tool_costs", "tasks", "said")
        )


def fitted(window: int | None, body: dict[str, Any]) -> tuple[dict[str, Any], csf.FitReport, list[str]]:
    asked: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        asked.append(request.url.path)
        return httpx2.Response(404, json={"error": {"message": "not here"}})

    async def run() -> tuple[dict[str, Any], csf.FitReport]:
        door = Door(handler, window)
        async with door.http:
            return await csf.fit_request(door, body, None, csf.FitReport())

    return (*anyio.run(run), asked)


def test_fit_request_serves_any_door_that_keeps_a_server_memory() -> None:
    """The proxy's request path is the core's: a door of its own, with its tables in memory and an upstream that
    can neither count nor tell its window, gets the request read, counted, trimmed to its budget and reported;
    the body it gave is not changed."""
    body = {"model": "m", "max_tokens": 256, "messages": conversation(12, size=150)}
    before = copy.deepcopy(body)
    sent, report, asked = fitted(4096, body)
    assert body == before and sent["model"] == "m" and len(sent["messages"]) < len(body["messages"])
    assert report.window == 4096 and report.count == "estimated" and report.action.startswith("trim")
    assert report.tokens_before > 4096 - 256 >= report.tokens_after
    assert cs.api_problems(sent["messages"]) == [] and sent["messages"][0] == body["messages"][0]
    assert any(path.endswith("tokenize") or "count" in path for path in asked)  # it asked the upstream to count

    unknown, report, asked = fitted(None, body)  # no window configured, none discovered: forwarded as it came
    assert unknown is body and report.reason == "window unknown" and report.action == "none" and asked
