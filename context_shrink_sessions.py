"""context_shrink_sessions: the coding agents' own session stores, read as a chat history and written back.

A companion of :mod:`context_shrink` (it imports the core; the core reaches it through
:func:`context_shrink.companion` when a tool is given ``session`` or asked to ``list_sessions``). One
:class:`AgentStore` per agent (Claude Code, Codex CLI, OpenCode) in :data:`AGENT_STORES`: a fourth agent is one
class here and its name in :data:`context_shrink.SESSION_AGENTS`. Writes are atomic, keep what the agent appended
meanwhile, and leave a session in use alone.
"""

from __future__ import annotations

__all__ = [
    "AGENT_STORES",
    "SESSION_QUIET_SECONDS",
    "AgentSession",
    "AgentStore",
    "ClaudeRecord",
    "ClaudeStore",
    "CodexItem",
    "CodexStore",
    "Compaction",
    "JsonlStore",
    "OpenCodePart",
    "OpenCodeStore",
    "SessionChanges",
    "kept_origins",
    "list_sessions",
    "read_session",
    "write_session",
]


import bisect
import collections
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import os
import random
import re
import sqlite3
import stat
import string
import time
import uuid as uuid_module
from collections.abc import (
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, cast

import anyio

from context_shrink import (
    SESSION_LIST_LIMIT,
    SUMMARY_MARKER,
    ContextShrinkError,
    Folder,
    assistant_message,
    canonical_json,
    content_text,
    decoded,
    ensure_room,
    fingerprint,
    json_or,
    jsonl_lines,
    message_ids,
    message_kind,
    one_line,
    parsed_record,
    plain_content,
    read_file_bytes,
    read_from,
    rewrite_jsonl,
    tool_call,
    without_reasoning,
)
from context_shrink_wire import (
    messages_view,
    responses_view,
)

# =============================================================================
# 2. Writing a file its agent may be appending to
# =============================================================================

APPEND_SETTLE_SECONDS = 0.01  # how long an agent's append to the old file is waited for after a swap


@dataclasses.dataclass(frozen=True)
class Swap:
    """What :func:`replace_keeping_appends` did: ``before``, the file's bytes it replaced (the agent's appends
    included); ``written``, what it wrote; ``appended``, every byte the agent added after ``basis``;
    ``backup``, where ``before`` was kept (when asked)."""

    before: bytes
    written: bytes
    appended: bytes
    backup: Path | None = None


def replace_keeping_appends(path: Path, basis: bytes, new: bytes, appends: bool = True, backup: bool = False) -> Swap:
    """Replace ``path``, which must still begin with ``basis`` (what was read), by ``new`` followed by every byte
    an agent appended after ``basis``: those there before the swap, and those it wrote to the old file while
    it was swapped (read from it until it stays quiet). With ``backup``, the bytes replaced are kept first
    (removed again if the swap fails). A file changed otherwise, or appended to when ``appends`` is false, is
    left as it is (an error says so); so is a symlink (never written through)."""
    with Folder(path.parent) as folder:
        folder.lock()
        folder.sweep(path.name)
        fd, saved, swapped = folder.open(path.name), None, False
        try:
            before = read_from(fd)
            extra = before[len(basis) :]
            if not before.startswith(basis) or (extra and not appends):
                how = "had lines added" if before.startswith(basis) else "was changed"
                raise ContextShrinkError(f"{path} {how} since it was read (the agent is writing it): nothing "
                                         "written; read it again and retry")  # fmt: skip
            ensure_room(path.parent, len(new) + len(extra) + (len(before) if backup else 0),
                        "the backup and the new file")  # fmt: skip
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            saved = folder.backup(path.name, before, mode) if backup else None
            folder.replace(folder.temp(path.name, new + extra, mode), path.name)
            swapped, late, offset = True, b"", len(before)
            for _ in range(50):  # an append that opened the old file before the swap lands in it
                time.sleep(APPEND_SETTLE_SECONDS)
                if not (more := read_from(fd, offset)):
                    break
                late, offset = late + more, offset + len(more)
            if late:
                with os.fdopen(folder.open(path.name, os.O_WRONLY | os.O_APPEND), "ab") as out:
                    out.write(late)
        except BaseException:
            if saved is not None and not swapped:  # kept once the file was replaced: the undo needs it
                folder.remove(saved.name)
            raise
        finally:
            os.close(fd)
    return Swap(before, new + extra, extra + late, saved)


# =============================================================================
# 3. Agent sessions: one store per agent (Claude Code, Codex CLI, OpenCode), read as a chat history and
#    written back in the agent's own format
# =============================================================================

SESSION_QUIET_SECONDS = 5.0  # a store changed more recently than this may be in use: it is not written
OPENCODE_COMPACTION_PROMPT = "What did we do so far?"  # what OpenCode 1.18 sends for a compaction part


# --- references into a store, the session read, and a change to write -------------------------------------


@dataclasses.dataclass(frozen=True)
class ClaudeRecord:
    """A Claude Code record, by its ``uuid``."""

    uuid: str

    def labels(self) -> list[str]:
        return [self.uuid]


@dataclasses.dataclass(frozen=True)
class CodexItem:
    """A Codex rollout item: the ``line`` it is on (from 1) and, inside a ``compacted`` record, its ``index`` in
    the replacement history (None: the line's own ``response_item``)."""

    line: int
    index: int | None = None

    def labels(self) -> list[str]:
        return [f"line {self.line}" + ("" if self.index is None else f" replacement_history[{self.index}]")]


@dataclasses.dataclass(frozen=True)
class OpenCodePart:
    """An OpenCode part row and the message row it belongs to."""

    message: str
    part: str

    def labels(self) -> list[str]:
        return [f"message {self.message}", f"part {self.part}"]


StoreRef = ClaudeRecord | CodexItem | OpenCodePart


@dataclasses.dataclass
class AgentSession:
    """One agent session read from the agent's own store. ``messages`` is what the model is sent next turn
    (after the last compaction, without the agent's system prompt and tools, which the agent renders per
    request), in the chat shape; ``refs`` names, for each message, the store records it came from;
    ``bookkeeping`` counts, by kind, the records the model is not sent (some hold copies of the prompts)."""

    agent: str
    id: str
    path: Path
    cwd: str | None
    messages: list[dict[str, Any]]
    refs: list[tuple[StoreRef, ...]]
    bookkeeping: dict[str, int]
    compacted: bool = False
    skipped_lines: int = 0  # lines that did not parse (the agent skips them too)
    tail_starts: tuple[int, ...] | None = None  # where a compaction's kept tail can start (None: anywhere)
    basis: bytes | None = dataclasses.field(default=None, repr=False)  # a file store's bytes as read

    @property
    def sources(self) -> list[list[str]]:
        """For each message, its store records as the results name them."""
        return [[label for ref in refs for label in ref.labels()] for refs in self.refs]


@dataclasses.dataclass(frozen=True)
class Compaction:
    """A summary written as the agent's own compaction: the view's messages kept before it (``head``) and
    after it (``tail``), by index, and how many it stands for."""

    summary: str
    head: tuple[int, ...]
    tail: tuple[int, ...]
    folded: int


@dataclasses.dataclass(frozen=True)
class SessionChanges:
    """How a new view differs from the session's, by index of the session's view: messages removed, tool
    results given another text, assistant messages that lost only their reasoning, or a compaction; ``erased``
    are the removed texts as they look inside the store (with ``scrub``: their hidden copies go too)."""

    removed: tuple[int, ...] = ()
    edits: Mapping[int, str] = dataclasses.field(default_factory=dict)
    drop_reasoning: tuple[int, ...] = ()
    compaction: Compaction | None = None
    erased: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.removed or self.edits or self.drop_reasoning or self.compaction)


# --- what every store shares ---------------------------------------------------------------------------------


def _jsonl_records(text: str) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """A JSONL store's records with their line numbers (from 1), and how many lines did not parse."""
    lines = jsonl_lines(text)
    records = [(number, record) for number, (_, record) in enumerate(lines, 1) if record is not None]
    return records, sum(1 for raw, record in lines if record is None and raw.strip())


def _appended(text: str, records: Sequence[Mapping[str, Any]]) -> str:
    """A JSONL store's ``text`` with ``records`` appended."""
    text += "" if not text or text.endswith("\n") else "\n"
    return text + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _text_of(content: Any) -> str:
    """The text of a tool result or rendered block an agent stored: its content's text, or JSON for a value
    that is neither a string nor a list of parts."""
    if content is None or isinstance(content, str | list):
        return content_text(content)
    return json.dumps(content, ensure_ascii=False)


def store_files(place: Path, pattern: str) -> list[Path]:
    """The files matching ``pattern`` in an agent's store folder ``place``, each reached without leaving the
    store: a symlink (to a file or a folder) that leads out of it is not followed (one inside it is)."""
    if not place.is_dir():
        return []
    base = place.resolve()
    return [path for path in place.glob(pattern) if base in path.resolve().parents]


def _first_cwd(path: Path) -> str | None:
    """The working directory named in a session file's first 50 lines."""
    if not path.is_file():  # never a FIFO: opening one would wait for a writer
        return None
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in itertools.islice(iter(lambda: handle.readline(1 << 20), ""), 50):
                if isinstance(cwd := (parsed_record(line) or {}).get("cwd"), str):
                    return cwd
    except OSError:
        return None
    return None


def _read_only(path: Path) -> contextlib.closing[sqlite3.Connection]:
    """A read-only connection to an SQLite store, closed on leaving."""
    return contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5))


def _utc_stamp(timespec: str = "auto") -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec).replace("+00:00", "Z")


ReadsBack = Callable[["AgentSession", bool], bool]  # a store read back, and whether the agent appended meanwhile


class AgentStore:
    """One agent's session store: where it is, its sessions, reading one as the chat view the agent sends, and
    writing a change back in the agent's own format with a backup. A fourth agent is one more subclass."""

    agent = ""  # the name the tools and CONTEXT_SHRINK_SESSION_STORES use
    # What the agent sends on top of its history (its system prompt and tools), which its store does not keep:
    # measured with the release the README names, in cl100k tokens (0: unknown).
    fixed_tokens = 0
    release = ""

    def place(self, home: Path, environ: Mapping[str, str]) -> Path:
        raise NotImplementedError

    def sessions(self, place: Path) -> list[dict[str, Any]]:
        """``{"id", "cwd", "path"}`` (and ``title``, ``updated_ms`` where the store keeps them) per session."""
        raise NotImplementedError

    def read(self, path: Path, ident: str) -> AgentSession:
        raise NotImplementedError

    def write(self, found: AgentSession, changes: SessionChanges, reads_back: ReadsBack) -> Path:
        """Apply ``changes`` to the store after a backup, only if the store still holds what ``found`` was read
        from (an agent's appends aside); then the store read again must satisfy ``reads_back``, or the change
        is undone without losing anything the agent wrote meanwhile. Returns the backup's path."""
        raise NotImplementedError

    def forget_index(self, found: AgentSession) -> None:
        """After a write: make the agent forget what it derived from the old store (nothing, but for Codex)."""

    def last_change(self, found: AgentSession) -> float:
        """When the session last changed (seconds since the epoch)."""
        return found.path.stat().st_mtime

    def sent_after(self, new: Sequence[Mapping[str, Any]], compaction: Compaction | None) -> list[Any]:
        """What reading the store back must give after writing ``new``."""
        return list(new)


class JsonlStore(AgentStore):
    """A store of one JSONL file per session (Claude Code, Codex CLI): a change is the file's new text, built
    before anything is touched (a store that cannot be rewritten leaves nothing behind, not even a backup),
    then a backup and an atomic replace."""

    conversation_records: tuple[str, ...] = ()  # the record types that make up the conversation

    def rewrite(self, found: AgentSession, changes: SessionChanges, text: str) -> str:
        raise NotImplementedError

    def compact(self, found: AgentSession, compaction: Compaction, text: str) -> str:
        raise NotImplementedError

    def write(self, found: AgentSession, changes: SessionChanges, reads_back: ReadsBack) -> Path:
        """The new text built from the bytes ``found`` was read from (strict: a store that is not UTF-8 is not
        written), then swapped in under the folder's lock (:func:`replace_keeping_appends`): lines the agent
        appended since are kept after it (a compaction, which they would not follow, is refused instead). Read
        back wrong, the backup is swapped back in, followed by whatever the agent appended after the write."""
        if found.basis is None:  # pragma: no cover (every JSONL read keeps its bytes)
            raise ContextShrinkError("this session was not read from a file")
        c, base = changes.compaction, decoded(found.basis, found.path)
        text = self.compact(found, c, base) if c else self.rewrite(found, changes, base)
        text = self.scrub(text, changes.erased) if changes.erased else text
        try:
            swap = replace_keeping_appends(found.path, found.basis, text.encode("utf-8", "backslashreplace"),
                                           appends=c is None, backup=True)  # fmt: skip
        except OSError as exc:
            raise ContextShrinkError(f"cannot write {found.path} (nothing written): {exc.strerror or exc}") from None
        saved = cast(Path, swap.backup)  # asked for: always made
        self.forget_index(found)
        again = self.read(found.path, found.id)
        if reads_back(again, bool(swap.appended) or len(again.basis or b"") > len(swap.written)):
            return saved
        undo = replace_keeping_appends(found.path, swap.written, swap.before)
        self.forget_index(found)
        after = undo.appended.count(b"\n")
        raise ContextShrinkError(
            f"the {found.agent} session did not read back as written; restored from {saved}"
            + (f", with the {after} line(s) the agent wrote meanwhile after it" if after else "")
        )

    def scrub(self, text: str, erased: Sequence[str]) -> str:
        """``text`` without the hidden copies of ``erased``: a conversation record keeps what it must
        (:meth:`scrubbed_kept`), a bookkeeping record holding one goes (:meth:`scrubbed_unsent`)."""

        def holds(value: Any) -> bool:
            return any(t in json.dumps(value, ensure_ascii=False) for t in erased)

        def change(_: int, record: dict[str, Any]) -> dict[str, Any] | None:
            if not holds(record):
                return record
            if record.get("type") in self.conversation_records:
                return self.scrubbed_kept(record, holds)
            return self.scrubbed_unsent(record)

        return rewrite_jsonl(jsonl_lines(text), change)

    def scrubbed_kept(self, record: dict[str, Any], holds: Callable[[Any], bool]) -> dict[str, Any]:
        return record

    def scrubbed_unsent(self, record: dict[str, Any]) -> dict[str, Any] | None:
        return None


# --- Claude Code: ~/.claude/projects/<cwd slug>/<id>.jsonl, records chained by uuid -> parentUuid ---------


def _claude_blocks(record: Mapping[str, Any]) -> list[Any]:
    """A record's ``message.content`` as a list of blocks (text given as a string is one text block)."""
    message = record.get("message") if isinstance(record.get("message"), dict) else {}
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


CLAUDE_BLOCKS = {"user": ("text", "image", "tool_result"), "system": ("text",),
                 "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}  # fmt: skip
"""The content blocks the Anthropic Messages converter reads, by role (in a tool result: text and images)."""


def _claude_sendable(message: dict[str, Any], unsent: collections.Counter[str]) -> dict[str, Any] | None:
    """``message`` with only the blocks the converter reads (tool results' inner blocks too), the others counted
    in ``unsent``; None when nothing is left."""
    if isinstance(message["content"], str):
        return message
    known = CLAUDE_BLOCKS[message["role"]]
    blocks = []
    for block in message["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in known:
            unsent[f"block ({kind})"] += 1
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            inner = [b for b in block["content"] if isinstance(b, dict) and b.get("type") in ("text", "image")]
            unsent.update(f"block ({b.get('type') if isinstance(b, dict) else None})" for b in block["content"]
                          if not (isinstance(b, dict) and b in inner))  # fmt: skip
            blocks.append({**block, "content": inner})
        else:
            blocks.append(block)
    return {**message, "content": blocks} if blocks else None


class ClaudeStore(JsonlStore):
    """Claude Code: records chained by ``uuid`` -> ``parentUuid``; the conversation runs from the newest record
    back to the root, from after the last ``compact_boundary``. An API response is written as one record per
    content block (the same ``message.id``); parallel tool calls as chained assistant records, each result a
    child of its own call's record."""

    agent = "claude"
    fixed_tokens, release = 11_100, "Claude Code 2.1.332"
    conversation_records = ("user", "assistant", "attachment", "system")

    def place(self, home: Path, environ: Mapping[str, str]) -> Path:
        return home / ".claude" / "projects"

    def sessions(self, place: Path) -> list[dict[str, Any]]:
        return [{"id": path.stem, "cwd": _first_cwd(path), "path": path}
                for path in store_files(place, "*/*.jsonl")]  # fmt: skip

    @staticmethod
    def chain(records: list[tuple[int, dict[str, Any]]]) -> tuple[list[dict[str, Any]], bool]:
        """The records the conversation runs through, in order, from just after the last compaction boundary on
        it (and whether there is one): the branch from the newest record back to the root, each response with
        all its records and its calls' results (:meth:`with_parallel_calls`)."""
        by_uuid = {r["uuid"]: r for _, r in records if isinstance(r.get("uuid"), str)}
        chained = [r for _, r in records if r.get("uuid") and r.get("type") in ClaudeStore.conversation_records]
        chain: list[dict[str, Any]] = []
        record = chained[-1] if chained else None
        seen: set[str] = set()
        while record is not None and record["uuid"] not in seen:
            seen.add(record["uuid"])
            chain.append(record)
            parent = record.get("parentUuid")
            record = by_uuid.get(parent) if isinstance(parent, str) else None
        chain.reverse()
        boundaries = [k for k, r in enumerate(chain) if r.get("type") == "system" and
                      r.get("subtype") == "compact_boundary"]  # fmt: skip
        if not boundaries:
            return ClaudeStore.with_parallel_calls(chain, [r for _, r in records]), False
        start = next(line for line, r in records if r is chain[boundaries[-1]])
        later = [r for line, r in records if line > start]  # a copy made by a compaction is not a sibling
        return ClaudeStore.with_parallel_calls(chain[boundaries[-1] + 1 :], later), True

    @staticmethod
    def with_parallel_calls(chain: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``chain`` with each response whole, as Claude Code sends it: it writes one record per content block
        (the same ``message.id``), parallel calls as chained records, and each result as a child of its own
        call's record, so one branch holds only some of them. Each response: all its records (file order), then
        its calls' results (call order), wherever they sit; sidechains (subagents) are not the conversation."""
        main = [r for r in records if not r.get("isSidechain")]
        responses: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in main:
            if r.get("type") == "assistant" and (r.get("message") or {}).get("id"):
                responses[r["message"]["id"]].append(r)
        result_of = {b.get("tool_use_id"): r for r in main if r.get("type") == "user" and ClaudeStore.only_results(r)
                     for b in _claude_blocks(r)}  # fmt: skip
        out: list[dict[str, Any]] = []
        placed: set[Any] = set()
        for record in chain:
            mid = (record.get("message") or {}).get("id") if record.get("type") == "assistant" else None
            if record.get("uuid") in placed:
                continue
            if not mid:
                out.append(record)
                placed.add(record.get("uuid"))
                continue
            group = [r for r in responses[mid] if r.get("uuid") not in placed]
            calls = [b.get("id") for r in group for b in _claude_blocks(r)
                     if isinstance(b, dict) and b.get("type") == "tool_use"]  # fmt: skip
            answers = [result_of[c] for c in calls if c in result_of]
            for r in [*group, *answers]:
                if r.get("uuid") not in placed:
                    out.append(r)
                    placed.add(r.get("uuid"))
        return out

    @staticmethod
    def turns(chain: list[dict[str, Any]]) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any] | None]]:
        """The chain as Anthropic messages, each with the records it came from (None: a record the model is not
        sent): a response's block records joined, an attachment as the text it renders to."""
        k = 0
        while k < len(chain):
            record, kind = chain[k], chain[k].get("type")
            if kind == "assistant":
                mid, end = (record.get("message") or {}).get("id"), k + 1
                while end < len(chain) and chain[end].get("type") == "assistant" and mid and (
                        (chain[end].get("message") or {}).get("id") == mid):  # fmt: skip
                    end += 1
                group = chain[k:end]
                yield group, {"role": "assistant", "content": [b for r in group for b in _claude_blocks(r)]}
                k = end
                continue
            if kind == "user" and ClaudeStore.only_results(record):  # a response's results: one user message
                end = k + 1
                while end < len(chain) and chain[end].get("type") == "user" and ClaudeStore.only_results(chain[end]):
                    end += 1
                yield chain[k:end], {"role": "user", "content": [b for r in chain[k:end] for b in _claude_blocks(r)]}
                k = end
                continue
            if kind == "user":
                yield [record], {"role": "user", "content": _claude_blocks(record)}
            elif kind == "attachment" and isinstance(record.get("rendered"), list):
                role = "system" if record.get("renderedRole") == "system" else "user"
                texts = [_text_of(b.get("content")) for b in record["rendered"] if isinstance(b, dict)]
                for text in filter(None, texts):
                    yield [record], {"role": role, "content": text}
                if not any(texts):
                    yield [record], None
            else:
                yield [record], None
            k += 1

    def read(self, path: Path, ident: str) -> AgentSession:
        """The chain's records as Claude Code sends them, through the Anthropic Messages converter
        (context_shrink_wire); blocks it does not send (and records with none) are counted as bookkeeping."""
        data = read_file_bytes(path)
        records, skipped = _jsonl_records(decoded(data, path, "replace"))
        chain, compacted = self.chain(records)
        anthropic: list[dict[str, Any]] = []
        owners: list[list[dict[str, Any]]] = []
        unsent: collections.Counter[str] = collections.Counter()
        for group, turn in self.turns(chain):
            message = None if turn is None else _claude_sendable(turn, unsent)
            if message is None:
                record = group[0]
                attachment = record.get("attachment") if isinstance(record.get("attachment"), dict) else {}
                unsent[f"{record.get('type')} ({attachment.get('type') or record.get('subtype') or 'empty'})"] += 1
                continue
            anthropic.append(message)
            owners.append(group)
        view = messages_view({"messages": anthropic})
        refs = [tuple(ClaudeRecord(r["uuid"]) for r in owners[origin]) for origin in view.origins]
        in_chain = {r["uuid"] for r in chain}
        unsent.update(str(r.get("type")) for _, r in records if r.get("uuid") not in in_chain)
        first = next((r for _, r in records if r.get("sessionId")), {})
        return AgentSession(self.agent, str(first.get("sessionId") or path.stem), path, first.get("cwd"),
                            view.messages, refs, dict(unsent), compacted, skipped, basis=data)  # fmt: skip

    def rewrite(self, found: AgentSession, changes: SessionChanges, text: str) -> str:
        """Records of removed messages dropped (their children re-pointed to the nearest kept ancestor),
        thinking records of reasoning dropped, tool_result blocks edited or removed where the record holds
        more."""
        records, _ = _jsonl_records(text)
        by_uuid = {r["uuid"]: r for _, r in records if isinstance(r.get("uuid"), str)}
        owners: dict[str, list[int]] = collections.defaultdict(list)
        for i, refs in enumerate(found.refs):
            for ref in refs:
                owners[ref.uuid].append(i)
        removed = set(changes.removed)
        dropped = {u for u, idx in owners.items() if set(idx) <= removed}
        thinking = {r.uuid for i in changes.drop_reasoning for r in found.refs[i]}
        dropped |= {u for u in thinking if self.only_thinking(by_uuid.get(u, {}))}
        results: dict[Any, str | None] = {found.messages[i].get("tool_call_id"): None for i in removed
                                          if found.messages[i]["role"] == "tool"}  # fmt: skip
        results.update({found.messages[i].get("tool_call_id"): text for i, text in changes.edits.items()})
        shared = [i for u, idx in owners.items() if u not in dropped for i in idx
                  if i in removed and found.messages[i]["role"] != "tool"]  # fmt: skip
        if shared:
            raise ContextShrinkError(f"message {shared[0]} shares its Claude Code record with kept ones: not written")

        def parent(uuid: Any) -> Any:
            while isinstance(uuid, str) and uuid in dropped:
                uuid = by_uuid[uuid].get("parentUuid")
            return uuid

        def change(_: int, record: dict[str, Any]) -> dict[str, Any] | None:
            if record.get("uuid") in dropped:
                return None
            new = record
            for key in ("parentUuid", "leafUuid"):
                if new.get(key) in dropped:
                    new = {**new, key: parent(new[key])}
            blocks = _claude_blocks(record)
            if record.get("type") == "user" and any(isinstance(b, dict) and b.get("tool_use_id") in results
                                                    for b in blocks):  # fmt: skip
                new = {**new, "message": {**record["message"], "content": self.results(blocks, results)}}
            return new

        return rewrite_jsonl(jsonl_lines(text), change)

    @staticmethod
    def only_results(record: Mapping[str, Any]) -> bool:
        blocks = _claude_blocks(record)
        return bool(blocks) and all(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks)

    @staticmethod
    def only_thinking(record: Mapping[str, Any]) -> bool:
        blocks = _claude_blocks(record)
        return bool(blocks) and all(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
                                    for b in blocks)  # fmt: skip

    @staticmethod
    def results(blocks: list[Any], results: Mapping[Any, str | None]) -> list[Any]:
        """``blocks`` with the tool results named in ``results`` given their new text, or removed (None)."""
        out = []
        for block in blocks:
            named = isinstance(block, dict) and block.get("tool_use_id") in results
            if not named:
                out.append(block)
            elif (text := results[block["tool_use_id"]]) is not None:
                out.append({**block, "content": text})
        return out

    def compact(self, found: AgentSession, compaction: Compaction, text: str) -> str:
        """Claude Code's own compaction appended: a ``compact_boundary`` record, copies of the kept first
        records, the summary record (``isCompactSummary``), copies of the kept newest records, chained, and a
        ``last-prompt`` record naming the new leaf (``--resume`` starts there); the records before stay in the
        file, unsent."""
        records, _ = _jsonl_records(text)
        by_uuid = {r["uuid"]: r for _, r in records if isinstance(r.get("uuid"), str)}
        leaf = self.chain(records)[0][-1]
        keys = ("sessionId", "cwd", "version", "userType", "entrypoint", "gitBranch")
        common = {k: leaf[k] for k in keys if k in leaf} | {"isSidechain": False, "timestamp": _utc_stamp()}
        boundary = {**common, "parentUuid": None, "logicalParentUuid": leaf.get("uuid"), "type": "system",
                    "subtype": "compact_boundary", "content": "Conversation compacted", "isMeta": False,
                    "level": "info", "uuid": str(uuid_module.uuid4()),
                    "compactMetadata": {"trigger": "context-shrink", "folded": compaction.folded}}  # fmt: skip
        summary = {**common, "type": "user", "message": {"role": "user", "content": compaction.summary},
                   "isCompactSummary": True, "isVisibleInTranscriptOnly": True}  # fmt: skip
        chain = [boundary]
        for record in [*self.copied(found, compaction.head, by_uuid), summary,
                       *self.copied(found, compaction.tail, by_uuid)]:  # fmt: skip
            chain.append({**record, "parentUuid": chain[-1]["uuid"], "uuid": str(uuid_module.uuid4())})
        prompts = [r for _, r in records if r.get("type") == "last-prompt"]  # where --resume picks the leaf up
        last = {**(prompts[-1] if prompts else {"type": "last-prompt", "sessionId": common.get("sessionId")})}
        return _appended(text, [*chain, {**last, "leafUuid": chain[-1]["uuid"]}])

    @staticmethod
    def copied(found: AgentSession, indices: Sequence[int], by_uuid: Mapping[str, dict[str, Any]]) -> list[Any]:
        """The records the messages at ``indices`` came from, once each, in order."""
        uuids = dict.fromkeys(r.uuid for i in indices for r in found.refs[i])
        return [dict(by_uuid[u]) for u in uuids if u in by_uuid]

    def scrubbed_kept(self, record: dict[str, Any], holds: Callable[[Any], bool]) -> dict[str, Any]:
        """A kept record's ``toolUseResult`` (Claude Code's copy of a tool's output) goes when it holds one."""
        return (
            {k: v for k, v in record.items() if k != "toolUseResult"} if holds(record.get("toolUseResult")) else record
        )

    def scrubbed_unsent(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """``last-prompt`` keeps its leaf (``--resume`` needs it) and loses its text; other bookkeeping goes."""
        return {**record, "lastPrompt": ""} if record.get("type") == "last-prompt" else None


# --- Codex CLI: $CODEX_HOME/sessions/YYYY/MM/DD/rollout-...-<id>.jsonl -------------------------------------


def _codex_item(item: dict[str, Any]) -> dict[str, Any] | None:
    """A rollout item as a Responses input item the chat view reads, or None when the model is not sent it."""
    kind = item.get("type")
    if kind in ("message", "function_call", "function_call_output", "reasoning"):
        return item
    if kind == "custom_tool_call":  # apply_patch and other freeform tools
        return {"type": "function_call", "call_id": item.get("call_id"), "name": item.get("name"),
                "arguments": str(item.get("input") or "")}  # fmt: skip
    if kind == "custom_tool_call_output":
        return {"type": "function_call_output", "call_id": item.get("call_id"), "output": _text_of(item.get("output"))}
    if kind == "local_shell_call":
        return {"type": "function_call", "call_id": item.get("call_id"), "name": "local_shell",
                "arguments": json.dumps(item.get("action") or {}, ensure_ascii=False)}  # fmt: skip
    return None


def _replacement_history(record: Mapping[str, Any]) -> list[Any] | None:
    """A ``compacted`` record's replacement history, or None for any other record."""
    payload = record.get("payload")
    if (
        record.get("type") == "compacted"
        and isinstance(payload, dict)
        and isinstance(payload.get("replacement_history"), list)
    ):
        return payload["replacement_history"]
    return None


class CodexStore(JsonlStore):
    """Codex CLI: a rollout of ``response_item`` records; a ``compacted`` record's replacement history replaces
    everything before it. Beside it, a thread index (``thread_history_*.sqlite``) Codex projects from it."""

    agent = "codex"
    fixed_tokens, release = 8_100, "Codex CLI 0.171.0"
    conversation_records = ("response_item", "compacted", "session_meta", "turn_context", "world_state")

    def place(self, home: Path, environ: Mapping[str, str]) -> Path:
        return Path(environ.get("CODEX_HOME") or home / ".codex") / "sessions"

    def sessions(self, place: Path) -> list[dict[str, Any]]:
        found = []
        for path in store_files(place, "*/*/*/rollout-*.jsonl"):
            meta: Any = {}
            with contextlib.suppress(OSError, AttributeError):
                if path.is_file():  # never a FIFO: opening one would wait for a writer
                    with path.open(encoding="utf-8", errors="replace") as handle:
                        meta = json_or(handle.readline(1 << 20), {}).get("payload")
            meta = meta if isinstance(meta, dict) else {}
            found.append({"id": str(meta.get("id") or path.stem[-36:]), "cwd": meta.get("cwd"), "path": path})
        return found

    def read(self, path: Path, ident: str) -> AgentSession:
        """``response_item`` records (after a ``compacted`` record, its replacement history and what follows)
        read through the Responses chat view (context_shrink_wire). The first developer message Codex sends is rendered
        per request from ``session_meta``'s base instructions and ``world_state``: not in the view."""
        data = read_file_bytes(path)
        records, skipped = _jsonl_records(decoded(data, path, "replace"))
        meta = next((r.get("payload") or {} for _, r in records if r.get("type") == "session_meta"), {})
        items: list[dict[str, Any]] = []
        places: list[CodexItem] = []
        unsent: collections.Counter[str] = collections.Counter()
        compacted = False
        for number, record in records:
            payload = record.get("payload") if isinstance(record.get("payload"), dict) else {}
            if (history := _replacement_history(record)) is not None:
                kept = [(k, _codex_item(i)) for k, i in enumerate(history) if isinstance(i, dict)]
                items = [i for _, i in kept if i is not None]
                places = [CodexItem(number, k) for k, i in kept if i is not None]
                compacted = True
            elif record.get("type") == "response_item" and (item := _codex_item(payload)) is not None:
                items.append(item)
                places.append(CodexItem(number))
            else:
                unsent[f"{record.get('type')}" + (f" ({payload.get('type')})" if payload.get("type") else "")] += 1
        view = responses_view({"input": items})  # the base instructions are a template Codex renders per request
        refs = [tuple(places[i] for i in origin) for origin in view.origins]
        return AgentSession(self.agent, str(meta.get("id") or path.stem), path, meta.get("cwd"), view.messages, refs,
                            dict(unsent), compacted, skipped, basis=data)  # fmt: skip

    def rewrite(self, found: AgentSession, changes: SessionChanges, text: str) -> str:
        """Removed items' lines dropped (inside a compaction, its replacement history and metadata at the same
        indices), reasoning items of reasoning dropped, function outputs edited."""
        gone = {ref for i in changes.removed for ref in found.refs[i]}
        edits = {found.refs[i][-1]: text for i, text in changes.edits.items()}
        reasoning = {ref for i in changes.drop_reasoning for ref in found.refs[i]}

        def item_change(place: CodexItem, item: dict[str, Any]) -> dict[str, Any] | None:
            if place in gone or (place in reasoning and item.get("type") == "reasoning"):
                return None
            return {**item, "output": edits[place]} if place in edits else item

        def change(number: int, record: dict[str, Any]) -> dict[str, Any] | None:
            payload = record.get("payload")
            if record.get("type") == "response_item" and isinstance(payload, dict):
                new = item_change(CodexItem(number), payload)
                return None if new is None else record if new is payload else {**record, "payload": new}
            if (history := _replacement_history(record)) is None:
                return record
            keep = [
                (k, item_change(CodexItem(number, k), i) if isinstance(i, dict) else i) for k, i in enumerate(history)
            ]
            if all(new is history[k] for k, new in keep):
                return record
            payload = {**record["payload"], "replacement_history": [new for _, new in keep if new is not None]}
            metadata = payload.get("replacement_history_metadata")
            if isinstance(metadata, list) and len(metadata) == len(history):
                payload["replacement_history_metadata"] = [metadata[k] for k, new in keep if new is not None]
            return {**record, "payload": payload}

        return rewrite_jsonl(jsonl_lines(text), change)

    def compact(self, found: AgentSession, compaction: Compaction, text: str) -> str:
        """Codex's own compaction appended: a ``compacted`` record (with the next ``ordinal`` where the rollout
        numbers its records) whose replacement history is the kept first items, the summary as a user message,
        the kept newest items; the records before stay, unsent."""
        records, _ = _jsonl_records(text)
        lines = dict(records)

        def item(place: CodexItem) -> dict[str, Any]:
            record = lines[place.line]
            return record["payload"] if place.index is None else record["payload"]["replacement_history"][place.index]

        def items(indices: Sequence[int]) -> list[dict[str, Any]]:
            return [item(place) for place in dict.fromkeys(p for i in indices for p in found.refs[i])]

        summary = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": compaction.summary}]}
        history = [*items(compaction.head), summary, *items(compaction.tail)]
        ordinals = [r["ordinal"] for _, r in records if isinstance(r.get("ordinal"), int)]
        payload = {"message": compaction.summary, "replacement_history": history}
        record = {"timestamp": _utc_stamp("milliseconds"), **({"ordinal": max(ordinals) + 1} if ordinals else {}),
                  "type": "compacted", "payload": payload}  # fmt: skip
        return _appended(text, [record])

    def forget_index(self, found: AgentSession) -> None:
        """Codex's thread history index forgets this thread, so Codex projects it again from the rewritten
        rollout (a stale one reads past the end and stops updating)."""
        home = found.path.parents[4] if len(found.path.parents) > 4 else found.path.parent
        tables = ("thread_items", "thread_turns", "thread_history_projection_state", "thread_realtime_items")
        for index in home.glob("thread_history_*.sqlite"):
            try:
                with contextlib.closing(sqlite3.connect(index, timeout=2, isolation_level=None)) as db:
                    present = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                    db.execute("BEGIN IMMEDIATE")
                    for table in (t for t in tables if t in present):
                        db.execute(f"DELETE FROM {table} WHERE thread_id = ?", (found.id,))
                    db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise ContextShrinkError(f"Codex's thread index {index} could not be updated (is Codex running?): "
                                         f"{exc}") from None  # fmt: skip


# --- OpenCode: $XDG_DATA_HOME/opencode/opencode.db (SQLite): message and part rows holding JSON ------------


def _json_rows(db: Any, query: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows of ``query`` whose last column, JSON, reads as an object: the other columns, then it."""
    rows = [(*keys, parsed_record(data)) for *keys, data in db.execute(query, args).fetchall()]
    return [row for row in rows if row[-1] is not None]


def _state(part: dict[str, Any]) -> dict[str, Any]:
    return part["state"] if isinstance(part.get("state"), dict) else {}


def _opencode_output(part: dict[str, Any]) -> str:
    state = _state(part)
    if state.get("status") == "error":
        return str(state.get("error") or "error")
    return str(state.get("output") or "") if state.get("status") == "completed" else "[Tool execution was interrupted]"


def _opencode_message(
    info: dict[str, Any], parts: list[tuple[str, dict[str, Any]]]
) -> list[tuple[dict[str, Any], str]]:
    """One OpenCode message as chat messages with the part each came from: a tool part is a call on the
    assistant message and its result after it."""
    if info.get("role") == "user":
        text = [(str(p.get("text", "")), pid) for pid, p in parts if p.get("type") == "text"]
        text += [(OPENCODE_COMPACTION_PROMPT, pid) for pid, p in parts if p.get("type") == "compaction"]
        return [({"role": "user", "content": "\n".join(t for t, _ in text)}, text[0][1])] if text else []
    text = "\n".join(p.get("text", "") for _, p in parts if p.get("type") == "text")
    reasoning = "\n".join(p.get("text", "") for _, p in parts if p.get("type") == "reasoning")
    tools = [(pid, p) for pid, p in parts if p.get("type") == "tool"]
    arguments = [json.dumps(_state(p).get("input") or {}, ensure_ascii=False, separators=(",", ":"))
                 for _, p in tools]  # as OpenCode sends them (JSON.stringify)  # fmt: skip
    calls = [tool_call(p.get("callID"), p.get("tool"), a) for (_, p), a in zip(tools, arguments, strict=True)]
    if not (text or calls):
        return []
    owner = next((pid for pid, p in parts if p.get("type") in ("text", "tool")), "")
    results = [({"role": "tool", "tool_call_id": p.get("callID"), "content": _opencode_output(p)}, pid)
               for pid, p in tools]  # fmt: skip
    return [(assistant_message(text, calls, reasoning), owner), *results]


def _opencode_sent(rows: list[Any]) -> tuple[list[int], bool]:
    """Which rows OpenCode sends, in the order it sends them, and whether a compaction decided it. From the
    newest back to the last compaction a finished summary answers (a user message with a ``compaction``
    part; the summary is an assistant message with ``summary`` and ``finish`` whose ``parentID`` names it), or
    to that part's ``tail_start_id`` (the kept tail, older than the compaction); then, when the kept rows
    hold a compaction with a tail: that compaction and its summary first, the tail, what followed."""

    def compaction(k: int) -> dict[str, Any] | None:
        _, info, parts = rows[k]
        user = info.get("role") == "user"
        return next((p for _, p in parts if p.get("type") == "compaction"), None) if user else None

    answered: set[Any] = set()
    start, tail_id, decided = 0, None, False
    for k in range(len(rows) - 1, -1, -1):
        message_id, info, _ = rows[k]
        if tail_id is not None or (message_id in answered and (part := compaction(k)) is not None):
            tail_id = tail_id or part.get("tail_start_id")
            if not tail_id or message_id == tail_id:
                start, decided = k, True
                break
        elif info.get("role") == "assistant" and info.get("summary") and info.get("finish") and not info.get("error"):
            answered.add(info.get("parentID"))
    kept = list(range(start, len(rows)))
    marks = [j for j, k in enumerate(kept) if (part := compaction(k)) is not None and "tail_start_id" in part]
    if not marks:
        return kept, decided
    at = marks[-1]
    mark, tail_id = rows[kept[at]][0], (compaction(kept[at]) or {}).get("tail_start_id")
    summaries = [j for j in range(at + 1, len(kept)) if rows[kept[j]][1].get("role") == "assistant" and
                 rows[kept[j]][1].get("summary") and rows[kept[j]][1].get("parentID") == mark]  # fmt: skip
    summary = summaries[0] if summaries else -1
    tail = next((j for j, k in enumerate(kept) if rows[k][0] == tail_id), -1)
    if 0 <= tail < at < summary:
        return [*kept[at : summary + 1], *kept[tail:at], *kept[summary + 1 :]], True
    return kept, decided


def _row_suffixes(order: Sequence[int]) -> list[int]:
    """The positions ``k`` of a view whose messages come from rows ``order`` (row index per message) where the
    view from ``k`` on is exactly the rows from ``order[k]`` on that give messages, in row order: where a
    kept tail named by its first row can start."""
    shown = sorted(set(order))
    following = {row: shown[j + 1] if j + 1 < len(shown) else None for j, row in enumerate(shown)}
    starts, ok = [], False
    for k in range(len(order) - 1, -1, -1):
        row = order[k]
        ok = following[row] is None if k == len(order) - 1 else ok and order[k + 1] in (row, following[row])
        if ok and (k == 0 or order[k - 1] != row):
            starts.append(k)
    return starts[::-1]


def _opencode_ids(prefix: str, count: int) -> list[str]:
    """New ids in OpenCode's ascending form: the prefix, 12 hex digits of the millisecond clock x 4096 plus a
    counter (so they sort after every id made before), 14 random letters and digits."""
    now, alphabet = time.time_ns() // 1_000_000, string.digits + string.ascii_letters
    return [f"{prefix}_{(now * 4096 + k) & 0xFFFF_FFFF_FFFF:012x}" + "".join(random.choices(alphabet, k=14))
            for k in range(1, count + 1)]  # fmt: skip


def _busy(exc: sqlite3.Error) -> bool | None:
    """SQLite said the database is locked or busy (another connection is writing), read from its result code,
    never from its message; None where Python has no code (3.10) and the error is an OperationalError, which a
    lock raises among others."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is None:  # pragma: no cover (3.10)
        return None if isinstance(exc, sqlite3.OperationalError) else False
    return code & 0xFF in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED


def _locked(exc: sqlite3.Error, busy: bool | None) -> ContextShrinkError:
    """The error for a database SQLite would not read: locked (``busy``), or maybe locked (``busy`` None)."""
    said = "is locked (the agent is writing it)" if busy else "is locked (the agent is writing it) or unreadable"
    return ContextShrinkError(f"OpenCode's database {said}: {exc}")


@contextlib.contextmanager
def _opencode_transaction(path: Path) -> Iterator[sqlite3.Connection]:
    """One immediate transaction on OpenCode's database (WAL-safe): committed, or rolled back on any error."""
    with contextlib.closing(sqlite3.connect(path, timeout=1, isolation_level=None)) as db:
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise ContextShrinkError(f"OpenCode's database is locked (the agent is writing it): {exc}") from None
        try:
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):  # a failed COMMIT may have rolled back already
                db.execute("ROLLBACK")
            if not isinstance(exc, sqlite3.Error):
                raise
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF == 13:  # SQLITE_FULL
                raise ContextShrinkError(f"the disk holding {path} is full: nothing written") from None
            raise ContextShrinkError(f"OpenCode's database has a layout this version does not know: {exc}") from None


Events = list[tuple[str, dict[str, Any]]]  # OpenCode's sync events: (type, data)


class OpenCodeStore(AgentStore):
    """OpenCode: one SQLite database for every session, ``message`` and ``part`` rows holding JSON, and (from
    OpenCode 1.18) an ``event`` log replayed to rebuild them; a write is one immediate transaction that tells
    the log each change, as OpenCode tells its own."""

    agent = "opencode"
    fixed_tokens, release = 6_700, "OpenCode 1.18.33"

    def place(self, home: Path, environ: Mapping[str, str]) -> Path:
        return Path(environ.get("XDG_DATA_HOME") or home / ".local" / "share") / "opencode" / "opencode.db"

    def sessions(self, place: Path) -> list[dict[str, Any]]:
        if not place.is_file():
            return []
        try:
            with _read_only(place) as db:
                rows = db.execute("SELECT id, directory, title, time_updated FROM session").fetchall()
        except sqlite3.Error as exc:
            if (busy := _busy(exc)) is not False:  # not "no session": say why
                raise _locked(exc, busy) from None
            return []
        return [{"id": i, "cwd": d, "title": t, "path": place, "updated_ms": u} for i, d, t, u in rows]

    @staticmethod
    def rows(db: sqlite3.Connection, session: str) -> tuple[list[Any], int]:
        """A session's messages in order, each ``(id, JSON, [(part id, part JSON)])``, and how many rows did
        not read as a JSON object (skipped: OpenCode fails on them)."""
        try:
            messages = _json_rows(db, "SELECT id, data FROM message WHERE session_id = ? ORDER BY time_created, id",
                                  session)  # fmt: skip
            parts = _json_rows(db, "SELECT message_id, id, data FROM part WHERE session_id = ? "
                                   "ORDER BY time_created, id", session)  # fmt: skip
            count = ("SELECT (SELECT count(*) FROM message WHERE session_id = ?1) + (SELECT count(*) FROM part "
                     "WHERE session_id = ?1)")  # fmt: skip
            total = db.execute(count, (session,)).fetchone()[0]
        except sqlite3.Error as exc:
            if (busy := _busy(exc)) is not False:
                raise _locked(exc, busy) from None
            raise ContextShrinkError(f"OpenCode's database has a layout this version does not know: {exc}") from None
        by_message: dict[str, list[tuple[str, dict[str, Any]]]] = collections.defaultdict(list)
        for message_id, part_id, part in parts:
            by_message[message_id].append((part_id, part))
        return [(i, info, by_message[i]) for i, info in messages], total - len(messages) - len(parts)

    def read(self, path: Path, ident: str, db: sqlite3.Connection | None = None) -> AgentSession:
        """The session as OpenCode sends it (:func:`_opencode_sent`): user text parts (a compaction part as
        the question OpenCode asks), assistant text and tool parts (a call and its result are one part). Read
        through ``db`` (a write's own transaction), else a read-only connection."""
        if db is None:
            if not path.is_file():
                raise ContextShrinkError(f"OpenCode's database {path} does not exist")
            with _read_only(path) as ro:
                return self.read(path, ident, ro)
        rows, unreadable = self.rows(db, ident)
        if not rows:
            raise ContextShrinkError(f"OpenCode has no session {ident!r} in {path}")
        sent, compacted = _opencode_sent(rows)
        messages: list[dict[str, Any]] = []
        refs: list[tuple[StoreRef, ...]] = []
        order: list[int] = []
        unsent: collections.Counter[str] = collections.Counter()
        for k in sent:
            message_id, info, parts = rows[k]
            converted = _opencode_message(info, parts)
            messages += [m for m, _ in converted]
            refs += [(OpenCodePart(message_id, pid),) for _, pid in converted]
            order += [k] * len(converted)
            unsent.update(f"part ({p.get('type')})" for _, p in parts
                          if p.get("type") not in ("text", "tool", "reasoning", "compaction"))  # fmt: skip
        unsent["message (before the last compaction)"] += len(rows) - len(sent)
        where = rows[0][1].get("path") if isinstance(rows[0][1].get("path"), dict) else {}
        bookkeeping = {k: v for k, v in unsent.items() if v}
        return AgentSession(self.agent, ident, path, where.get("cwd"), messages, refs, bookkeeping, compacted,
                            unreadable, tuple(_row_suffixes(order)))  # fmt: skip

    def write(self, found: AgentSession, changes: SessionChanges, reads_back: ReadsBack) -> Path:
        """In one immediate transaction (OpenCode waits for it): the session read again through it must be
        what ``found`` holds (else nothing is written: OpenCode wrote to it since); a backup; removed
        messages' rows and parts deleted, reasoning parts of reasoning deleted, tool outputs edited in their
        part's JSON, a compaction appended (:meth:`compact`); the event log told each change (with
        ``erased``, first its copies of the removed texts deleted); the session read back through the same
        transaction must satisfy ``reads_back``, else it is rolled back. Nothing OpenCode commits before or
        after is ever undone; a refused write leaves no backup."""
        message_of = {i: found.refs[i][0].message for i in range(len(found.messages))}
        removed = {message_of[i] for i in changes.removed}
        calls = {message_of[j] for j in changes.removed if found.messages[j]["role"] != "tool"}
        if lone := [i for i in changes.removed if message_of[i] not in calls]:
            raise ContextShrinkError(
                f"tool result {lone[0]} without its call cannot be removed from an OpenCode session"
            )
        now = time.time_ns() // 1_000_000
        saved: Path | None = None
        try:
            with _opencode_transaction(found.path) as db:
                if self.read(found.path, found.id, db).messages != found.messages:
                    raise ContextShrinkError(f"OpenCode wrote to session {found.id} since it was read: nothing "
                                             "written; read it again and retry")  # fmt: skip
                saved = self.backup(found.path)
                events = self.apply(db, found, changes, removed, message_of, now)
                if self.has_log(db) and events:
                    self.log(db, found.id, events)
                if not reads_back(self.read(found.path, found.id, db), False):
                    raise ContextShrinkError("the opencode session did not read back as written; nothing changed "
                                             "(the transaction was rolled back)")  # fmt: skip
        except BaseException:
            if saved is not None:
                saved.unlink(missing_ok=True)
            raise
        return saved

    def apply(self, db: sqlite3.Connection, found: AgentSession, changes: SessionChanges, removed: set[str],
              message_of: Mapping[int, str], now: int) -> Events:  # fmt: skip
        """The changes made to the rows inside the transaction; the events that tell them."""
        if self.has_log(db):  # a database without one: OpenCode before 1.18
            for copy in changes.erased:  # the event log's copies of what was removed
                db.execute("DELETE FROM event WHERE aggregate_id = ? AND instr(data, ?) > 0", (found.id, copy))
        events: Events = []
        for message in removed:
            db.execute("DELETE FROM part WHERE message_id = ?", (message,))
            db.execute("DELETE FROM message WHERE id = ?", (message,))
            events.append(("message.removed", {"messageID": message}))
        for message in (message_of[i] for i in changes.drop_reasoning):
            for part_id, part in _json_rows(db, "SELECT id, data FROM part WHERE message_id = ?", message):
                if part.get("type") == "reasoning":
                    db.execute("DELETE FROM part WHERE id = ?", (part_id,))
                    events.append(("message.part.removed", {"messageID": message, "partID": part_id}))
        for i, text in changes.edits.items():
            events.append(self.edit(db, found.id, found.refs[i][0], text, now))
        if changes.compaction:
            events += self.compact(db, found, changes.compaction, now)
        return events

    @staticmethod
    def edit(
        db: sqlite3.Connection, session: str, ref: OpenCodePart, text: str, now: int
    ) -> tuple[str, dict[str, Any]]:
        """A tool part's output replaced in its JSON; the event that tells it."""
        part = next((p for _, p in _json_rows(db, "SELECT id, data FROM part WHERE id = ?", ref.part)), None)
        if part is None:
            raise ContextShrinkError(f"OpenCode's part {ref.part} changed since it was read: nothing written")
        part["state"] = {**_state(part), "output": text}
        db.execute("UPDATE part SET data = ? WHERE id = ?", (json.dumps(part, ensure_ascii=False), ref.part))
        return "message.part.updated", {"part": {"id": ref.part, "sessionID": session, "messageID": ref.message,
                                                 **part}, "time": now}  # fmt: skip

    def compact(self, db: sqlite3.Connection, found: AgentSession, compaction: Compaction, now: int) -> Events:
        """OpenCode's own compaction appended: a user message with a ``compaction`` part whose ``tail_start_id``
        names the first kept message, and the finished summary message answering it (``summary``, mode and
        agent ``compaction``, ``parentID`` the user message) with the summary as its text part; the rows before
        stay, unsent but for the tail."""
        infos = [info for _, info in _json_rows(db, "SELECT id, data FROM message WHERE session_id = ? "
                                                 "ORDER BY time_created DESC, id DESC", found.id)]  # fmt: skip
        user, assistant = (next((i for i in infos if i.get("role") == role), {}) for role in ("user", "assistant"))
        asked, answer = _opencode_ids("msg", 2)
        question = {"role": "user", "time": {"created": now}, **{k: user[k] for k in ("agent", "model") if k in user}}
        summary = {"role": "assistant", "parentID": asked, "mode": "compaction", "agent": "compaction", "summary": True,
                   **{k: assistant[k] for k in ("path", "modelID", "providerID") if k in assistant}, "cost": 0,
                   "tokens": {"input": 0, "output": 0, "reasoning": 0, "cache": {"read": 0, "write": 0}},
                   "time": {"created": now + 1, "completed": now + 1}, "finish": "stop"}  # fmt: skip
        mark: dict[str, Any] = {"type": "compaction", "auto": False, "overflow": False}
        if compaction.tail:
            mark["tail_start_id"] = found.refs[compaction.tail[0]][0].message
        text = {"type": "text", "text": compaction.summary, "time": {"start": now + 1, "end": now + 1}}
        return [*self.insert(db, found.id, asked, question, mark, now),
                *self.insert(db, found.id, answer, summary, text, now + 1)]  # fmt: skip

    @staticmethod
    def insert(db: sqlite3.Connection, session: str, message_id: str, info: dict[str, Any], part: dict[str, Any],
               when: int) -> Events:  # fmt: skip
        """A new message with its one part; the events that tell it."""
        part_id = _opencode_ids("prt", 1)[0]
        db.execute("INSERT INTO message (id, session_id, time_created, time_updated, data) VALUES (?, ?, ?, ?, ?)",
                   (message_id, session, when, when, json.dumps(info, ensure_ascii=False)))  # fmt: skip
        db.execute("INSERT INTO part (id, message_id, session_id, time_created, time_updated, data) "
                   "VALUES (?, ?, ?, ?, ?, ?)",
                   (part_id, message_id, session, when, when, json.dumps(part, ensure_ascii=False)))  # fmt: skip
        whole = {"id": part_id, "sessionID": session, "messageID": message_id, **part}
        return [("message.updated", {"info": {"id": message_id, "sessionID": session, **info}}),
                ("message.part.updated", {"part": whole, "time": when})]  # fmt: skip

    @staticmethod
    def has_log(db: sqlite3.Connection) -> bool:
        """Whether the database has OpenCode's event log (1.18 does)."""
        found = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN "
                           "('event', 'event_sequence')")  # fmt: skip
        return found.fetchone()[0] == 2

    @staticmethod
    def log(db: sqlite3.Connection, session: str, events: Events) -> None:
        """The session's event log (``event``, OpenCode's sync log, replayed to rebuild the rows) told the same
        change as the rows: one event each, with the next sequence numbers. A session with no log gets none."""
        row = db.execute("SELECT seq FROM event_sequence WHERE aggregate_id = ?", (session,)).fetchone()
        if row is None:
            return
        for k, (event_id, (kind, data)) in enumerate(zip(_opencode_ids("evt", len(events)), events, strict=True), 1):
            record = json.dumps({"sessionID": session, **data}, ensure_ascii=False)
            db.execute("INSERT INTO event (id, aggregate_id, seq, type, data) VALUES (?, ?, ?, ?, ?)",
                       (event_id, session, row[0] + k, f"{kind}.1", record))  # fmt: skip
        db.execute("UPDATE event_sequence SET seq = ? WHERE aggregate_id = ?", (row[0] + len(events), session))

    def backup(self, path: Path) -> Path:
        """A copy through SQLite's backup API, so the WAL is included (after checking there is room for it)."""
        wal = path.with_name(path.name + "-wal")
        ensure_room(path.parent, path.stat().st_size + (wal.stat().st_size if wal.exists() else 0), "the backup")
        with Folder(path.parent) as folder:  # an empty file: SQLite writes the copy into it
            saved = folder.backup(path.name, None, stat.S_IMODE(path.stat().st_mode))
        try:
            with contextlib.closing(sqlite3.connect(path)) as source, \
                    contextlib.closing(sqlite3.connect(saved)) as copy:  # fmt: skip
                source.backup(copy)
        except sqlite3.Error as exc:
            saved.unlink(missing_ok=True)
            raise ContextShrinkError(f"cannot back {path} up (nothing written): {exc}") from None
        return saved

    def last_change(self, found: AgentSession) -> float:
        """The session's newest ``time_updated`` (its rows, not the file: any reader touches SQLite's files)."""
        query = ("SELECT max(t) FROM (SELECT max(time_updated) AS t FROM message WHERE session_id = ?1 "
                 "UNION ALL SELECT max(time_updated) FROM part WHERE session_id = ?1 "
                 "UNION ALL SELECT time_updated FROM session WHERE id = ?1)")  # fmt: skip
        try:
            with _read_only(found.path) as db:
                newest = db.execute(query, (found.id,)).fetchone()[0]
        except sqlite3.Error:
            newest = None
        return newest / 1000 if isinstance(newest, int | float) else super().last_change(found)

    def sent_after(self, new: Sequence[Mapping[str, Any]], compaction: Compaction | None) -> list[Any]:
        """After a compaction OpenCode sends its question first, then the summary and the tail."""
        return [{"role": "user", "content": OPENCODE_COMPACTION_PROMPT}, *new] if compaction else list(new)


AGENT_STORES: dict[str, AgentStore] = {store.agent: store for store in (ClaudeStore(), CodexStore(), OpenCodeStore())}


# --- finding and reading a session --------------------------------------------------------------------------


def session_stores(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Where each agent keeps its sessions: Claude Code ``~/.claude/projects``, Codex CLI
    ``$CODEX_HOME/sessions`` (``~/.codex``), OpenCode ``$XDG_DATA_HOME/opencode/opencode.db``."""
    environ = os.environ if environ is None else environ
    home = Path(environ.get("HOME") or Path.home())
    return {agent: store.place(home, environ) for agent, store in AGENT_STORES.items()}


def session_spec(spec: str, allowed: Sequence[str]) -> tuple[str, str]:
    """``"<agent>:<id>"`` or ``"<agent>:latest"`` split and checked against the stores the user allowed."""
    agent, _, ident = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if agent not in AGENT_STORES or not ident or not re.fullmatch(r"[\w.:-]{1,200}", ident):
        raise ContextShrinkError(
            f"session must be 'claude:<id>', 'codex:<id>' or 'opencode:<id>' (or ':latest'), got {str(spec)[:80]!r}"
        )
    if agent not in allowed:
        raise ContextShrinkError(
            f"reading {agent} sessions is not allowed: set CONTEXT_SHRINK_SESSION_STORES={agent} (or a list such "
            "as claude,codex,opencode) to let the tools read that agent's own session store"
        )
    return agent, ident


def list_sessions(agents: Sequence[str], environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The sessions of the allowed ``agents``, newest first: ``session`` (the spec the tools take), agent,
    id, the working directory it ran in, when it last changed and where it is stored."""
    places = session_stores(environ)
    found = []
    for agent in agents:
        for entry in AGENT_STORES[agent].sessions(places[agent]):
            with contextlib.suppress(OSError):
                updated = entry.pop("updated_ms", None)
                updated = updated / 1000 if updated else entry["path"].stat().st_mtime
                found.append({"session": f"{agent}:{entry['id']}", "agent": agent, **entry, "updated": updated,
                              "path": str(entry["path"])})  # fmt: skip
    found.sort(key=lambda e: e["updated"], reverse=True)
    for entry in found:
        entry["updated"] = datetime.datetime.fromtimestamp(entry["updated"], datetime.timezone.utc).isoformat()
    return found[:SESSION_LIST_LIMIT]


def read_session(spec: str, allowed: Sequence[str], cwd: Path, environ: Mapping[str, str] | None = None
                 ) -> AgentSession:  # fmt: skip
    """The session ``spec`` names (``"<agent>:latest"``: the newest one that ran in ``cwd``), read from the
    agent's store; only agents in ``allowed`` are reachable."""
    agent, ident = session_spec(spec, allowed)
    sessions = [s for s in list_sessions([agent], environ) if s["agent"] == agent]
    if ident == "latest":
        here = [s for s in sessions if isinstance(s.get("cwd"), str) and Path(s["cwd"]).resolve() == cwd.resolve()]
        if not here:
            raise ContextShrinkError(f"no {agent} session ran in {cwd} (list_sessions names the sessions found)")
        chosen = here[0]
    else:
        chosen = next((s for s in sessions if s["id"] == ident), None)
        if chosen is None:
            raise ContextShrinkError(f"no {agent} session {ident!r} in {session_stores(environ)[agent]}")
    return _read_store(agent, Path(chosen["path"]), chosen["id"])


def _read_store(agent: str, path: Path, ident: str) -> AgentSession:
    """The session ``ident`` of ``agent`` read from ``path`` (a JSONL file, or OpenCode's database)."""
    return AGENT_STORES[agent].read(path, ident)


# --- a shrunk view as a change to the store, written back -------------------------------------------------------


def _embedding(old: Sequence[str], new: Sequence[str]) -> list[int | None]:
    """Where each key of ``new`` is in ``old``, keeping their order: the first occurrence after the one
    before (None when there is none)."""
    where: dict[str, list[int]] = collections.defaultdict(list)
    for i, key in enumerate(old):
        where[key].append(i)
    out: list[int | None] = []
    last = -1
    for key in new:
        places = where.get(key, [])
        k = bisect.bisect_right(places, last)
        last = places[k] if k < len(places) else last
        out.append(places[k] if k < len(places) else None)
    return out


def kept_origins(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """For each message of ``new`` (``old`` pruned, trimmed or compacted: order kept), where it is in ``old``
    unchanged, else None. Identical messages are told apart by order (:func:`_embedding`); after a new
    summary, from the end (the kept tail is the newest)."""
    keys, kept = [fingerprint(m) for m in old], [fingerprint(m) for m in new]
    known = set(keys)
    split = next((j for j, m in enumerate(new) if kept[j] not in known and
                  plain_content(m.get("content")).startswith(SUMMARY_MARKER)), len(new))  # fmt: skip
    if split == len(new):
        return _embedding(keys, kept)
    back = _embedding(keys[::-1], kept[:split:-1])  # the tail, newest first, in the history newest first
    return [*_embedding(keys, kept[:split]), None, *(None if p is None else len(old) - 1 - p for p in back[::-1])]


def session_changes(found: AgentSession, new: Sequence[Mapping[str, Any]]) -> SessionChanges:
    """How ``new`` (the session's view after pruning, trimming or compacting) differs from the session's view:
    the messages removed, tool results replaced, assistant messages that lost only their reasoning, or one
    summary among kept messages. Any other change (an edited text) raises: it cannot be written back."""
    origins = kept_origins(found.messages, new)
    kept = {i for i in origins if i is not None}
    fresh = [m for m, i in zip(new, origins, strict=True) if i is None]
    removed = [i for i in range(len(found.messages)) if i not in kept]
    if any(plain_content(m.get("content")).startswith(SUMMARY_MARKER) for m in fresh):
        return SessionChanges(compaction=_session_compaction(found, new, origins))
    edits: dict[int, str] = {}
    drops: list[int] = []
    for m in fresh:
        twin = next((i for i in removed if _same_slot(found.messages[i], m)), None)
        if twin is None:
            gist = one_line(plain_content(m.get("content")), 60)
            raise ContextShrinkError(
                f"this change cannot be written to a {found.agent} session yet: a new {message_kind(m)} ({gist})"
            )
        removed.remove(twin)
        if m["role"] == "tool":
            edits[twin] = plain_content(m.get("content"))
        else:
            drops.append(twin)
    return SessionChanges(tuple(removed), edits, tuple(drops))


def _session_compaction(found: AgentSession, new: Sequence[Mapping[str, Any]], origins: list[Any]) -> Compaction:
    """A compaction of the session: one summary, and the messages kept before and after it unchanged and in
    their order (they are copied after the agent's own compaction marker); anything else raises."""
    at = [j for j, origin in enumerate(origins) if origin is None]
    head, tail = origins[: at[0]], origins[at[0] + 1 :]
    total = len(found.messages)
    if len(at) != 1 or [*head, *tail] != sorted(set(head) | set(tail)):
        raise ContextShrinkError(
            "a compaction can be written to an agent's session only as one summary among messages kept "
            "unchanged and in order"
        )
    if found.tail_starts is not None and (head or (tail and (tail[0] not in found.tail_starts or
                                                              tail != list(range(tail[0], total))))):  # fmt: skip
        raise ContextShrinkError(
            f"a compaction of this {found.agent} session can keep after its summary only the newest messages, "
            f"from a message where {found.agent} can start its kept tail (compact_context plans it so)"
        )
    summary = plain_content(new[at[0]].get("content"))
    return Compaction(summary, tuple(head), tuple(tail), total - len(head) - len(tail))


def _same_slot(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """``new`` replaces ``old`` in a way a store can hold: the same tool call's result with other text, or
    the same assistant message without its reasoning."""
    if old.get("role") == new.get("role") == "tool":
        return old.get("tool_call_id") == new.get("tool_call_id")
    return old.get("role") == "assistant" and fingerprint(without_reasoning(old)) == fingerprint(new)


def _erased_texts(found: AgentSession, changes: SessionChanges) -> tuple[str, ...]:
    """How the texts removed from what the model sees look inside a JSON store (their first 64 characters,
    escaped), to find the hidden copies of them."""
    texts = [plain_content(found.messages[i].get("content")) for i in [*changes.removed, *changes.edits]]
    # the start as escaped once, and a stretch that needs no escaping, found however deep a copy is quoted
    plain = [max(re.split(r'[\x00-\x1f"\\]', t), key=len)[:64] for t in texts]
    found_in = [json.dumps(t[:64], ensure_ascii=False)[1:-1] for t in texts] + plain
    return tuple(t for t in dict.fromkeys(found_in) if len(t.strip()) >= 24)


def _view_key(message: Mapping[str, Any], compaction: Compaction | None) -> str:
    """What a store must give back for ``message``: the message itself; after a compaction its text, calls
    and result id (the agent's own shapes differ), a summary in any role."""
    if not compaction:
        return fingerprint(message)
    summary = plain_content(message.get("content")).startswith(SUMMARY_MARKER)
    return canonical_json(["summary" if summary else message.get("role"), plain_content(message.get("content")),
                           message.get("tool_calls"), message.get("tool_call_id")])  # fmt: skip


def write_session(found: AgentSession, new: Sequence[Mapping[str, Any]], dry_run: bool, now: float | None = None,
                  scrub: bool = False) -> dict[str, Any]:  # fmt: skip
    """Write ``new`` (the session's view, pruned, trimmed or compacted) back to the agent's store, in its own
    format, after a backup; ``dry_run`` only says what would change. A store changed in the last
    :data:`SESSION_QUIET_SECONDS` is refused (the agent may be writing it), and so is one that changed since
    it was read (but for lines a JSONL agent appended, which are kept). The store is read again after the
    write and must give ``new``; if not, the write is undone (nothing the agent wrote meanwhile is lost).
    A disk without room for the backup and the new store is refused before anything is written."""
    store = AGENT_STORES[found.agent]
    changes = session_changes(found, new)
    c = changes.compaction
    report = {"session": f"{found.agent}:{found.id}", "removed": len(changes.removed),
              "tool_results_replaced": len(changes.edits), "reasoning_removed": len(changes.drop_reasoning),
              "folded_into_summary": c.folded if c else 0, "dry_run": dry_run, "backup": None,
              "scrubbed": scrub}  # fmt: skip
    if dry_run or not changes:
        return report
    age = (time.time() if now is None else now) - store.last_change(found)
    if age < SESSION_QUIET_SECONDS:
        raise ContextShrinkError(f"{found.path} changed {age:.1f} s ago: the agent may be writing it; nothing "
                                 f"written (try again when it has been idle {SESSION_QUIET_SECONDS:g} s)")  # fmt: skip
    if scrub:
        changes = dataclasses.replace(changes, erased=_erased_texts(found, changes))
    want = [_view_key(m, c) for m in store.sent_after(new, c)]

    def reads_back(again: AgentSession, appended: bool) -> bool:
        """The store gives ``new`` (followed by what the agent appended meanwhile, if it did)."""
        keys = [_view_key(m, c) for m in again.messages]
        return keys[: len(want)] == want if appended else keys == want

    saved = store.write(found, changes, reads_back)
    return {**report, "backup": str(saved)}


# =============================================================================
# 4. What the MCP tools say of a session they read or wrote
# =============================================================================


def session_report(found: AgentSession | None) -> dict[str, Any]:
    """What a result says about the session it read: where, what the model is not sent, for each message id
    the store records it came from, and what the agent adds on top of the history (``agent_adds``: its system
    prompt and tools, which no store keeps; measured for the release the README names)."""
    if found is None:
        return {}
    sources = dict(zip(message_ids(found.messages), found.sources, strict=True))
    store = AGENT_STORES[found.agent]
    adds = {
        "tokens": store.fixed_tokens or None,
        "measured_with": store.release or None,
        "note": "the history alone is counted here; the agent sends its own system prompt and tools on top "
        "(not in its store: about this many tokens with that release, more with MCP servers or plugins)",
    }
    return {"session": {"session": f"{found.agent}:{found.id}", "path": str(found.path), "cwd": found.cwd,
                        "compacted": found.compacted, "unsent_records": found.bookkeeping,
                        "unreadable_lines": found.skipped_lines, "sources": sources, "agent_adds": adds}}  # fmt: skip


async def session_result(found: AgentSession, result: dict[str, Any], dry_run: bool | None, scrub: bool = False
                         ) -> dict[str, Any]:  # fmt: skip
    """A trim, prune or compaction of an agent's session: written back to its store unless ``dry_run`` (the
    default), the hidden copies of what was removed erased too with ``scrub``; reported without the messages
    (the store holds them)."""
    written = await anyio.to_thread.run_sync(
        functools.partial(write_session, found, result["messages"], dry_run is not False, scrub=scrub)
    )
    report = session_report(found)
    adds, budget = report["session"]["agent_adds"]["tokens"], result.get("max_context_tokens")
    if isinstance(budget, int) and adds and isinstance(result.get("tokens_after"), int):  # the request it will send
        room = budget - int(result.get("reserve_tokens") or 0)
        report["session"]["fits_with_agent"] = result["tokens_after"] + adds <= room
    return {**result, "messages": None, "dry_run": written["dry_run"], **report, "session_write": written}
