"""The cut planner's promises (docs/trimming.md), checked as properties over generated agent-shaped histories
(test/py/agent_shapes.py) x budgets 1k-128k x keep_last 0-20 x both modes, 1,000 examples each, seeded
(``derandomize``) so that a failure reproduces with the same example on every machine.

P1 fits when it can · P2 uses the room · P3 monotone · P4 stable · P5 honest · P6 valid (and pure) ·
P7 a remembered replay is the replay.
P4 counts the changes between consecutive requests that both fit (one that cannot fit is refused whatever its
bytes). Linear time is measured in bench/speed.py, not asserted here.
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import checks
import pytest
from agent_shapes import Case, agent_history, cases
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

TOK = cs.resolve_tokenizer("heuristic")  # deterministic and fast (cached); the rule does not depend on the counter
STABLE_RATIO = 0.6
PROPERTY = settings(
    max_examples=1000,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REPLAY = settings(
    max_examples=1000,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REPLAY_LENGTH = 100  # messages replayed one at a time (each prefix shrunk: quadratic, so kept short)
modes = st.sampled_from([1.0, STABLE_RATIO])
keep_lasts = st.integers(0, 20)


def size(message: dict[str, Any]) -> int:
    return checks.size(message, TOK)


def core(messages: list[dict[str, Any]]) -> int:
    return checks.core(messages, TOK)


def check_honest(messages: list[dict[str, Any]], result: dict[str, Any]) -> None:
    checks.check_honest(messages, result, TOK)


def room_for_the_unit_before(messages: list[dict[str, Any]], result: dict[str, Any], budget: int) -> bool:
    """Whether the units just before the cut, back to the user message a kept history must start on, in their
    least honest form, would still fit beside what was kept (P2 asks for the room to be used only as far as whole
    units allow)."""
    cut, lead = result["kept_from_index"], cs.leading_system(messages)
    start = next((i for i in range(cut - 1, lead - 1, -1) if messages[i]["role"] == "user"), None)
    if start is None:
        return False
    units = [(a, b) for a, b in cs.group_units(messages) if start <= a and b <= cut]
    return result["tokens_after"] + sum(checks.least_unit(messages, a, b, TOK) for a, b in units) <= budget


def trim(messages: list[dict[str, Any]], budget: int, keep_last: int, ratio: float) -> dict[str, Any]:
    return cs.trim_messages(messages, TOK, budget, keep_last=keep_last, target_ratio=ratio)


@pytest.mark.slow
@PROPERTY
@given(cases(), keep_lasts, modes)
def test_p1_p2_p5_p6_fits_uses_the_room_honestly(case: Case, keep_last: int, ratio: float) -> None:
    messages, budget = case.build(), case.budget
    before = copy.deepcopy(messages)
    result = trim(messages, budget, keep_last, ratio)
    assert messages == before, "the input was mutated"
    check_honest(messages, result)
    floor = core(messages)
    total = cs.count_messages(messages, TOK)[1]
    if floor <= budget:
        assert result["fits"], f"P1: the core ({floor}) fits {budget} but the result is {result['tokens_after']}"
        if total > budget:
            need = 0.85 if ratio == 1.0 else 0.5
            assert result["tokens_after"] >= need * budget or not room_for_the_unit_before(messages, result, budget), (
                f"P2: {result['tokens_after']} of {budget} ({result['tokens_after'] / budget:.2f})"
            )
    else:  # the floor is the core's least honest form as checks.core models it; the planner may find smaller
        assert result["fits"] or result["warnings"], "a result that cannot fit says why"


def replay(messages: list[dict[str, Any]], budget: int, keep_last: int, ratio: float) -> list[dict[str, Any]]:
    """Shrink every prefix of a growing history, as an agent resends it."""
    lead = cs.leading_system(messages)
    return [trim(messages[:k], budget, keep_last, ratio) for k in range(lead + 1, len(messages) + 1)]


@pytest.mark.slow
@REPLAY
@given(cases(max_budget=8192), keep_lasts, modes)
def test_p3_the_cut_never_moves_back(case: Case, keep_last: int, ratio: float) -> None:
    messages, budget = case.build()[:REPLAY_LENGTH], case.budget
    lead = cs.leading_system(messages)
    previous_cut, dropped = lead, set()
    for k, result in enumerate(replay(messages, budget, keep_last, ratio), lead + 1):
        cut = result["kept_from_index"]
        assert cut >= previous_cut, f"P3: at {k} messages the cut moved back from {previous_cut} to {cut}"
        kept = set(checks.sources(messages[:k], result))
        assert not dropped & kept, f"P3: messages {sorted(dropped & kept)} came back at {k} messages"
        dropped |= set(range(lead, cut)) - kept
        previous_cut = cut


def prefix_changed(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    """True when the earlier request is not a prefix of the later one (a server's prompt cache is lost there)."""
    if len(after) < len(before):
        return True
    return any(
        json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True) for a, b in zip(before, after, strict=False)
    )


@pytest.mark.slow
@REPLAY
@given(cases(max_budget=8192), keep_lasts)
def test_p4_stable_requests_change_once_per_grid_step(case: Case, keep_last: int) -> None:
    messages, budget = case.build()[:REPLAY_LENGTH], case.budget
    results = replay(messages, budget, keep_last, STABLE_RATIO)
    # the share is of the room the leading messages leave (no cut can shrink them), so the step is too
    fixed = cs.count_messages(messages[: cs.leading_system(messages)], TOK)[1]
    step = max(1, int((1 - STABLE_RATIO) * (budget - fixed)))
    changes, growth, over = 0, 0, False
    for k, (a, b) in enumerate(itertools.pairwise(results), 1):
        over = over or b["tokens_before"] > budget
        if over:
            growth += size(messages[cs.leading_system(messages) + k])
            # a request that cannot fit is refused whatever its bytes: only changes between sendable ones count
            changes += a["fits"] and b["fits"] and prefix_changed(a["messages"], b["messages"])
    assert changes <= growth // step + 2, f"P4: {changes} prefix changes over {growth} tokens of growth (step {step})"


def remembered_then_fresh(
    messages: list[dict[str, Any]], budget: int, keep_last: int, hold: bool
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every prefix shrunk in order as an agent resends it (the replay remembered and resumed), each beside the
    same prefix shrunk with nothing remembered; both on fresh copies, as a server parses each request."""
    lead, pairs = cs.leading_system(messages), []
    cs.REPLAYS.clear()

    def shrunk(k: int) -> dict[str, Any]:
        prefix = json.loads(json.dumps(messages[:k]))
        keep_from = cs.turn_in_progress(prefix) if hold else None
        return cs.trim_messages(prefix, TOK, budget, keep_last=keep_last, target_ratio=STABLE_RATIO,
                                keep_from=keep_from)  # fmt: skip

    remembered = [shrunk(k) for k in range(lead + 1, len(messages) + 1)]
    for k, result in enumerate(remembered, lead + 1):
        cs.REPLAYS.clear()
        pairs.append((result, shrunk(k)))
    return pairs


def test_a_remembered_replay_is_resumed() -> None:
    """The next turn goes on from where the previous call's replay stopped (it is not replayed from the start)."""
    messages = agent_history(7, 4096, "codex", 2.0)
    resumed: list[Any] = []
    real = cs.REPLAYS.resume
    cs.REPLAYS.clear()
    try:
        cs.REPLAYS.resume = lambda replay: resumed.append(real(replay)) or resumed[-1]  # type: ignore[method-assign]
        for k in (len(messages) - 2, len(messages)):
            trim(json.loads(json.dumps(messages[:k])), 4096, 8, STABLE_RATIO)
    finally:
        del cs.REPLAYS.resume
    assert resumed[0] is None and resumed[1].k == len(messages) - 2


@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_budget=8192), keep_lasts, st.booleans())
def test_p7_a_resumed_replay_is_the_replay(case: Case, keep_last: int, hold: bool) -> None:
    """Remembering the stable replay between calls changes no byte of any request (the turn in progress held
    or not: past a held cut the replay depends on the whole history, and is not resumed there)."""
    messages = case.build()[:40]
    for k, (remembered, fresh) in enumerate(remembered_then_fresh(messages, case.budget, keep_last, hold)):
        assert remembered == fresh, f"P7: the request for prefix {k} differs once its replay was resumed"


@pytest.mark.slow
@REPLAY
@given(cases(max_budget=8192), keep_lasts, st.booleans())
def test_p7_a_resumed_replay_is_the_replay_on_long_histories(case: Case, keep_last: int, hold: bool) -> None:
    messages = case.build()[:REPLAY_LENGTH]
    for k, (remembered, fresh) in enumerate(remembered_then_fresh(messages, case.budget, keep_last, hold)):
        assert remembered == fresh, f"P7: the request for prefix {k} differs once its replay was resumed"


@pytest.mark.parametrize("shape", ["codex", "claude", "tau", "giant_before_question", "mixed"])
def test_every_shape_is_generated_and_shrinks(shape: str) -> None:
    for seed in range(5):
        messages = agent_history(seed, 8192, shape)
        assert cs.validate_messages(messages) and not cs.api_problems(messages)
        result = trim(messages, 8192, 8, 1.0)
        check_honest(messages, result)
