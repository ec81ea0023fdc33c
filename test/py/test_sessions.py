"""The coding agents' own sessions as sources (#20, reading): Claude Code's JSONL, Codex CLI's rollout and
OpenCode's SQLite database read into the chat view of what the model is sent next turn.

Small stores written here check the rules (the chain, compaction boundaries, per-block records, the
replacement history, the summary message, unreadable lines, access); sessions made by the real agents
(test_agents.py's scripted model, three tool calls each) check the view against the request each agent
actually sent last."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from test_agents import binary, run_session

import context_shrink as cs


def plain(content: Any) -> str:
    """A message content's text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def environ(home: Path) -> dict[str, str]:
    return {"HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "CODEX_HOME": str(home / ".codex")}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def claude_store(home: Path, cwd: str, compacted: bool = False) -> Path:
    """A Claude Code session: a prompt, an environment attachment, a response in two block records (text,
    tool_use), its tool_result, an answer; bookkeeping records between; optionally a compaction first."""
    base = {"sessionId": "s1", "cwd": cwd}
    records: list[Any] = [{"type": "queue-operation", "operation": "enqueue", "content": "secret prompt copy"}]
    parent = None
    if compacted:
        records += [{**base, "type": "user", "uuid": "old", "parentUuid": None,
                     "message": {"role": "user", "content": "an old question"}},
                    {**base, "type": "system", "subtype": "compact_boundary", "uuid": "b", "parentUuid": "old"},
                    {**base, "type": "user", "uuid": "sum", "parentUuid": "b", "isCompactSummary": True,
                     "message": {"role": "user", "content": "Summary: the old question was answered."}}]  # fmt: skip
        parent = "sum"
    records += [
        {**base, "type": "user", "uuid": "u1", "parentUuid": parent, "message": {"role": "user", "content": "fix it"}},
        {**base, "type": "attachment", "uuid": "a1", "parentUuid": "u1", "attachment": {"type": "environment"},
         "rendered": [{"content": "<system-reminder>cwd: /x</system-reminder>"}], "renderedRole": "system"},
        {**base, "type": "attachment", "uuid": "a2", "parentUuid": "a1", "attachment": {"type": "prompt_snapshot"}},
        {"type": "api-request", "params": {"messages": ["a copy"]}},
        {**base, "type": "assistant", "uuid": "r1", "parentUuid": "a2",
         "message": {"id": "msg_1", "role": "assistant", "content": [{"type": "text", "text": "Reading."}]}},
        {**base, "type": "assistant", "uuid": "r2", "parentUuid": "r1", "message": {"id": "msg_1", "role": "assistant",
         "content": [{"type": "tool_use", "id": "tu1", "name": "Read", "input": {"file_path": "a.py"}}]}},
        "{not json",
        {**base, "type": "user", "uuid": "t1", "parentUuid": "r2", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "print(1)"}]}]}},
        {**base, "type": "assistant", "uuid": "r3", "parentUuid": "t1",
         "message": {"id": "msg_2", "role": "assistant", "content": [{"type": "text", "text": "Done."}]}},
        {"type": "last-prompt", "lastPrompt": "fix it", "leafUuid": "r3"},
    ]  # fmt: skip
    return write_jsonl(home / ".claude" / "projects" / "-x" / "s1.jsonl", records)


def test_a_claude_code_session(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x")
    found = cs.read_session("claude:latest", ["claude"], Path("/x"), environ(tmp_path))
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


def test_after_a_claude_code_compaction_only_the_summary_and_what_follows(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x", compacted=True)
    found = cs.read_session("claude:s1", ["claude"], Path("/elsewhere"), environ(tmp_path))
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
    found = cs.read_session("codex:latest", ["codex"], Path("/x"), environ(tmp_path))
    kinds = [cs.message_kind(m) for m in found.messages]
    assert kinds == ["user", "tool_call", "tool_result", "tool_call", "tool_result"] and found.sources[1] == ["line 3"]
    assert found.messages[3]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": "*** Begin Patch"}
    assert found.bookkeeping == {"session_meta": 1, "event_msg": 1}
    summary = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Summary so far."}]}
    compaction = {"type": "compacted", "payload": {"message": "", "replacement_history": [summary]}}
    write_jsonl(path, [*records, compaction, {"type": "response_item", "payload": user}])
    again = cs.read_session("codex:c1", ["codex"], Path("/x"), environ(tmp_path))
    assert again.compacted and [plain(m["content"]) for m in again.messages] == [
        "Summary so far.", "list the files"]  # fmt: skip
    assert again.sources[0] == ["line 8 replacement_history[0]"]


def opencode_store(home: Path, cwd: str) -> Path:
    path = home / "data" / "opencode" / "opencode.db"
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE session (id text, directory text, title text, time_updated integer)")
        db.execute("CREATE TABLE message (id text, session_id text, time_created integer, data text)")
        db.execute("CREATE TABLE part (id text, message_id text, session_id text, time_created integer, data text)")
        db.execute("INSERT INTO session VALUES ('ses_1', ?, 'title', 1000)", (cwd,))
        rows = [
            ("m1", {"role": "user"}, [("p1", {"type": "text", "text": "an old question"})]),
            ("m2", {"role": "assistant", "summary": True}, [("p2", {"type": "text", "text": "Summary: answered."})]),
            ("m3", {"role": "user"}, [("p3", {"type": "text", "text": "read a.py"})]),
            ("m4", {"role": "assistant"}, [("p4", {"type": "step-start"}), ("p5", {"type": "tool", "callID": "c1",
             "tool": "read", "state": {"status": "completed", "input": {"filePath": "a.py"}, "output": "print(1)"}}),
             ("p6", {"type": "text", "text": "It prints 1."})]),
        ]  # fmt: skip
        for t, (mid, info, parts) in enumerate(rows):
            db.execute("INSERT INTO message VALUES (?, 'ses_1', ?, ?)", (mid, t, json.dumps(info)))
            for pid, part in parts:
                db.execute("INSERT INTO part VALUES (?, ?, 'ses_1', ?, ?)", (pid, mid, t, json.dumps(part)))
    return path


def test_an_opencode_session_from_its_last_compaction(tmp_path: Path) -> None:
    opencode_store(tmp_path, "/x")
    found = cs.read_session("opencode:latest", ["opencode"], Path("/x"), environ(tmp_path))
    seen = [(m["role"], plain(m.get("content"))) for m in found.messages]
    assert found.compacted and seen == [("user", "Summary: answered."), ("user", "read a.py"),
                                        ("assistant", "It prints 1."), ("tool", "print(1)")]  # fmt: skip
    assert found.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"filePath":"a.py"}'
    assert found.sources[3] == ["message m4", "part p5"] and found.bookkeeping["part (step-start)"] == 1


def test_sessions_are_reachable_only_when_allowed(tmp_path: Path) -> None:
    claude_store(tmp_path, "/x")
    with pytest.raises(cs.ContextShrinkError, match="CONTEXT_SHRINK_SESSION_STORES=claude"):
        cs.read_session("claude:latest", ["codex"], Path("/x"), environ(tmp_path))
    for bad in ("claude", "gemini:1", "claude:../../etc/passwd", "claude:" + "x" * 300):
        with pytest.raises(cs.ContextShrinkError, match="session must be"):
            cs.read_session(bad, ["claude"], Path("/x"), environ(tmp_path))
    with pytest.raises(cs.ContextShrinkError, match="no claude session ran in /y"):
        cs.read_session("claude:latest", ["claude"], Path("/y"), environ(tmp_path))
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
    found = cs.read_session(f"{agent}:latest", [agent], tmp_path / "project", environ(tmp_path / "home"))
    path, body = [entry for entry in session.upstream.log if entry[1].get("tools")][-1]
    sent = {"chat": lambda b: b["messages"], "responses": lambda b: cs.responses_view(b).messages,
            "messages": lambda b: cs.messages_view(b).messages}[path](body)  # fmt: skip
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


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "text", "content", "id", "role", "tool_use_id", "input", "name", "rendered"]), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
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
            found = cs.read_session(f"{agent}:latest", [agent], Path("/x"), environ(tmp_path))
        except cs.ContextShrinkError:
            continue
        assert cs.validate_messages(found.messages) == found.messages
        assert len(found.sources) == len(found.messages)
