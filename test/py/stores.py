"""Agent session stores the tests write: a Claude Code JSONL session, an OpenCode database, and where the
stores are."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any


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


OPENCODE_ROWS = [
    ("m1", {"role": "user"}, [("p1", {"type": "text", "text": "an old question"})]),
    ("m1c", {"role": "user"}, [("p1c", {"type": "compaction", "auto": True})]),
    ("m2", {"role": "assistant", "summary": True, "finish": "stop", "parentID": "m1c"},
     [("p2", {"type": "text", "text": "Summary: answered."})]),
    ("m3", {"role": "user"}, [("p3", {"type": "text", "text": "read a.py"})]),
    ("m4", {"role": "assistant"}, [("p4", {"type": "step-start"}), ("p5", {"type": "tool", "callID": "c1",
     "tool": "read", "state": {"status": "completed", "input": {"filePath": "a.py"}, "output": "print(1)"}}),
     ("p6", {"type": "text", "text": "It prints 1."})]),
]  # fmt: skip


def opencode_store(home: Path, cwd: str, rows: list[Any] = OPENCODE_ROWS) -> Path:
    """OpenCode's database (its tables as 1.18 has them) holding session ses_1: ``rows`` of (message id,
    message JSON, [(part id, part JSON)]), each write told in the event log."""
    path = home / "data" / "opencode" / "opencode.db"
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE session (id text, directory text, title text, time_updated integer)")
        db.execute("CREATE TABLE message (id text, session_id text, time_created integer, time_updated integer, "
                   "data text)")  # fmt: skip
        db.execute("CREATE TABLE part (id text, message_id text, session_id text, time_created integer, "
                   "time_updated integer, data text)")  # fmt: skip
        db.execute("CREATE TABLE event_sequence (aggregate_id text PRIMARY KEY, seq integer NOT NULL, owner_id text)")
        db.execute("CREATE TABLE event (id text PRIMARY KEY, aggregate_id text NOT NULL, seq integer NOT NULL, "
                   "type text NOT NULL, data text NOT NULL)")  # fmt: skip
        db.execute("INSERT INTO session VALUES ('ses_1', ?, 'title', 1000)", (cwd,))
        events = []
        for t, (mid, info, parts) in enumerate(rows):
            db.execute("INSERT INTO message VALUES (?, 'ses_1', ?, ?, ?)", (mid, t, t, json.dumps(info)))
            events.append(("message.updated.1", {"info": {"id": mid, "sessionID": "ses_1", **info}}))
            for pid, part in parts:
                db.execute("INSERT INTO part VALUES (?, ?, 'ses_1', ?, ?, ?)", (pid, mid, t, t, json.dumps(part)))
                whole = {"id": pid, "sessionID": "ses_1", "messageID": mid, **part}
                events.append(("message.part.updated.1", {"part": whole, "time": t}))
        for seq, (kind, data) in enumerate(events):
            db.execute("INSERT INTO event VALUES (?, 'ses_1', ?, ?, ?)",
                       (f"evt_{seq:03}", seq, kind, json.dumps({"sessionID": "ses_1", **data})))  # fmt: skip
        db.execute("INSERT INTO event_sequence VALUES ('ses_1', ?, NULL)", (len(events) - 1,))
    return path
