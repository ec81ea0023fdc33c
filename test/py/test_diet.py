"""The verbatim diet: stages, the verbatim guarantee, manifest arithmetic, protected lines, checks, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import assistant, tool, user
from checks import check_trim
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp_calls import call, error, ok, run

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

MARKER = cs.diet_marker(7).replace("7", "")


def is_marker(line: str) -> bool:
    return line.startswith("[… ") and line.endswith(" cut …]")


def assert_verbatim(text: str, result: dict[str, Any]) -> None:
    """Every output line is an input line, unchanged and in order; markers stand for the gaps."""
    lines = text.split("\n")
    at = 0
    for line in result["text"].split("\n"):
        if is_marker(line):
            continue
        while at < len(lines) and lines[at] != line:
            at += 1
        assert at < len(lines), f"not an input line, or out of order: {line!r}"
        at += 1
    for stage in result["stages"]:
        assert stage["lines_kept"] + stage["lines_removed"] >= 0
    assert result["verbatim"] is True


def manifest_adds_up(text: str, result: dict[str, Any], tok: cs.Tokenizer) -> None:
    lines = text.split("\n")
    previous = {
        "lines": len(lines),
        "bytes": sum(len(x.encode()) + 1 for x in lines),
        "tokens": sum(tok.count(x) for x in lines),
    }
    for stage in result["stages"]:
        for unit in ("lines", "bytes", "tokens"):
            assert stage[f"{unit}_kept"] + stage[f"{unit}_removed"] == previous[unit], (stage["stage"], unit)
            previous[unit] = stage[f"{unit}_kept"]
    assert previous["lines"] == result["output"]["lines"]


LOG = "\n".join(
    [
        "collecting ... collected 4 items",
        "test_a.py::test_one PASSED",
        "Retrying connection to 127.0.0.1:8080 (attempt 1)",
        "Retrying connection to 127.0.0.1:8080 (attempt 1)",
        "Retrying connection to 127.0.0.1:8080 (attempt 1)",
        "Traceback (most recent call last):",
        '  File "src/app.py", line 10, in main',
        "    run()",
        "ValueError: bad value at <object Foo at 0x7f3a2b10>",
        "Traceback (most recent call last):",
        '  File "src/app.py", line 10, in main',
        "    run()",
        "ValueError: bad value at <object Foo at 0x7f3a9c44>",
        "worker 4711 started at 2026-11-30T12:00:01 id deadbeef",
        "worker 4712 started at 2026-11-30T12:00:02 id deadbef0",
        "}",
        "}",
        "test_a.py::test_two FAILED",
        "done",
    ]
)


@pytest.fixture(scope="module")
def tok() -> cs.Tokenizer:
    return cs.resolve_tokenizer("tiktoken:cl100k_base")


def test_dedupe_blocks_lines_and_near_duplicates(tok: cs.Tokenizer) -> None:
    result = cs.shrink_text(LOG, tok)
    out = result["text"].split("\n")
    assert out.count("Retrying connection to 127.0.0.1:8080 (attempt 1)") == 1
    assert out.count("Traceback (most recent call last):") == 1  # the repeated block went as one
    assert "ValueError: bad value at <object Foo at 0x7f3a9c44>" not in out  # differs only in 0x...: near-dup
    assert "worker 4712 started at 2026-11-30T12:00:02 id deadbef0" in out  # PIDs, times, bare hex stay
    assert out.count("}") == 2  # structure lines are never deduplicated
    stages = {s["stage"]: s for s in result["stages"]}
    assert stages["dedupe_blocks"]["lines_removed"] == 3 and stages["dedupe_blocks"]["repeated"][0]["first_line"] == 6
    assert stages["dedupe_lines"]["lines_removed"] == 2
    assert stages["dedupe_lines"]["repeated"] == [
        {"first_line": 3, "text": "Retrying connection to 127.0.0.1:8080 (attempt 1)", "repeats": 2}
    ]
    assert stages["near_duplicates"]["lines_removed"] == 1
    assert_verbatim(LOG, result)
    manifest_adds_up(LOG, result, tok)


def test_exact_only_keeps_near_duplicates(tok: cs.Tokenizer) -> None:
    result = cs.shrink_text(LOG, tok, exact_only=True)
    assert "ValueError: bad value at <object Foo at 0x7f3a9c44>" in result["text"]
    assert "near_duplicates" not in [s["stage"] for s in result["stages"]]


def test_gaps_are_marked_with_their_size(tok: cs.Tokenizer) -> None:
    out = cs.shrink_text(LOG, tok)["text"].split("\n")
    # the repeated traceback block and its near-duplicate last line went together
    assert "[… 2 lines cut …]" in out and "[… 4 lines cut …]" in out
    assert cs.diet_marker(1) == "[… 1 line cut …]"


def test_extract_by_query_with_merged_context(tok: cs.Tokenizer) -> None:
    text = "\n".join(f"line {k}" + (" needle" if k in (10, 12, 40) else "") for k in range(60))
    result = cs.shrink_text(text, tok, query="NEEDLE")
    out = [x for x in result["text"].split("\n") if not is_marker(x)]
    assert out == [f"line {k}" + (" needle" if k in (10, 12, 40) else "") for k in [*range(8, 15), *range(38, 43)]]
    stage = result["stages"][-1]
    assert stage["stage"] == "extract" and stage["hits"] == 3 and stage["terms"] == ["needle"]
    assert_verbatim(text, result)
    manifest_adds_up(text, result, tok)
    with pytest.raises(cs.ContextShrinkError, match="query"):
        cs.shrink_text(text, tok, query="!")


def test_extractive_summary_keeps_errors_head_and_tail(tok: cs.Tokenizer) -> None:
    text = "\n".join(
        [f"ok {k}" for k in range(100)] + ["boom: fatal error here"] + [f"ok {k}" for k in range(100, 200)]
    )
    result = cs.shrink_text(text, tok, stages=("summary",))
    out = [x for x in result["text"].split("\n") if not is_marker(x)]
    assert out[:10] == [f"ok {k}" for k in range(10)] and out[-20:] == [f"ok {k}" for k in range(180, 200)]
    assert "boom: fatal error here" in out and "ok 99" in out and "ok 100" in out
    assert result["stages"][0]["error_lines"] == 1


def test_pack_priorities_and_budget(tok: cs.Tokenizer) -> None:
    body = [f"progress line number {k} of the build" for k in range(400)]
    body[50] = "error: linker failed for target app"
    body[300] = "deploying release candidate to staging"
    body[350] = "KEEP-ME build id 42"
    text = "\n".join(body)
    result = cs.shrink_text(text, tok, budget=300, query="staging", protect=["KEEP-ME"])
    assert result["output"]["tokens"] <= 300
    out = result["text"].split("\n")
    assert "KEEP-ME build id 42" in out and "error: linker failed for target app" in out
    assert "deploying release candidate to staging" in out
    pack = result["stages"][-1]
    assert pack["stage"] == "pack" and pack["protected_kept"] == 1 and pack["protected_missing"] == []
    assert result["protected"] == {"kept": ["KEEP-ME"], "missing": []}
    assert_verbatim(text, result)
    manifest_adds_up(text, result, tok)


def test_protected_lines_over_the_budget(tok: cs.Tokenizer) -> None:
    text = "\n".join(f"PROTECTED line {k} with some words in it" for k in range(30))
    with pytest.raises(cs.ContextShrinkError) as info:
        cs.shrink_text(text, tok, budget=50, protect=["PROTECTED"])
    message = str(info.value)
    assert "30 protected lines" in message and all(f"PROTECTED line {k} " in message for k in range(30))
    result = cs.shrink_text(text, tok, budget=50, protect=["PROTECTED"], on_overflow="partial")
    assert result["stages"][-1]["shortfall"] > 0 and result["output"]["lines"] == 30
    assert result["protected"]["kept"] == ["PROTECTED"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.sampled_from(["alpha", "beta 0x1f", "beta 0x2e", "}", "", "error: x", "gamma delta", "ok"]), max_size=80
    ),
    st.one_of(st.none(), st.integers(1, 200)),
    st.one_of(st.none(), st.sampled_from(["alpha", "gamma"])),
    st.booleans(),
)
def test_every_output_line_is_an_input_line(
    lines: list[str], budget: int | None, query: str | None, exact: bool
) -> None:
    tok = cs.HEURISTIC
    text = "\n".join(lines)
    result = cs.shrink_text(text, tok, budget=budget, query=query, exact_only=exact, on_overflow="partial")
    assert_verbatim(text, result)
    manifest_adds_up(text, result, tok)
    if budget is not None:
        assert result["output"]["lines"] == 0 or sum(tok.count(x) + 1 for x in result["text"].split("\n")) <= budget


# --------------------------------------------------------------------------- completeness check

RUN = "\n".join(
    [
        "tests/test_a.py::test_parse PASSED",
        "tests/test_a.py::test_parse_errors FAILED",
        "tests/test_b.py::test_tokens ok",
        "collected test_render but it did not run",
        "tests/test_b.py::test_render PASSED",
    ]
)


def test_check_found_and_missing() -> None:
    result = cs.check_text(RUN, ["test_parse", "test_tokens", "test_missing"])
    assert [i["status"] for i in result["items"]] == ["found", "found", "missing"]
    assert result["items"][0]["evidence"] == "tests/test_a.py::test_parse PASSED"
    assert result["survived"] is False


def test_check_marker_mode() -> None:
    plan = ["test_parse_errors", "test_tokens", "test_render", "test_slow", "test_missing"]
    result = cs.check_text(RUN, plan, markers=["PASSED", "ok"], fail_markers=["FAILED"], skipped=["test_slow"])
    statuses = {i["item"]: i["status"] for i in result["items"]}
    assert statuses == {
        "test_parse_errors": "failed",
        "test_tokens": "passed",
        "test_render": "passed",  # the unmarked mention does not count; the marked line does
        "test_slow": "skipped",
        "test_missing": "missing",
    }
    assert result["counts"] == {"failed": 1, "passed": 2, "skipped": 1, "missing": 1}
    assert not result["survived"]
    assert cs.check_text("test_x token", ["test_x"], markers=["ok"])["items"][0]["status"] == "missing"  # word bounds
    assert cs.check_text(RUN, ["test_parse"], markers=["PASSED"], fail_markers=["FAILED"])["survived"]


def test_check_is_case_sensitive_and_validates_the_plan() -> None:
    assert cs.check_text(RUN, ["TEST_PARSE"])["items"][0]["status"] == "missing"
    with pytest.raises(cs.ContextShrinkError, match="plan"):
        cs.check_text(RUN, "test_parse")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- tools, limits and the CLI


def test_shrink_and_check_tools(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", max_text_lines=1000, max_text_bytes=20_000))
    (tmp_path / "build.log").write_text(LOG)
    result = ok(run(call(server, "shrink_text", {"path": "build.log"})))
    assert result["verbatim"] and result["output"]["lines"] < result["input"]["lines"]
    checked = ok(run(call(server, "check_text", {"plan": ["test_one", "test_two"], "path": "build.log"})))
    assert checked["survived"]
    assert "give exactly one of text or path" in error(run(call(server, "shrink_text", {})))
    assert "over the limit of 1,000 (CONTEXT_SHRINK_MAX_TEXT_LINES)" in error(
        run(call(server, "shrink_text", {"text": "x\n" * 2000}))
    )
    assert "over the limit of 20,000" in error(run(call(server, "shrink_text", {"text": "x" * 30_000})))
    assert "outside the allowed root" in error(run(call(server, "check_text", {"plan": ["a"], "path": "../x"})))


def cli(*args: str, stdin: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "context_shrink.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )


def test_cli_subcommands_and_exit_codes(tmp_path: Path) -> None:
    (tmp_path / "run.log").write_text(RUN)
    (tmp_path / "plan.txt").write_text("test_parse\ntest_tokens\n")
    (tmp_path / "bad-plan.txt").write_text("test_parse_errors\n")
    good = cli("check", "--input", "run.log", "--plan", "plan.txt", "--markers", "PASSED", "ok", cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "passed   test_parse  <- tests/test_a.py::test_parse PASSED" in good.stdout
    failed = cli(
        "check",
        "--input",
        "run.log",
        "--plan",
        "bad-plan.txt",
        "--markers",
        "PASSED",
        "--fail-markers",
        "FAILED",
        cwd=tmp_path,
    )
    assert failed.returncode == 1 and "failed   test_parse_errors" in failed.stdout
    missing = cli("check", "--input", "run.log", "--plan", "plan.txt", "--json", "--markers", "nope", cwd=tmp_path)
    assert missing.returncode == 1 and json.loads(missing.stdout)["survived"] is False
    deduped = cli("dedupe", stdin=LOG, cwd=tmp_path)
    assert deduped.returncode == 0 and deduped.stdout.count("Traceback") == 1 and "->" in deduped.stderr
    packed = cli("pack", "--budget", "40", "--json", stdin=LOG, cwd=tmp_path)
    assert packed.returncode == 0 and json.loads(packed.stdout)["output"]["tokens"] <= 40
    counted = cli("count", "--json", stdin="hello world", cwd=tmp_path)
    assert json.loads(counted.stdout)["tokens"] == 2
    outside = cli("count", "--input", "/etc/hostname", cwd=tmp_path)
    assert outside.returncode == 2 and "outside the allowed root" in outside.stderr
    assert cli("extract", stdin=LOG, cwd=tmp_path).returncode == 2  # --query is required


# --------------------------------------------------------------------------- as a stage of trimming and compaction


def logging_session() -> list[dict[str, Any]]:
    noisy = "\n".join(["Retrying request to the backend after a timeout of 30 seconds"] * 200 + ["done"])
    messages = [{"role": "system", "content": "s"}, user("run the build")]
    for k in range(4):
        messages += [assistant(None, f"c{k}"), tool(f"c{k}", noisy + f" {k}")]
    return [*messages, user("and now?")]


def test_trim_diets_tool_results_first(tok: cs.Tokenizer) -> None:
    messages = logging_session()
    total = cs.count_messages(messages, tok)[1]
    result = check_trim(messages, tok, total, diet_tool_results=True)
    assert result["diet"]["messages"] == 4 and result["diet"]["tokens_saved"] > 0.9 * total
    assert result["tiers"][0]["tier"] == "diet" and result["dropped"] == 0
    assert result["tokens_before"] == total and result["tokens_after"] < 0.1 * total


def test_a_result_resent_every_turn_is_dieted_once(tok: cs.Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy diets every request's history: each large result is worked out once, then looked up (it
    cost 90 % of a repeated request's time at 234k tokens), with the same bytes as a fresh diet."""
    calls: list[int] = []
    real = cs.dedupe_lines
    monkeypatch.setattr(cs, "dedupe_lines", lambda *a, **k: calls.append(1) or real(*a, **k))
    messages = [{**m, "content": f"{m['content']} {id(calls)}"} if m["role"] == "tool" else m
                for m in logging_session()]  # fmt: skip
    first = cs.diet_results(messages, tok)
    again = cs.diet_results(json.loads(json.dumps(messages)), tok)  # the next request: equal, not the same objects
    assert len(calls) == 4 and first == again and first[1]["messages"] == 4
    assert [cs.dieted_text(m["content"]) for m in messages[3::2]] == [m["content"] for m in first[0][3::2]]


def test_compact_reports_the_diet(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    arguments = {
        "messages": logging_session(),
        "diet_tool_results": True,
        "summary": "- built",
        "force": True,
        "keep_last": 2,
    }
    result = ok(run(call(server, "compact_context", arguments)))
    assert result["diet"]["messages"] == 4 and result["compacted"]
    total = cs.count_messages(logging_session(), cs.resolve_tokenizer("tiktoken"))[1]
    assert result["tokens_before"] == total > 5 * result["tokens_after"]
