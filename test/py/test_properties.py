"""Property tests: trimming and compaction keep their invariants on generated conversations."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from checks import check_trim
from hypothesis import given, settings
from hypothesis import strategies as st

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": draw(text)} for _ in range(draw(st.integers(0, 2)))]
    call_no = 0
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["user", "user_parts", "assistant", "tools"]))
        if kind == "user":
            messages.append({"role": "user", "content": draw(text), **draw(st.sampled_from([{}, {"name": "bob"}]))})
        elif kind == "user_parts":
            parts: list[dict[str, Any]] = [{"type": "text", "text": draw(text)}]
            if draw(st.booleans()):
                parts.append(
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
                )
            messages.append({"role": "user", "content": parts})
        elif kind == "assistant":
            messages.append({"role": "assistant", "content": draw(text), "x-extra": {"kept": True}})
        else:
            ids = [f"call_{call_no + k}" for k in range(draw(st.integers(1, 3)))]
            call_no += len(ids)
            messages.append(
                {
                    "role": "assistant",
                    "content": draw(st.one_of(st.none(), text)),
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": "run", "arguments": '{"x": 1}'}} for i in ids
                    ],
                }
            )
            messages += [{"role": "tool", "tool_call_id": i, "content": draw(text)} for i in ids]
    return messages


def index_of(messages: list[dict[str, Any]], item: dict[str, Any]) -> int:
    return next(i for i, m in enumerate(messages) if m is item)


@settings(max_examples=300, deadline=None)
@given(
    conversations(),
    st.integers(1, 3000),
    st.integers(0, 10),
    st.sampled_from(["auto", "drop"]),
    st.booleans(),
    st.booleans(),
)
def test_trim_invariants(
    messages: list[dict[str, Any]], budget: int, keep_last: int, strategy: str, start_on_user: bool, alternate: bool
) -> None:
    kwargs = {"keep_last": keep_last, "strategy": strategy, "start_on_user": start_on_user}
    if alternate:
        result = cs.trim_messages(messages, cs.HEURISTIC, budget, alternate_roles=True, **kwargs)
        out = result["messages"]
        assert cs.api_problems(out) == []
        assert all(a["role"] != b["role"] or a.get("tool_calls") or b.get("tool_calls") or a["role"] in cs.RESULT_ROLES
                   for a, b in itertools.pairwise(out))  # fmt: skip
        assert result["tokens_after"] == cs.count_messages(out, cs.HEURISTIC)[1]
    else:
        check_trim(messages, cs.HEURISTIC, budget, **kwargs)


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(0, 10), st.sampled_from(["system", "user"]))
def test_compact_invariants(messages: list[dict[str, Any]], keep_last: int, role: str) -> None:
    result = cs.compact_messages(
        messages, cs.HEURISTIC, summary="summary", max_context_tokens=10, keep_last=keep_last, summary_role=role
    )
    out = result["messages"]
    assert cs.api_problems(out) == []
    if result["compacted"]:
        lead = cs.leading_system(messages)
        assert out[:lead] == messages[:lead] and out[lead]["role"] == role
        kept = out[lead + 1 :]
        positions = [index_of(messages, m) for m in kept]
        assert positions == sorted(positions)
        users = [m for m in messages if m["role"] == "user"]
        if users:
            assert any(m is users[-1] for m in out)
            if role == "system":
                assert next(m for m in out if m["role"] not in cs.SYSTEM_ROLES)["role"] == "user"
        assert result["tokens_after"] == cs.count_messages(out, cs.HEURISTIC)[1]
    else:
        assert out == messages


@settings(max_examples=200, deadline=None)
@given(conversations(), st.integers(0, 10), st.integers(10, 3000), st.booleans(), st.data())
def test_compaction_keeps_a_tail_only_where_the_store_can(
    messages: list[dict[str, Any]], keep_last: int, window: int, force: bool, data: st.DataObject
) -> None:
    """With ``tail_starts`` (an OpenCode session: only a contiguous newest run can be kept), the compacted
    history is the leading system messages, the summary and ``messages[end:]`` with ``end`` one of the
    allowed starts (or nothing kept), never a pinned message ahead of it, and never a longer tail than the
    unconstrained plan keeps (so it fits wherever that fits)."""
    starts = data.draw(st.sets(st.integers(0, len(messages))))
    common = {"summary": "summary", "max_context_tokens": window, "keep_last": keep_last, "force": force}
    free = cs.compact_messages(messages, cs.HEURISTIC, **common)
    bound = cs.compact_messages(messages, cs.HEURISTIC, tail_starts=starts, **common)
    assert bound["pinned_indices"] == [] and bound["summarize_from_index"] == free["summarize_from_index"]
    end = bound["kept_from_index"]
    assert end >= free["kept_from_index"] and (end in starts or end == len(messages))
    assert end == len(messages) or messages[end]["role"] not in cs.RESULT_ROLES  # never a result without its call
    if bound["compacted"]:
        lead = cs.leading_system(messages)
        out = bound["messages"]
        assert out[:lead] == messages[:lead] and out[lead + 1 :] == messages[end:]
        assert cs.api_problems(messages[end:]) == [] or cs.api_problems(messages) != []
    else:
        assert bound["messages"] == messages
