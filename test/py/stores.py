"""Agent session stores the tests write: a Claude Code JSONL session, and where the stores are."""

from __future__ import annotations

import json
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
