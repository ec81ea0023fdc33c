"""The coding agents' own sessions as sources (#20, reading): Claude Code's JSONL, Codex CLI's rollout and
OpenCode's SQLite database read into the chat view of what the model is sent next turn.

Small stores written here check the rules (the chain, compaction boundaries, per-block records, the
replacement history, the summary message, unreadable lines, access); sessions made by the real agents
(test_agents.py's scripted model, three tool calls each) check the view against the request each agent
actually sent last."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import agents
import anyio
import pytest
from agent_upstream import request_view
from agents import binary, run_session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from stores import claude_store, environ, opencode_store, plain, write_jsonl

import context_shrink as cs
import context_shrink_sessions as css


def test_a_claude_code_session(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x")
    found = css.read_session("claude:latest", ["claude"], Path("/x"), environ(tmp_path))
    assert found.id == "s1" and found.cwd == "/x" and found.skipped_lines == 1 and not found.compacted
    assert found.messages == [
        {"role": "user", "content": "fix it"},
        {"role": "system", "content": "<system-reminder>cwd: /x</system-reminder>"},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "print(1)"},
        {"role": "assistant", "content": "Done."},
    ]  # fmt: skip
    assert found.sources[2] == ["r1", "r2"]  # one response, two block records
    assert found.bookkeeping["api-request"] == 1 and found.bookkeeping["queue-operation"] == 1
    assert found.bookkeeping["attachment (prompt_snapshot)"] == 1


def claude_parallel_store(home: Path, results_written: list[int]) -> Path:
    """Claude Code's records for one response with three parallel reads, as it writes them: the three calls as
    chained assistant records of one ``message.id``, each result a child of its own call's record (written in
    the order ``results_written``), then the answer as a child of the result written last."""
    base = {"sessionId": "s1", "cwd": "/x"}
    records: list[Any] = [{**base, "type": "user", "uuid": "u1", "parentUuid": None,
                           "message": {"role": "user", "content": "read the three files"}}]  # fmt: skip
    parent = "u1"
    for k in range(3):
        use = {"type": "tool_use", "id": f"tu{k}", "name": "Read", "input": {"file_path": f"f{k}.py"}}
        records.append({**base, "type": "assistant", "uuid": f"r{k}", "parentUuid": parent,
                        "message": {"id": "msg_1", "role": "assistant", "content": [use]}})  # fmt: skip
        parent = f"r{k}"
    for k in results_written:
        result = {"type": "tool_result", "tool_use_id": f"tu{k}", "content": f"contents of f{k}"}
        records.append({**base, "type": "user", "uuid": f"t{k}", "parentUuid": f"r{k}",
                        "message": {"role": "user", "content": [result]}})  # fmt: skip
    records.append(
        {
            **base,
            "type": "assistant",
            "uuid": "a",
            "parentUuid": f"t{results_written[-1]}",
            "message": {"id": "msg_2", "role": "assistant", "content": [{"type": "text", "text": "Read."}]},
        }
    )
    return write_jsonl(home / ".claude" / "projects" / "-x" / "s1.jsonl", records)


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_claude_code_parallel_calls_are_read_as_claude_code_sends_them(order: list[int], tmp_path: Path) -> None:
    """All three results, in call order, after the one response that made the calls; not compacted."""
    claude_parallel_store(tmp_path, order)
    found = css.read_session("claude:latest", ["claude"], Path("/x"), environ(tmp_path))
    roles = [m["role"] for m in found.messages]
    assert roles == ["user", "assistant", "tool", "tool", "tool", "assistant"] and not found.compacted
    assert [c["id"] for c in found.messages[1]["tool_calls"]] == ["tu0", "tu1", "tu2"]
    assert [m["tool_call_id"] for m in found.messages[2:5]] == ["tu0", "tu1", "tu2"]
    assert [m["content"] for m in found.messages[2:5]] == ["contents of f0", "contents of f1", "contents of f2"]
    assert found.sources[1] == ["r0", "r1", "r2"] and cs.api_problems(found.messages) == []


@pytest.mark.parametrize("agent", list(css.AGENT_STORES))
def test_a_session_result_says_what_the_agent_adds_on_top(agent: str) -> None:
    """Each store's measured fixed part is the README's (checked against the real agent in test_agents.py)."""
    store = css.AGENT_STORES[agent]
    assert agents.readme_fixed_parts()[agent][0] == store.fixed_tokens and store.release in agents.README.read_text()


def test_a_trimmed_session_says_whether_the_agents_request_will_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in environ(tmp_path).items():
        monkeypatch.setenv(key, value)
    claude_store(tmp_path, str(tmp_path))
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", session_stores=("claude",)))

    async def trim() -> Any:
        async with Client(server) as client:
            return await client.call_tool("trim_context", {"session": "claude:latest", "max_context_tokens": 4000})

    session = anyio.run(trim).structured_content["session"]
    assert session["agent_adds"]["tokens"] == 11_100 and session["fits_with_agent"] is False  # 4,000 < 11,100


def test_after_a_claude_code_compaction_only_the_summary_and_what_follows(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x", compacted=True)
    found = css.read_session("claude:s1", ["claude"], Path("/elsewhere"), environ(tmp_path))
    assert found.compacted and found.messages[0] == {
        "role": "user",
        "content": "Summary: the old question was answered.",
    }
    assert all("old question" not in str(m["content"]) for m in found.messages[1:])


def test_a_codex_rollout_and_its_compaction(tmp_path: Path) -> None:
    meta = {
        "type": "session_meta",
        "payload": {"id": "c1", "cwd": "/x", "base_instructions": {"text": "You are Codex."}},
    }
    call = {"type": "function_call", "call_id": "k1", "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    out = {"type": "function_call_output", "call_id": "k1", "output": "a.py"}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
    patch = {"type": "custom_tool_call", "call_id": "k2", "name": "apply_patch", "input": "*** Begin Patch"}
    patched = {"type": "custom_tool_call_output", "call_id": "k2", "output": "Success"}
    items = [user, call, out, patch, patched]
    path = tmp_path / ".codex" / "sessions" / "2026" / "12" / "01" / "rollout-2026-12-01T00-00-00-c1.jsonl"
    records = [meta, *({"type": "response_item", "payload": i} for i in items), {"type": "event_msg", "payload": {}}]
    write_jsonl(path, records)
    found = css.read_session("codex:latest", ["codex"], Path("/x"), environ(tmp_path))
    kinds = [cs.message_kind(m) for m in found.messages]
    assert kinds == ["user", "tool_call", "tool_result", "tool_call", "tool_result"] and found.sources[1] == ["line 3"]
    assert found.messages[3]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": "*** Begin Patch"}
    assert found.bookkeeping == {"session_meta": 1, "event_msg": 1}
    summary = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Summary so far."}]}
    compaction = {"type": "compacted", "payload": {"message": "", "replacement_history": [summary]}}
    write_jsonl(path, [*records, compaction, {"type": "response_item", "payload": user}])
    again = css.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path))
    assert again.compacted and [plain(m["content"]) for m in again.messages] == [
        "Summary so far.", "list the files"]  # fmt: skip
    assert again.sources[0] == ["line 8 replacement_history[0]"]


@st.composite
def opencode_rows(draw: st.DrawFn) -> list[Any]:
    """OpenCode sessions of any shape: prompts, answers, steps with tool parts, synthetic prompts,
    compactions answered by a summary or not (yet), with a kept tail named anywhere before them or none."""
    rows: list[Any] = []
    for k in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["user", "synthetic", "text", "tools", "compaction", "pending"]))
        mid = f"m{k:02}"
        if kind == "user":
            rows.append((mid, {"role": "user"}, [(f"{mid}p", {"type": "text", "text": f"ask {k}"})]))
        elif kind == "synthetic":  # as OpenCode adds after its own compaction
            go_on = {"type": "text", "text": "Continue", "synthetic": True, "metadata": {"compaction_continue": True}}
            rows.append((mid, {"role": "user"}, [(f"{mid}p", go_on)]))
        elif kind == "text":
            said = {"type": "text", "text": f"said {k}"}
            rows.append((mid, {"role": "assistant", "finish": "stop"}, [(f"{mid}p", said)]))
        elif kind == "tools":
            parts = [(f"{mid}p{j}", {"type": "tool", "callID": f"c{k}_{j}", "tool": "read", "state": {
                      "status": "completed", "input": {"n": j}, "output": f"out {k} {j}"}})
                     for j in range(draw(st.integers(1, 2)))]  # fmt: skip
            step = (f"{mid}s", {"type": "step-start"})
            rows.append((mid, {"role": "assistant", "finish": "tool-calls"}, [step, *parts]))
        else:
            tail = draw(st.sampled_from([None, *[r[0] for r in rows]]))
            mark = {"type": "compaction", "auto": True, **({"tail_start_id": tail} if tail else {})}
            rows.append((mid, {"role": "user"}, [(f"{mid}p", mark)]))
            if kind == "compaction":
                summary = {"role": "assistant", "summary": True, "finish": "stop", "parentID": mid}
                rows.append((f"{mid}s", summary, [(f"{mid}sp", {"type": "text", "text": f"summary {k}"})]))
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(opencode_rows(), st.data())
def test_an_opencode_compaction_keeps_exactly_the_tail_it_names(
    tmp_path_factory: pytest.TempPathFactory, rows: list[Any], data: st.DataObject
) -> None:
    """Any OpenCode session, compacted with the tail starting at any place the reader allows (or none kept):
    read back as OpenCode sends it, it is OpenCode's question, the summary and exactly that tail; the event
    log replays to the rows."""
    home = tmp_path_factory.mktemp("opencode")
    path = opencode_store(home, "/x", rows)
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(home))
    start = data.draw(st.sampled_from([*(s for s in found.tail_starts if s > 0), len(found.messages)]))
    summary = {"role": "system", "content": f"{cs.SUMMARY_MARKER} Summary of {start} earlier messages:\nall of it"}
    kept = found.messages[start:]
    css.write_session(found, [summary, *kept], dry_run=False, now=later(found))
    again = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(home))
    assert [(m["role"], m["content"]) for m in again.messages[:2]] == [("user", "What did we do so far?"),
                                                                       ("assistant", summary["content"])]  # fmt: skip
    assert again.messages[2:] == kept and again.compacted
    with sqlite3.connect(path) as db:
        assert replayed(db) == rows_of(db)


def test_an_opencode_session_from_its_last_compaction(tmp_path: Path) -> None:
    opencode_store(tmp_path, "/x")
    found = css.read_session("opencode:latest", ["opencode"], Path("/x"), environ(tmp_path))
    seen = [(m["role"], plain(m.get("content"))) for m in found.messages]
    expected = [("user", "What did we do so far?"), ("assistant", "Summary: answered."), ("user", "read a.py"),
                ("assistant", "It prints 1."), ("tool", "print(1)")]  # fmt: skip
    assert found.compacted and seen == expected
    assert found.messages[3]["tool_calls"][0]["function"]["arguments"] == '{"filePath":"a.py"}'
    assert found.sources[4] == ["message m4", "part p5"] and found.bookkeeping["part (step-start)"] == 1


def test_sessions_are_reachable_only_when_allowed(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x")
    with pytest.raises(cs.ContextShrinkError, match="CONTEXT_SHRINK_SESSION_STORES=claude"):
        css.read_session("claude:latest", ["codex"], Path("/x"), environ(tmp_path))
    for bad in ("claude", "gemini:1", "claude:../../etc/passwd", "claude:" + "x" * 300):
        with pytest.raises(cs.ContextShrinkError, match="session must be"):
            css.read_session(bad, ["claude"], Path("/x"), environ(tmp_path))
    with pytest.raises(cs.ContextShrinkError, match="no claude session ran in /y"):
        css.read_session("claude:latest", ["claude"], Path("/y"), environ(tmp_path))
    with pytest.raises(cs.ConfigError, match="unknown agents"):
        cs.Config.from_env({"CONTEXT_SHRINK_SESSION_STORES": "claude,gemini"})
    assert cs.Config.from_env({"CONTEXT_SHRINK_SESSION_STORES": "codex, claude"}).session_stores == ("codex", "claude")


def test_the_tools_read_a_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in environ(tmp_path).items():
        monkeypatch.setenv(key, value)
    claude_store(tmp_path, str(tmp_path))
    allowed = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", session_stores=("claude",)))
    closed = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))

    async def go() -> list[Any]:
        async with Client(allowed) as a, Client(closed) as c:
            return [
                await a.call_tool("list_sessions", {}),
                await a.call_tool("analyze_context", {"session": "claude:latest"}),
                await a.call_tool("estimate_context", {"session": "claude:s1", "messages": []}),
                await c.call_tool("list_sessions", {}),
                await c.call_tool("estimate_context", {"session": "claude:s1"}),
            ]

    listed, analyzed, both, closed_list, closed_read = anyio.run(go)
    assert listed.structured_content["sessions"][0]["session"] == "claude:s1"
    report = analyzed.structured_content
    assert report["message_count"] == 5 and report["session"]["session"] == "claude:s1"
    assert report["session"]["unsent_records"]["api-request"] == 1 and report["session"]["unreadable_lines"] == 1
    ids = [line.split()[0] for line in report["lines"]]
    assert report["session"]["sources"][ids[2]] == ["r1", "r2"]
    assert both.is_error and "give one of messages, messages_path or session" in both.content[0].text
    assert closed_list.is_error and "CONTEXT_SHRINK_SESSION_STORES" in closed_list.content[0].text
    assert closed_read.is_error and "CONTEXT_SHRINK_SESSION_STORES=claude" in closed_read.content[0].text


def store_text(agent: str, home: Path, path: Path) -> str:
    """Everything the agent's store holds for a session, as text: the JSONL file, and for SQLite stores
    (OpenCode's database, Codex's thread index) every text column of every table."""
    databases = [path] if agent == "opencode" else list((home / ".codex").glob("thread_history_*.sqlite"))
    texts = [] if agent == "opencode" else [path.read_text()]
    for database in databases:
        with sqlite3.connect(database) as db:
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                for row in db.execute(f'SELECT * FROM "{table}"').fetchall():
                    texts += [str(value) for value in row]
    return "\n".join(texts)


def signature(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each message's kind and text (its tool calls for an assistant): what both sides must agree on."""
    return [(cs.message_kind(m), json.dumps(m.get("tool_calls")) if m.get("tool_calls") else
             plain(m.get("content")).strip()) for m in messages]  # fmt: skip


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_real_agents_session_reads_as_the_request_it_sent(agent: str, tmp_path: Path) -> None:
    """A real session (three tool calls) read from the agent's store is what the agent sent the model in its
    last request, plus the final answer: Codex's and OpenCode's but their own system prompt (rendered per
    request, not stored); Claude Code's from its first response on exactly, and every text of its leading
    context."""
    binary(agent)
    session = run_session(agent, tmp_path, proxied=False, steps=3)
    assert session.returncode == 0, session.output[-2000:]
    found = css.read_session(f"{agent}:latest", [agent], tmp_path / "project", environ(tmp_path / "home"))
    path, body = [entry for entry in session.upstream.log if entry[1].get("tools")][-1]
    sent = request_view(path, body).messages
    view, request = signature(found.messages), signature(sent)
    assert view[-1] == ("assistant", "done") and cs.api_problems(found.messages) == []
    if agent in ("codex", "opencode"):  # the agent's own first system/developer message is rendered per request
        assert view[:-1] == request[1:] and request[0][0] == "system"
    else:
        first = next(k for k, (kind, _) in enumerate(request) if kind == "tool_call")
        mine = next(k for k, (kind, _) in enumerate(view) if kind == "tool_call")
        assert view[mine:-1] == request[first:]
        leading = " ".join(text for _, text in view[:mine])
        for _, text in request[1:first]:  # the system field (request[0]) is not stored
            for block in text.split("<system-reminder>"):
                block = block.replace("</system-reminder>", "").strip()
                assert block[:60] in leading, block[:200]


def nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists and objects (with the keys the readers look at) of ``inner``."""
    keys = st.sampled_from(["type", "text", "content", "id", "role", "tool_use_id", "input", "name", "rendered"])
    return st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8), nested, max_leaves=8)
RECORD = st.fixed_dictionaries(
    {"type": st.sampled_from(["user", "assistant", "attachment", "system", "response_item", "compacted", "x"])},
    optional={"uuid": st.sampled_from(["a", "b", "c"]) | JSON, "parentUuid": st.sampled_from(["a", "b", None]) | JSON,
              "message": JSON, "payload": JSON, "rendered": JSON, "renderedRole": JSON, "subtype": JSON},
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(RECORD | st.text(max_size=5), max_size=8))
def test_any_store_content_reads_or_says_why(records: list[Any], tmp_path: Path) -> None:
    """Whatever a Claude Code or Codex file holds, reading it gives a valid chat history or a clear error."""
    codex = tmp_path / ".codex" / "sessions" / "2026" / "01" / "01" / "rollout-f.jsonl"
    for agent, path in (("claude", tmp_path / ".claude" / "projects" / "-x" / "f.jsonl"), ("codex", codex)):
        write_jsonl(path, [{"type": "session_meta", "payload": {"id": "f", "cwd": "/x"}}, *records])
        try:
            found = css.read_session(f"{agent}:latest", [agent], Path("/x"), environ(tmp_path))
        except cs.ContextShrinkError:
            continue
        assert cs.validate_messages(found.messages) == found.messages
        assert len(found.sources) == len(found.messages)


def make_idle(path: Path, when: float) -> None:
    """Date the store (and its SQLite WAL) back, as if the agent had left it alone since ``when``: a JSONL
    file's mtime; OpenCode's rows' ``time_updated`` too (its quiet rule reads them, not the file)."""
    if path.suffix == ".db":
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            for table in ("message", "part", "session"):
                db.execute(f"UPDATE {table} SET time_updated = min(time_updated, ?)", (int(when * 1000),))
    for store in (path, path.with_name(path.name + "-wal")):
        if store.exists():
            os.utime(store, (when, when))


def later(found: css.AgentSession) -> float:
    """A moment when the store has been idle long enough to be written."""
    return found.path.stat().st_mtime + css.SESSION_QUIET_SECONDS + 1


def test_a_claude_code_session_written_back(tmp_path: Path) -> None:
    path = claude_store(tmp_path, "/x")
    original = path.read_bytes()
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    cleared = [*found.messages[:3], {**found.messages[3], "content": "[cleared]"}, found.messages[4]]
    report = css.write_session(found, cleared, dry_run=False, now=later(found))
    assert report["tool_results_replaced"] == 1 and Path(report["backup"]).read_bytes() == original
    again = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    assert again.messages == cleared and again.skipped_lines == 1  # the broken line is kept as it was
    records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"')]
    assert next(r for r in records if r.get("uuid") == "t1")["message"]["content"][0]["content"] == "[cleared]"
    without = [m for k, m in enumerate(again.messages) if k not in (2, 3)]  # the tool call with its result
    css.write_session(again, without, dry_run=False, now=later(again))
    records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"')]
    assert {"r1", "r2", "t1"}.isdisjoint(r.get("uuid") for r in records)
    assert next(r for r in records if r.get("uuid") == "r3")["parentUuid"] == "a2"  # re-pointed past them
    assert css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path)).messages == without
    assert sum(1 for r in records if r.get("type") == "api-request") == 1  # bookkeeping untouched


def test_what_cannot_be_written_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path = claude_store(tmp_path, "/x")
    original = path.read_bytes()
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    edited = [{**found.messages[0], "content": "fix it, and the tests"}, *found.messages[1:]]
    with pytest.raises(cs.ContextShrinkError, match="cannot be written to a claude session yet: a new user"):
        css.write_session(found, edited, dry_run=False, now=later(found))
    two = [{"role": "system", "content": f"{cs.SUMMARY_MARKER} a"}, found.messages[2], found.messages[1]]
    with pytest.raises(cs.ContextShrinkError, match="kept unchanged and in order"):
        css.write_session(found, two, dry_run=False, now=later(found))
    with pytest.raises(cs.ContextShrinkError, match="the agent may be writing it"):
        css.write_session(found, found.messages[:2] + found.messages[4:], dry_run=False, now=path.stat().st_mtime + 1)
    dry = css.write_session(found, found.messages[:2] + found.messages[4:], dry_run=True, now=later(found))
    assert dry["removed"] == 2 and dry["backup"] is None and path.read_bytes() == original
    assert list(path.parent.glob("*.pre-shrink-*")) == []


def test_identical_messages_are_told_apart_by_order() -> None:
    """Which stored message a kept one is: in order, the first after the one before; after a new summary,
    from the end (the kept tail is the newest)."""
    a, b, c = ({"role": "user", "content": t} for t in "abc")
    summary = {"role": "system", "content": f"{cs.SUMMARY_MARKER} s"}
    assert css.kept_origins([a, b, a], [b, a]) == [1, 2]  # the first a removed, not the last
    assert css.kept_origins([a, b, a, c], [summary, a, c]) == [None, 2, 3]
    assert css.kept_origins([a, b, a], [a, summary, a]) == [0, None, 2]
    assert css.kept_origins([a, b], [{**a, "content": "new"}, b]) == [None, 1]


def test_a_codex_rollout_written_back_inside_its_compaction(tmp_path: Path) -> None:
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
    call = {"type": "function_call", "call_id": "k1", "name": "exec_command", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "k1", "output": "a.py"}
    history = [user, call, out]
    compaction = {"type": "compacted", "payload": {"replacement_history": history,
                                                   "replacement_history_metadata": ["m0", "m1", "m2"]}}  # fmt: skip
    later_call = {"type": "function_call", "call_id": "k2", "name": "exec_command", "arguments": "{}"}
    later_out = {"type": "function_call_output", "call_id": "k2", "output": "b.py"}
    path = write_jsonl(tmp_path / ".codex" / "sessions" / "2026" / "12" / "01" / "rollout-c1.jsonl", [
        {"type": "session_meta", "payload": {"id": "c1", "cwd": "/x"}}, compaction,
        {"type": "response_item", "payload": later_call}, {"type": "response_item", "payload": later_out}])  # fmt: skip
    found = css.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path))
    # the first call dropped with its output, the second's output cleared
    new = [found.messages[0], found.messages[3], {**found.messages[4], "content": "[cleared]"}]
    css.write_session(found, new, dry_run=False, now=later(found))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    payload = records[1]["payload"]
    assert payload["replacement_history"] == [user] and payload["replacement_history_metadata"] == ["m0"]
    assert records[3]["payload"]["output"] == "[cleared]"
    assert css.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path)).messages == new


def test_an_opencode_session_written_back_in_one_transaction(tmp_path: Path) -> None:
    """A tool output edited in its part, then messages removed with their parts; each time the event log
    tells the same change (replayed, it gives the rows)."""
    path = opencode_store(tmp_path, "/x")
    with sqlite3.connect(path) as db:
        assert replayed(db) == rows_of(db)
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    new = [*found.messages[:4], {**found.messages[4], "content": "[cleared]"}]
    report = css.write_session(found, new, dry_run=False, now=later(found))
    with sqlite3.connect(path) as db:
        part = json.loads(db.execute("SELECT data FROM part WHERE id = 'p5'").fetchone()[0])
    assert part["state"]["output"] == "[cleared]" and part["state"]["input"] == {"filePath": "a.py"}
    with sqlite3.connect(path) as db:
        assert replayed(db) == rows_of(db)
    assert css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path)).messages == new
    with sqlite3.connect(report["backup"]) as db:  # the backup holds the original
        assert "print(1)" in db.execute("SELECT data FROM part WHERE id = 'p5'").fetchone()[0]
    again = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    css.write_session(again, again.messages[:2], dry_run=False, now=later(again) + 60)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM part WHERE message_id IN ('m3', 'm4')").fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM part WHERE message_id IN ('m1c', 'm2')").fetchone()[0] == 2
        assert replayed(db) == rows_of(db)  # the event log told every change: replayed, it gives the rows


def test_an_opencode_compaction_written_as_its_own(tmp_path: Path) -> None:
    """OpenCode's own compaction appended: a user message with a compaction part whose tail_start_id names
    the first kept message, a finished summary message answering it, the event log telling both. Read back:
    OpenCode's question, the summary, the kept messages. The tail starts only where OpenCode can start it
    (no pinned request ahead of it); right after a compaction, not inside the tail it kept (OpenCode would
    send the older summary inside it), so a second compaction then keeps no tail."""
    path = opencode_store(tmp_path, "/x")
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    assert found.tail_starts == (0, 1, 2, 3)  # not the tool result (its call's message)
    tokenizer = cs.resolve_tokenizer("tiktoken")
    plan = cs.compact_messages(found.messages, tokenizer, summary="the user wants a.py read", force=True,
                               keep_last=2, tail_starts=found.tail_starts)  # fmt: skip
    assert plan["kept_from_index"] == 3 and plan["pinned_indices"] == []  # without tail_starts, "read a.py" pinned
    report = css.write_session(found, plan["messages"], dry_run=False, now=later(found))
    assert report["folded_into_summary"] == 3
    again = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    assert again.compacted and again.messages[2:] == found.messages[3:]
    assert [(m["role"], plain(m["content"])) for m in again.messages[:2]] == [
        ("user", "What did we do so far?"), ("assistant", plan["messages"][0]["content"])]  # fmt: skip
    with sqlite3.connect(path) as db:
        assert replayed(db) == rows_of(db)
        mark = [json.loads(d) for (d,) in db.execute("SELECT data FROM part ORDER BY time_created, id")][-2]
        assert mark == {"type": "compaction", "auto": False, "overflow": False, "tail_start_id": "m4"}
    assert again.tail_starts == ()
    second = cs.compact_messages(again.messages, tokenizer, summary="still a.py", force=True, keep_last=2,
                                 tail_starts=again.tail_starts)  # fmt: skip
    assert second["kept_from_index"] == len(again.messages)
    css.write_session(again, second["messages"], dry_run=False, now=later(again) + 60)
    last = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    assert [m["role"] for m in last.messages] == ["user", "assistant"] and "still a.py" in last.messages[1]["content"]
    with pytest.raises(cs.ContextShrinkError, match="only the newest messages"):  # a tail OpenCode cannot keep
        css.write_session(found, [found.messages[0], plan["messages"][0], *found.messages[3:]], dry_run=True)


def rows_of(db: sqlite3.Connection) -> dict[str, Any]:
    """An OpenCode database's messages and parts (their JSON, with their ids)."""
    messages = {i: json.loads(d) for i, d in db.execute("SELECT id, data FROM message")}
    parts = {i: {**json.loads(d), "messageID": m} for i, m, d in db.execute("SELECT id, message_id, data FROM part")}
    return {"messages": messages, "parts": parts}


def replayed(db: sqlite3.Connection) -> dict[str, Any]:
    """The rows OpenCode's event log gives when replayed in sequence order (the log has no gap)."""
    messages: dict[str, Any] = {}
    parts: dict[str, Any] = {}
    events = db.execute("SELECT seq, type, data FROM event WHERE aggregate_id = 'ses_1' ORDER BY seq").fetchall()
    assert [seq for seq, _, _ in events] == list(range(len(events)))
    assert db.execute("SELECT seq FROM event_sequence WHERE aggregate_id = 'ses_1'").fetchone()[0] == len(events) - 1
    for _, kind, data in events:
        event = json.loads(data)
        if kind == "message.updated.1":
            messages[event["info"]["id"]] = {k: v for k, v in event["info"].items() if k not in ("id", "sessionID")}
        elif kind == "message.removed.1":
            messages.pop(event["messageID"])
            parts = {i: p for i, p in parts.items() if p["messageID"] != event["messageID"]}
        elif kind == "message.part.updated.1":
            parts[event["part"]["id"]] = {k: v for k, v in event["part"].items() if k not in ("id", "sessionID")}
        elif kind == "message.part.removed.1":
            parts.pop(event["partID"])
    return {"messages": messages, "parts": parts}


def real_session(
    agent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[css.AgentSession, dict[str, str], Any]:
    """A real session of ``agent`` (three file reads) under ``tmp_path`` read from its store, the environment
    pointing at the agent's home, and a server allowed to write the session."""
    binary(agent)
    assert run_session(agent, tmp_path, proxied=False, steps=3).returncode == 0
    env = environ(tmp_path / "home")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    found = css.read_session(f"{agent}:latest", [agent], tmp_path / "project", env)
    server = cs.build_server(cs.Config(root=tmp_path / "project", tokenizer="tiktoken", session_stores=(agent,)))
    return found, env, server


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_real_agent_goes_on_from_its_shrunk_session(
    agent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real session (three file reads); prune_context removes the first read (the call with its result)
    from the agent's own store (a backup first, byte for byte), then trim_context shortens a result in place;
    the agent resumed sends the model everything else and the shortened result, and not what was removed."""
    found, env, server = real_session(agent, tmp_path, monkeypatch)
    first = next(k for k, m in enumerate(found.messages) if m.get("tool_calls"))
    arguments = {"session": f"{agent}:latest", "remove_ids": [cs.message_ids(found.messages)[first]], "scrub": True}

    async def prune(dry_run: bool | None) -> Any:
        async with Client(server) as client:
            return await client.call_tool("prune_context", {**arguments, "dry_run": dry_run})

    busy = anyio.run(prune, False)
    assert busy.is_error and "may be writing it" in busy.content[0].text  # the agent wrote it just now
    idle = found.path.stat().st_mtime - 60
    make_idle(found.path, idle)
    before = found.path.read_bytes()
    dry = anyio.run(prune, None).structured_content
    assert dry["dry_run"] and dry["session_write"]["removed"] == 2 and found.path.read_bytes() == before
    done = anyio.run(prune, False).structured_content
    assert done["session_write"]["removed"] == 2 and Path(done["session_write"]["backup"]).exists()
    if agent != "opencode":  # a JSONL store's backup is the file as it was (OpenCode's is a SQLite backup)
        assert Path(done["session_write"]["backup"]).read_bytes() == before
    pruned = css.read_session(f"{agent}:latest", [agent], tmp_path / "project", env)
    assert signature(pruned.messages) == signature(found.messages[:first] + found.messages[first + 2 :])
    assert "file 0 line 7:" not in store_text(agent, tmp_path / "home", found.path)  # scrubbed: no copy left
    tokens = cs.count_messages(pruned.messages, cs.resolve_tokenizer("tiktoken"))[1]
    make_idle(found.path, idle)

    async def trim() -> Any:
        async with Client(server) as client:
            trimmed = {"session": f"{agent}:latest", "max_context_tokens": tokens - 300, "keep_last": 2}
            return await client.call_tool("trim_context", {**trimmed, "dry_run": False})

    trimmed = anyio.run(trim).structured_content
    assert trimmed["session_write"]["tool_results_replaced"] >= 1 and trimmed["session_write"]["removed"] == 0
    pruned = css.read_session(f"{agent}:latest", [agent], tmp_path / "project", env)
    shortened = [m["content"] for m in pruned.messages if m["role"] == "tool" and ("elided" in m["content"] or
                 "[tool result cleared:" in m["content"])]  # fmt: skip
    assert shortened, "trim_context wrote no shortened tool result"
    again = run_session(agent, tmp_path, proxied=False, steps=1, resume=found.id)
    assert again.returncode == 0, again.output[-2000:]
    path, body = next(entry for entry in again.upstream.log if entry[1].get("tools"))
    sent = request_view(path, body).messages
    texts = " ".join(plain(m.get("content")) + json.dumps(m.get("tool_calls")) for m in sent)
    assert "file 0 line 7:" not in texts and "notes_00" not in texts  # the removed read, call and result
    assert all(text[:300] in texts for text in shortened)  # what trim_context wrote in place of the results
    kept = [s for s in signature(pruned.messages) if s[0] in ("tool_call", "tool_result")]
    assert [s for s in signature(sent) if s[0] in ("tool_call", "tool_result")][: len(kept)] == kept


SUMMARY_TEXT = "The user asked for every notes file; the first two were read; next: the third."


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_real_agent_goes_on_from_a_compaction_in_its_own_records(
    agent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compact_context writes the summary as the agent's own compaction (Claude Code: a compact_boundary and
    a summary record, the newest records copied after them; Codex: a compacted record whose replacement
    history is the summary and the newest items; OpenCode: a compaction part naming the first kept message
    and a summary message answering it), the old records kept but unsent; the agent resumed sends the
    summary and the newest messages, not the folded ones."""
    found, env, server = real_session(agent, tmp_path, monkeypatch)
    make_idle(found.path, found.path.stat().st_mtime - 60)
    arguments = {"session": f"{agent}:latest", "summary": SUMMARY_TEXT, "force": True, "keep_last": 3,
                 "dry_run": False}  # fmt: skip

    async def compact() -> Any:
        async with Client(server) as client:
            return await client.call_tool("compact_context", arguments)

    result = anyio.run(compact)
    assert not result.is_error, result.content[0].text
    written = result.structured_content["session_write"]
    assert written["folded_into_summary"] > 0
    if agent == "opencode":  # only appended: every row of the backup (a SQLite copy) is still there
        with sqlite3.connect(written["backup"]) as before, sqlite3.connect(found.path) as after:
            kept = "SELECT id, data FROM message UNION ALL SELECT id, data FROM part"
            assert set(before.execute(kept)) < set(after.execute(kept))
    else:  # the file as it was, then the compaction's records
        assert Path(written["backup"]).read_bytes() in found.path.read_bytes()
    compacted = css.read_session(f"{agent}:latest", [agent], tmp_path / "project", env)
    assert compacted.compacted and SUMMARY_TEXT in json.dumps(compacted.messages)
    again = run_session(agent, tmp_path, proxied=False, steps=1, resume=found.id)
    assert again.returncode == 0, again.output[-2000:]
    path, body = next(entry for entry in again.upstream.log if entry[1].get("tools"))
    sent = request_view(path, body).messages
    texts = " ".join(plain(m.get("content")) + json.dumps(m.get("tool_calls")) for m in sent)
    assert SUMMARY_TEXT in texts and "file 0 line 7:" not in texts and "file 2 line 7:" in texts
    if agent == "opencode":  # exactly its question, the summary, the kept tail (then the new prompt)
        assert signature(sent)[1:-1] == signature(compacted.messages)
        assert [m["role"] for m in compacted.messages[:3]] == ["user", "assistant", "assistant"]


def test_a_compaction_written_as_the_agents_own(tmp_path: Path) -> None:
    """Claude Code: a compact_boundary, the summary record, copies of the kept records chained after it and a
    last-prompt naming the new leaf; Codex: one compacted record; the old records stay. Read back, the
    session is the summary and the kept messages."""
    path = claude_store(tmp_path, "/x")
    before = path.read_text()
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    summary = {"role": "system", "content": f"{cs.SUMMARY_MARKER} the user wants it fixed"}
    report = css.write_session(found, [summary, *found.messages[2:]], dry_run=False, now=later(found))
    assert report["folded_into_summary"] == 2 and path.read_text().startswith(before)
    records = [json.loads(line) for line in path.read_text()[len(before) :].splitlines()]
    assert [r.get("subtype") or r["type"] for r in records] == ["compact_boundary", "user", "assistant", "assistant",
                                                                "user", "assistant", "last-prompt"]  # fmt: skip
    assert records[1]["isCompactSummary"] and records[-1]["leafUuid"] == records[-2]["uuid"]
    again = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    assert again.compacted and again.messages[1:] == found.messages[2:]
    assert again.messages[0] == {"role": "user", "content": summary["content"]}
    codex = tmp_path / ".codex" / "sessions" / "2026" / "12" / "01" / "rollout-c1.jsonl"
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}
    call = {"type": "function_call", "call_id": "k1", "name": "exec_command", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "k1", "output": "a.py"}
    items = [{"type": "response_item", "payload": i, "ordinal": k} for k, i in enumerate([user, call, out], 1)]
    write_jsonl(codex, [{"type": "session_meta", "payload": {"id": "c1", "cwd": "/x"}, "ordinal": 0}, *items])
    found = css.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path))
    css.write_session(found, [summary, *found.messages[1:]], dry_run=False, now=later(found))
    last = json.loads(codex.read_text().splitlines()[-1])
    assert (
        last["type"] == "compacted"
        and last["ordinal"] == 4
        and last["payload"]["replacement_history"][1:] == [call, out]
    )
    assert css.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path)).compacted


def test_a_hostile_store_is_read_or_refused_never_a_crash(tmp_path: Path) -> None:
    """A FIFO among the sessions (never opened), a line nested 100,000 deep, bytes that are not UTF-8: the
    session reads (those lines skipped or replaced), and a write is refused with a clear error, not a crash."""
    path = claude_store(tmp_path, "/x")
    os.mkfifo(path.parent / "fifo.jsonl")
    with path.open("ab") as handle:
        handle.write(b"[" * 100_000 + b"\n" + b'{"type": "x", "bad": "\xff\xfe"}\n')
    found = css.read_session("claude:latest", ["claude"], Path("/x"), environ(tmp_path))
    assert found.skipped_lines == 2 and len(found.messages) == 5
    assert "claude:s1" in [s["session"] for s in css.list_sessions(["claude"], environ(tmp_path))]
    with pytest.raises(cs.ContextShrinkError, match="not a regular file"):
        css.read_session("claude:fifo", ["claude"], Path("/x"), environ(tmp_path))
    with pytest.raises(cs.ContextShrinkError, match="not UTF-8"):
        css.write_session(found, found.messages[:2] + found.messages[4:], dry_run=False, now=later(found))
    assert not list(path.parent.glob("*.pre-shrink-*"))  # refused before the backup: nothing left behind


def test_scrub_erases_the_hidden_copies(tmp_path: Path) -> None:
    """prune_context's scrub: a removed tool result's copies in bookkeeping records (a request log) and in
    the kept record's toolUseResult go too; last-prompt keeps its leaf; without scrub they stay."""
    secret = "print('the secret value 0123456789')"
    for scrub in (False, True):
        path = claude_store(tmp_path / str(scrub), "/x")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"')]
        for record in records:
            if record.get("uuid") == "t1":
                record["message"]["content"][0]["content"] = [{"type": "text", "text": secret}]
                record["toolUseResult"] = {"stdout": secret}
        records.append({"type": "api-request-blob", "content": [{"type": "text", "text": secret}]})
        write_jsonl(path, records)
        found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path / str(scrub)))
        new = [m for k, m in enumerate(found.messages) if k not in (2, 3)]
        css.write_session(found, new, dry_run=False, now=later(found), scrub=scrub)
        text = path.read_text()
        assert (secret in text) is not scrub
        assert '"leafUuid": "r3"' in text.replace('":"', '": "') and '"api-request"' in text  # unrelated kept


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_a_write_that_does_not_read_back_is_undone_from_the_backup(
    agent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the store, read again after the write, does not give the result, the write is undone: the JSONL
    file from its backup byte for byte, OpenCode's transaction rolled back (its SQL dump unchanged)."""
    if agent == "claude":
        path, spec = claude_store(tmp_path, "/x"), "claude:s1"
    elif agent == "codex":
        path, spec = tmp_path / ".codex" / "sessions" / "2026" / "12" / "01" / "rollout-c1.jsonl", "codex:c1"
        call = {"type": "function_call", "call_id": "k1", "name": "exec_command", "arguments": "{}"}
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]}, call,
                 {"type": "function_call_output", "call_id": "k1", "output": "a.py"}]  # fmt: skip
        write_jsonl(path, [{"type": "session_meta", "payload": {"id": "c1", "cwd": "/x"}},
                           *({"type": "response_item", "payload": i} for i in items)])  # fmt: skip
    else:
        path, spec = opencode_store(tmp_path, "/x"), "opencode:ses_1"

    def dump() -> Any:
        if agent != "opencode":
            return path.read_bytes()
        with sqlite3.connect(path) as db:
            return list(db.iterdump())

    found = css.read_session(spec, [agent], Path("/x"), environ(tmp_path))
    before = dump()
    store = css.AGENT_STORES[agent]
    read, reads = store.read, itertools.count()
    wrong = 1 if agent == "opencode" else 0  # OpenCode reads the session once inside its transaction first
    monkeypatch.setattr(store, "read", lambda *a: dataclasses.replace(read(*a), messages=[])
                        if next(reads) == wrong else read(*a))  # fmt: skip
    new = [*found.messages[:-1], {**found.messages[-1], "content": "[cleared]"}] if agent != "claude" else \
        [m for k, m in enumerate(found.messages) if k not in (2, 3)]  # fmt: skip
    undone = "nothing changed .the transaction was rolled back" if agent == "opencode" else "restored from"
    with pytest.raises(cs.ContextShrinkError, match=f"did not read back as written; {undone}"):
        css.write_session(found, new, dry_run=False, now=later(found))
    assert dump() == before
    assert len(list(path.parent.glob("*.pre-shrink-*"))) == (agent != "opencode")  # a rolled-back write: none


def test_an_opencode_database_without_an_event_log_is_written_too(tmp_path: Path) -> None:
    """OpenCode before 1.18 has no event log: pruning (with scrub) and compacting write the rows alone."""
    path = opencode_store(tmp_path, "/x")
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE event")
        db.execute("DROP TABLE event_sequence")
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    css.write_session(found, found.messages[:3], dry_run=False, now=later(found), scrub=True)
    again = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    summary = {"role": "system", "content": f"{cs.SUMMARY_MARKER} read a.py"}
    css.write_session(again, [summary, again.messages[2]], dry_run=False, now=later(again) + 60)
    last = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    assert [plain(m["content"]) for m in last.messages] == ["What did we do so far?", summary["content"], "read a.py"]


def test_an_opencode_part_with_broken_json_is_skipped_and_counted(tmp_path: Path) -> None:
    """A part whose JSON does not parse (OpenCode then fails on the whole session) is skipped and counted as
    unreadable; the rest reads, and a write leaves that row as it is and adds no invalid JSON."""
    path = opencode_store(tmp_path, "/x")
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO part VALUES ('pbad', 'm3', 'ses_1', 3, 3, '{\"type\": \"text\", \"te')")
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    assert found.skipped_lines == 1 and [plain(m["content"]) for m in found.messages][2] == "read a.py"
    css.write_session(found, [*found.messages[:4], {**found.messages[4], "content": "[x]"}], dry_run=False,
                     now=later(found))  # fmt: skip

    def broken(data: str) -> bool:
        try:
            return not isinstance(json.loads(data), dict)
        except ValueError:
            return True

    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT id, data FROM part UNION ALL SELECT id, data FROM event").fetchall()
    assert [i for i, data in rows if broken(data)] == ["pbad"]


def test_an_opencode_database_held_by_a_writer_is_not_written(tmp_path: Path) -> None:
    """Another connection holding the write lock (the agent mid-write): refused, nothing changed, the
    backup taken before it left beside the database."""
    path = opencode_store(tmp_path, "/x")
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(cs.ContextShrinkError, match="locked"):
            css.write_session(found, found.messages[:1], dry_run=False, now=later(found))
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path)).messages == found.messages


def test_a_real_opencode_session_after_its_own_compactions_reads_as_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenCode given a small limit compacts on its own (a compaction part with a kept tail, the summary, a
    synthetic "Continue" message); the session read from its store is what it sent last."""
    binary("opencode")
    monkeypatch.setattr(agents, "WINDOW", 11_000)  # OpenCode's limit: it compacts between the reads
    session = run_session("opencode", tmp_path, proxied=False, steps=3)
    assert session.returncode == 0, session.output[-2000:]
    found = css.read_session("opencode:latest", ["opencode"], tmp_path / "project", environ(tmp_path / "home"))
    _, body = [entry for entry in session.upstream.log if entry[1].get("tools")][-1]
    assert found.compacted and signature(found.messages)[:-1] == signature(body["messages"])[1:]
    assert ("user", "What did we do so far?") in signature(found.messages)


def test_the_core_names_the_agents_the_stores_serve() -> None:
    """A new agent is one AgentStore here and its name in ``SESSION_AGENTS`` (the core reads the setting and
    offers the tool's ``agent`` values without importing the stores)."""
    assert tuple(css.AGENT_STORES) == cs.SESSION_AGENTS
    assert all(store.agent == name for name, store in css.AGENT_STORES.items())
