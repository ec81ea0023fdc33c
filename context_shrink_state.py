"""context_shrink_state: the proxy's store (SQLite, Redis, memory) and the archive of what it folded away.

A companion of :mod:`context_shrink` (it imports the core; the core reaches it through
:func:`context_shrink.companion` when ``recall_context`` first searches). Each store is a
:class:`context_shrink.Store`: the core's :class:`context_shrink.Tables` plus the archive, which answers
``recall_context``'s query the same on every store. :func:`open_store` opens the one ``--state`` names.
"""

from __future__ import annotations

__all__ = [
    "ARCHIVE_FIELDS",
    "ARCHIVE_TERMS",
    "TYPED",
    "MemoryStore",
    "MirroredStore",
    "RedisStore",
    "SqliteStore",
    "archive_entries",
    "archive_files",
    "conversation_id",
    "default_state_path",
    "folded_away",
    "fts_query",
    "message_hash",
    "open_store",
    "read_archive",
    "recalled_elsewhere",
]


import collections
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import sqlite3
import sys
import threading
import time
import unicodedata
import urllib.parse
import uuid as uuid_module
from collections.abc import (
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any

from context_shrink import (
    STATE_MAX_DAYS,
    STATE_TABLES,
    ContextShrinkError,
    MemoryTables,
    ServerState,
    Store,
    fingerprint,
    json_or,
    leading_system,
    log,
    plain_content,
    state_key,
)

# =============================================================================
# 2. The archive and the state stores: what the proxy learnt and folded away, kept across restarts
#    and replicas (SQLite, the default; Redis; memory)
# =============================================================================

# --- the archive: what a shrunk request no longer carries, kept verbatim for recall_context --------------
# It lives in the state store (below); the folder of JSONL files an earlier version wrote is read once, to be
# imported into it.

ARCHIVE_HEAD_MESSAGES = 2  # a conversation is identified by a hash of its first non-system messages


def state_folder(environ: Mapping[str, str] | None = None) -> Path:
    """This module's folder in the user's state directory, ``$XDG_STATE_HOME/context-shrink`` (``~/.local/state``)."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_STATE_HOME", "").strip() or Path.home() / ".local" / "state") / "context-shrink"


def default_archive_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where an earlier version kept its JSONL archive, ``$XDG_STATE_HOME/context-shrink/archive``
    (``~/.local/state``); ``CONTEXT_SHRINK_ARCHIVE_DIR`` and ``--archive-dir`` override it
    (:meth:`Settings.archive_dir`)."""
    return state_folder(environ) / "archive"


def conversation_id(messages: Sequence[Mapping[str, Any]]) -> str:
    """A stable id for a conversation: a hash of its leading system messages and first two others, which
    an agent resends unchanged on every turn."""
    lead = leading_system(messages)
    head = [*messages[:lead], *messages[lead : lead + ARCHIVE_HEAD_MESSAGES]]
    return fingerprint(head)[:16]


def message_hash(message: Mapping[str, Any]) -> str:
    return fingerprint(message)


def folded_away(
    original: Sequence[Mapping[str, Any]], shrunk: Sequence[Mapping[str, Any]]
) -> list[tuple[int, Mapping[str, Any]]]:
    """The original messages (with their index) that do not appear verbatim in the shrunk request."""
    kept = {message_hash(m) for m in shrunk}
    return [(i, m) for i, m in enumerate(original) if message_hash(m) not in kept]


ARCHIVE_MAX_BYTES = 256 * 1024 * 1024  # the whole archive; the oldest messages go first beyond it
ARCHIVE_MAX_DAYS = 30  # messages archived longer ago than this are removed
ARCHIVE_NAME = re.compile(r"([0-9a-f]{16})(?:\.(\d+))?\.jsonl")  # an earlier version's file, live or rotated


def archive_files(directory: Path, conversation: str | None = None) -> list[Path]:
    """The archive's files (of one conversation), each conversation's oldest first: its rotated files in
    the order they were rotated, then its live file."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = ARCHIVE_NAME.fullmatch(entry.name)
            if match and (conversation is None or match[1] == conversation) and entry.is_file(follow_symlinks=False):
                found.append((match[1], int(match[2]) if match[2] else math.inf, Path(entry.path)))
    return [path for *_, path in sorted(found)]


def read_archive(directory: Path, conversation: str | None = None) -> list[dict[str, Any]]:
    """Every entry of the archive (or of one conversation), oldest first within each conversation, rotated
    files included."""
    if conversation is not None and not re.fullmatch(r"[0-9a-f]{16}", conversation):
        raise ContextShrinkError(f"conversation must be a 16-character id from the archive, got {conversation!r}")
    entries = []
    for path in archive_files(directory, conversation):
        with contextlib.suppress(OSError):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                entry = json_or(line)
                if isinstance(entry, dict) and "message" in entry:
                    entries.append({**entry, "conversation": path.name[:16]})
    return entries


# --- the state store: what the proxy learnt, across restarts and replicas, and the archive's index ------------

STATE_RETRY_SECONDS = 5.0  # how often an unreachable store is tried again


def default_state_path(environ: Mapping[str, str] | None = None) -> Path:
    """The default store, ``$XDG_STATE_HOME/context-shrink/state.sqlite3`` (``~/.local/state``)."""
    return state_folder(environ) / "state.sqlite3"


TYPED = "typed"  # the action of an archive entry kept when first seen: what the user typed


def archive_entries(
    original: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]], action: str, typed: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """What ``sent`` no longer carries of ``original``, and the user's messages of ``original`` first seen (their
    indices, ``typed``: :data:`TYPED`), as archive entries (each message once, by its hash)."""
    conversation, now, entries = conversation_id(original), int(time.time()), {}
    chosen = [*((k, m, action) for k, m in folded_away(original, sent)),
              *((k, original[k], TYPED) for k in typed if 0 <= k < len(original))]  # fmt: skip
    for index, message, why in chosen:
        digest = message_hash(message)
        entries.setdefault(digest, {"id": digest[:12], "hash": digest, "conversation": conversation, "index": index,
                                    "action": why, "time": now, "message": message,
                                    "size": len(json.dumps(message, ensure_ascii=False, default=str))})  # fmt: skip
    return list(entries.values())


# The archive's query, the same on every store (each answers it with SQLite's FTS5): words (every one must be
# there), "a phrase" (its words in a row), word* (a prefix); matched on the text's words (letters and digits,
# case and Latin diacritics folded), ranked by BM25 over the whole archive, then newest first; an entry id (or
# the start of one, six hex digits or more) finds that entry.
ARCHIVE_FIELDS = ("id", "conversation", "index", "action", "time", "message")
ARCHIVE_WORD = re.compile(r"[^\W_]+")  # a word: letters and digits


def archive_words(text: str) -> list[str]:
    """A text's words as the archive indexes them: letters and digits, case folded, Latin diacritics dropped."""
    if text.isascii():  # most of what agents send: nothing to decompose
        return ARCHIVE_WORD.findall(text.lower())
    folded = unicodedata.normalize("NFKD", text.casefold())
    return ARCHIVE_WORD.findall("".join(c for c in folded if not unicodedata.combining(c)))


ARCHIVE_TERMS = 32  # a query's distinct terms searched for, at most (each is a pass over the index)


def archive_terms(query: str) -> list[tuple[tuple[str, ...], bool]]:
    """A query's terms: each a phrase (its words) and whether its last word is a prefix; each term once, the first
    :data:`ARCHIVE_TERMS` of them (400 terms, prefixes repeated, took FTS5 10-15 s). A clear error when it holds no
    word."""
    terms: dict[tuple[tuple[str, ...], bool], None] = {}
    for quoted, star, bare in re.findall(r'"([^"]*)"(\*?)|(\S+)', query):
        if words := tuple(archive_words(quoted or bare)):
            terms[words, bool(star) if quoted else bare.endswith("*")] = None
    if not terms:
        raise ContextShrinkError("query must hold a word, a phrase or an id from the archive")
    return list(terms)[:ARCHIVE_TERMS]


def fts_query(query: str) -> str:
    """The query as FTS5 reads it: each term a quoted phrase (its words only: nothing in it is FTS5 syntax)."""
    return " AND ".join('"' + " ".join(w) + '"' + ("*" if prefix else "") for w, prefix in archive_terms(query))


def archive_text(message: Mapping[str, Any]) -> str:
    """What the archive indexes of a message: its role, text, and tool calls' names and arguments."""
    calls = [f"{(c.get('function') or {}).get('name')} {(c.get('function') or {}).get('arguments')}"
             for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]  # fmt: skip
    return "\n".join([str(message.get("role")), plain_content(message.get("content")), *calls])


def is_entry_id(query: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{6,64}", query.strip()) is not None


def _entry_out(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: entry.get(k) for k in ARCHIVE_FIELDS}


ARCHIVE_ROW_BYTES = 384  # what a message archived takes on disk beside its entry and its words: rows, indexes
STATE_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (ns TEXT NOT NULL, tbl TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
  size INTEGER NOT NULL, at REAL NOT NULL, PRIMARY KEY (ns, tbl, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_at ON kv (ns, tbl, at, size);
CREATE INDEX IF NOT EXISTS kv_written ON kv (ns, at);
CREATE TABLE IF NOT EXISTS lease (ns TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL, until REAL NOT NULL,
  PRIMARY KEY (ns, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS archive (id INTEGER PRIMARY KEY, ns TEXT NOT NULL, conversation TEXT NOT NULL,
  hash TEXT NOT NULL, time REAL NOT NULL, size INTEGER NOT NULL, entry TEXT NOT NULL, UNIQUE (ns, conversation, hash));
CREATE INDEX IF NOT EXISTS archive_time ON archive (ns, time);
CREATE INDEX IF NOT EXISTS archive_hash ON archive (ns, hash);
"""


class SqliteStore:
    """The store in one SQLite file (``--state sqlite:PATH``, the default), or in memory (``path`` None): a file
    is private (a new folder 0700, the file 0600), in WAL mode so several processes on one machine share it;
    every row namespaced. The archive is an FTS5 index of each message's words per namespace (BM25, phrases,
    prefixes: :func:`archive_terms`)."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)
    down: str | None = None

    def __init__(self, path: Path | None, namespace: str = "default") -> None:
        self.name, self.ns, self.owner = f"sqlite:{path or ':memory:'}", namespace, uuid_module.uuid4().hex
        self.fts = "fts_" + hashlib.sha256(namespace.encode()).hexdigest()[:16]  # BM25 over this namespace only
        if path is not None:
            if not path.parent.exists():
                path.parent.mkdir(mode=0o700, parents=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))  # created private before SQLite opens it
        self.held = threading.Lock()
        self.db = sqlite3.connect(path or ":memory:", timeout=30, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(STATE_SCHEMA + f"CREATE VIRTUAL TABLE IF NOT EXISTS {self.fts} USING fts5(words, "
                              "conversation UNINDEXED, tokenize='unicode61 remove_diacritics 0');")  # fmt: skip
        # A file's reads (searches, what changed) have a connection of their own: in WAL mode they never wait for a
        # write, this process's or another's (a writer holding SQLite's lock, a long search).
        self.reading, self.reader = self.held, self.db
        if path is not None:
            self.reading = threading.Lock()
            self.reader = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)

    def _value(self, table: str, key: str) -> Any:
        """A table's value (the caller holds the lock)."""
        sql = "SELECT value FROM kv WHERE ns = ? AND tbl = ? AND key = ?"
        row = self.db.execute(sql, (self.ns, table, key)).fetchone()
        return None if row is None else json.loads(row[0])

    def _keep(self, table: str, key: str, value: Any) -> None:
        """A table's value written and the table bounded (the caller holds the lock)."""
        text, now = json.dumps(value, ensure_ascii=False, default=str), time.time()
        self.db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?, ?, ?)", (self.ns, table, key, text,
                                                                               len(text), now))  # fmt: skip
        self._bound(table, now)

    def get(self, table: str, key: str) -> Any:
        with self.held:
            return self._value(table, key)

    def first(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        found: dict[str, str] = {}
        with self.held:
            for start in range(0, len(keys), 500):
                part = keys[start : start + 500]
                found.update(self.db.execute(f"SELECT key, value FROM kv WHERE ns = ? AND tbl = ? AND key IN "
                                             f"({','.join('?' * len(part))})", (self.ns, table, *part)))  # fmt: skip
        return next(((k, json.loads(found[key])) for k, key in enumerate(keys) if key in found), (-1, None))

    def latest(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        return self.first(table, keys)

    def put(self, table: str, key: str, value: Any) -> None:
        with self.held:
            self._keep(table, key, value)

    def _bound(self, table: str, now: float) -> None:
        """The oldest rows of ``table`` removed while it holds too many, too many bytes, or any too old."""
        most, size = STATE_TABLES[table]
        where, scope = "ns = ? AND tbl = ?", (self.ns, table)
        self.db.execute(f"DELETE FROM kv WHERE {where} AND at < ?", (*scope, now - STATE_MAX_DAYS * 86400))
        rows, total = self.db.execute(f"SELECT count(*), total(size) FROM kv WHERE {where}", scope).fetchone()
        if rows <= most and total <= size:
            return
        over = []
        for key, length in self.db.execute(f"SELECT key, size FROM kv WHERE {where} ORDER BY at", scope).fetchall():
            if rows <= 1 or (rows <= most and total <= size):
                break
            over.append((*scope, key))
            rows, total = rows - 1, total - length
        self.db.executemany(f"DELETE FROM kv WHERE {where} AND key = ?", over)

    def delete(self, table: str, key: str) -> None:
        with self.held:
            self.db.execute("DELETE FROM kv WHERE ns = ? AND tbl = ? AND key = ?", (self.ns, table, key))

    def items(self, table: str) -> list[tuple[str, Any]]:
        with self.held:
            rows = self.db.execute("SELECT key, value FROM kv WHERE ns = ? AND tbl = ? ORDER BY at", (self.ns, table))
            return [(k, json.loads(v)) for k, v in rows]

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One transaction that takes the write lock first (across processes: one writer at a time)."""
        with self.held:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def add(self, table: str, key: str, counts: Mapping[str, float]) -> None:
        with self._writing():
            value = self._value(table, key) or {}
            for name, n in counts.items():
                value[name] = value.get(name, 0) + n
            self._keep(table, key, value)

    def claim(self, key: str, seconds: float) -> bool:
        now = time.time()
        with self.held:
            cursor = self.db.execute(
                "INSERT INTO lease VALUES (?, ?, ?, ?) ON CONFLICT (ns, key) DO UPDATE SET owner = excluded.owner, "
                "until = excluded.until WHERE lease.until < ?",
                (self.ns, key, self.owner, now + seconds, now),
            )
            return cursor.rowcount == 1

    def release(self, key: str) -> None:
        with self.held:
            self.db.execute("DELETE FROM lease WHERE ns = ? AND key = ? AND owner = ?", (self.ns, key, self.owner))

    def archive(self, entries: Sequence[Mapping[str, Any]], max_bytes: int, max_days: float) -> int:
        written = 0
        with self._writing() as db:
            for e in entries:
                kept = {k: v for k, v in e.items() if k != "words"}
                text = json.dumps(kept, ensure_ascii=False, default=str)
                words = " ".join(e.get("words") or archive_words(archive_text(e["message"])))
                size = len(text.encode()) + 2 * len(words.encode()) + ARCHIVE_ROW_BYTES  # on disk, about: words twice
                cursor = db.execute("INSERT OR IGNORE INTO archive (ns, conversation, hash, time, size, entry) VALUES "
                                    "(?, ?, ?, ?, ?, ?)", (self.ns, e["conversation"], e["hash"], e["time"], size,
                                                           text))  # fmt: skip
                if cursor.rowcount == 1:
                    written += 1
                    db.execute(f"INSERT INTO {self.fts} (rowid, words, conversation) VALUES (?, ?, ?)",
                               (cursor.lastrowid, words, e["conversation"]))  # fmt: skip
            if math.isfinite(max_days) or max_bytes < 1 << 62:  # unbounded: a chunk before the last (MirroredStore)
                self._prune(max_bytes, time.time() - max_days * 86400)
        return written

    def _prune(self, max_bytes: int, cutoff: float) -> None:
        """The archive's messages older than ``cutoff`` removed, then the oldest while it is over ``max_bytes``."""
        old = [r[0] for r in self.db.execute("SELECT id FROM archive WHERE ns = ? AND time < ?", (self.ns, cutoff))]
        self._remove(old)
        (total,) = self.db.execute("SELECT total(size) FROM archive WHERE ns = ?", (self.ns,)).fetchone()
        over = []
        if total > max_bytes:
            for row_id, size in self.db.execute("SELECT id, size FROM archive WHERE ns = ? ORDER BY time, id",
                                                (self.ns,)).fetchall():  # fmt: skip
                if total <= max_bytes:
                    break
                over.append(row_id)
                total -= size
        self._remove(over)
        if old or over:
            log.info("archive: removed %d old message(s) to stay within %d bytes and its age", len(old) + len(over),
                     max_bytes)  # fmt: skip

    def _remove(self, ids: Sequence[int]) -> None:
        self.db.executemany("DELETE FROM archive WHERE id = ?", [(i,) for i in ids])
        self.db.executemany(f"DELETE FROM {self.fts} WHERE rowid = ?", [(i,) for i in ids])

    def archived(self) -> list[tuple[str, str]]:
        """Every archived message's ``(conversation, hash)``."""
        with self.held:
            return self.db.execute("SELECT conversation, hash FROM archive WHERE ns = ?", (self.ns,)).fetchall()

    def forget(self, keys: Sequence[tuple[str, str]]) -> None:
        """The archived messages of these ``(conversation, hash)`` removed."""
        with self._writing() as db:
            ids = [r[0] for c, h in keys for r in db.execute("SELECT id FROM archive WHERE ns = ? AND conversation = "
                                                             "? AND hash = ?", (self.ns, c, h))]  # fmt: skip
            self._remove(ids)

    def changed(self, since: float, known: Mapping[tuple[str, str], float]) -> list[tuple[str, str, Any, float]]:
        """Every table row written after ``since`` (seconds since the epoch) but those ``known`` as written then,
        oldest first: ``(table, key, value, when)``."""
        with self.reading:
            rows = self.reader.execute("SELECT tbl, key, at FROM kv WHERE ns = ? AND at > ? ORDER BY at",
                                       (self.ns, since)).fetchall()  # fmt: skip
            new = [(table, key, at) for table, key, at in rows if known.get((table, key)) != at]
            values = [self.reader.execute("SELECT value FROM kv WHERE ns = ? AND tbl = ? AND key = ?",
                                          (self.ns, table, key)).fetchone() for table, key, _ in new]  # fmt: skip
        return [(table, key, json.loads(value[0]), at) for (table, key, at), value in zip(new, values, strict=True)
                if value is not None]  # fmt: skip

    def found(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many messages were searched, and the best ``limit`` entries as archived."""
        mine = "" if conversation is None else " AND conversation = ?"
        scope = (self.ns,) if conversation is None else (self.ns, conversation)
        with self.reading:
            (searched,) = self.reader.execute(f"SELECT count(*) FROM archive WHERE ns = ?{mine}", scope).fetchone()
            if is_entry_id(query):
                start = query.strip()
                rows = self.reader.execute(f"SELECT entry FROM archive WHERE ns = ?{mine} AND hash >= ? AND hash < ? "
                                           "ORDER BY time DESC, id DESC LIMIT ?", (*scope, start, start + "g",
                                                                                  limit)).fetchall()  # fmt: skip
                if rows:
                    return searched, [json.loads(r[0]) for r in rows]
            rows = self.reader.execute(
                f"SELECT a.entry FROM {self.fts} f JOIN archive a ON a.id = f.rowid WHERE {self.fts} MATCH ?"
                + ("" if conversation is None else " AND f.conversation = ?")
                + " ORDER BY f.rank, a.time DESC, a.id DESC LIMIT ?",
                (fts_query(query), *scope[1:], limit),
            ).fetchall()
        return searched, [json.loads(r[0]) for r in rows]

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        searched, entries = self.found(query, conversation, limit)
        return searched, [_entry_out(e) for e in entries]

    def namespaces(self) -> dict[str, int]:
        with self.reading:
            return dict(self.reader.execute("SELECT ns, count(*) FROM archive GROUP BY ns").fetchall())

    def close(self) -> None:
        with self.held:
            self.db.close()
        if self.reader is not self.db:
            with self.reading:
                self.reader.close()


class MemoryStore(MemoryTables):
    """The store in this process's memory (``--state memory``, and the stand-in while a store is unreachable):
    its tables, and the archive in an SQLite database in memory. Nothing on disk; gone when the process ends."""

    errors: tuple[type[BaseException], ...] = ()
    down: str | None = None

    def __init__(self, name: str = "memory") -> None:
        super().__init__()
        self.name, self.index = name, SqliteStore(None)

    def archive(self, entries: Sequence[Mapping[str, Any]], max_bytes: int, max_days: float) -> int:
        return self.index.archive(entries, max_bytes, max_days)

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        return self.index.search(query, conversation, limit)

    def namespaces(self) -> dict[str, int]:
        return {}  # this process's alone: no other deployment's archive is here

    def changed(self, since: float, known: Mapping[tuple[str, str], float]) -> list[tuple[str, str, Any, float]]:
        """Every table row written after ``since`` but those ``known`` as written then, oldest first: ``(table, key,
        value, when)``."""
        with self.held:
            rows = [(t, k, text, at) for t, kept in self.tables.items() for k, (text, at, _) in kept.items()
                    if at > since and known.get((t, k)) != at]  # fmt: skip
        return [(t, k, json.loads(text), at) for t, k, text, at in sorted(rows, key=lambda row: row[3])]

    def close(self) -> None:
        self.index.close()


def redis_name(url: str) -> str:
    """A Redis URL as logs and pages show it: scheme, host, port and database, never a password."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store's failure raises: SQLite's and the system's errors, and the redis client's once imported."""
    redis = sys.modules.get("redis")
    return (sqlite3.Error, OSError, *((redis.RedisError,) if redis is not None else ()))


# One write to a table on the server, and the table bounded, atomically. KEYS: the table's values (a hash), when
# each was written (a sorted set), their sizes (a hash, '#' their total); ARGV: key, value, now, the most entries,
# bytes and seconds, the mode (put, add, del; new: unless there), the score. The archive's new keys also get a
# sequence number (<values>#q, from <values>#n): what a replica's index has not read yet.
REDIS_WRITE = """
local t, z, s = KEYS[1], KEYS[2], KEYS[3]
local key, value, now, most, bytes, age, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local was = tonumber(redis.call('HGET', s, key) or '0')
local function drop(k)
  redis.call('HDEL', t, k); redis.call('HDEL', s, k); redis.call('ZREM', z, k); redis.call('ZREM', t .. '#q', k)
end
if mode == 'new' and redis.call('HEXISTS', t, key) == 1 then return 0 end
if mode == 'del' then
  drop(key)
  redis.call('HINCRBY', s, '#', -was)
  return 1
end
if mode == 'add' then
  local old = redis.call('HGET', t, key)
  local v = old and cjson.decode(old) or {}
  for k, n in pairs(cjson.decode(value)) do v[k] = (v[k] or 0) + n end
  value = cjson.encode(v)
end
redis.call('HSET', t, key, value); redis.call('HSET', s, key, string.len(value))
redis.call('ZADD', z, tonumber(ARGV[8]), key)
if mode == 'new' then redis.call('ZADD', t .. '#q', redis.call('INCR', t .. '#n'), key) end
local total = redis.call('HINCRBY', s, '#', string.len(value) - was)
while redis.call('ZCARD', z) > 1 do
  local oldest = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  if not (redis.call('ZCARD', z) > most or total > bytes or tonumber(oldest[2]) < now - age) then break end
  total = redis.call('HINCRBY', s, '#', -tonumber(redis.call('HGET', s, oldest[1]) or '0'))
  drop(oldest[1])
end
return 1
"""
REDIS_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
REDIS_INDEX_SLACK = 1000  # messages the local index may hold that the server dropped before it is reconciled


class RedisStore:
    """The store on a Redis server (``--state redis://HOST:PORT/DB``, ``rediss://`` for TLS), shared by replicas:
    each table a hash with a sorted set of when each key was written, bounded by one server-side script per
    write; every key under ``cs:<namespace>:``. The archive is a table too; its query is answered by an FTS5
    index in this process's memory of what the server keeps (its words only), brought up to date before each
    search: new messages by their sequence number, those the server dropped when a hit is no longer there (and
    all at once when too many are). Needs the ``redis`` client (the ``redis`` extra)."""

    down: str | None = None

    def __init__(self, url: str, namespace: str = "default") -> None:
        try:
            import redis
        except ImportError:
            raise ContextShrinkError("--state redis://... needs the redis client: pip install "
                                     "'context-shrink-mcp[redis]'") from None  # fmt: skip
        self.name, self.errors = redis_name(url), store_errors()
        self.server = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
        self.prefix, self.owner = f"cs:{namespace}:", uuid_module.uuid4().hex
        self.write, self.free = self.server.register_script(REDIS_WRITE), self.server.register_script(REDIS_RELEASE)
        self.index, self.read_up_to, self.indexed = SqliteStore(None), 0.0, 0
        self.server.ping()

    def _keys(self, table: str) -> list[str]:
        return [f"{self.prefix}{kind}:{table}" for kind in "tzs"]

    def _write(
        self, table: str, key: str, value: str, mode: str, bounds: tuple[int, int, float] | None = None,
        at: float | None = None,
    ) -> int:  # fmt: skip
        """One write (``put``, ``add``, ``del``, or ``new``: unless the key is there) and the table bounded, in one
        script on the server; ``at``: when the value dates from (now, unless given)."""
        most, size, days = bounds or (*STATE_TABLES[table], STATE_MAX_DAYS)
        now = time.time()
        score = now if at is None or at >= now - 1 else at  # to the microsecond: the order of writes, not a tie
        return int(self.write(keys=self._keys(table), args=[key, value, now, most, size, days * 86400, mode, score]))

    def get(self, table: str, key: str) -> Any:
        value = self.server.hget(self._keys(table)[0], key)
        return None if value is None else json.loads(value)

    def first(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        values = self.server.hmget(self._keys(table)[0], list(keys)) if keys else []
        return next(((k, json.loads(v)) for k, v in enumerate(values) if v is not None), (-1, None))

    def latest(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        return self.first(table, keys)

    def put(self, table: str, key: str, value: Any) -> None:
        self._write(table, key, json.dumps(value, ensure_ascii=False, default=str), "put")

    def delete(self, table: str, key: str) -> None:
        self._write(table, key, "", "del")

    def _values(self, table: str, keys: Sequence[str]) -> list[str | None]:
        return [v for start in range(0, len(keys), 1000)
                for v in self.server.hmget(self._keys(table)[0], keys[start : start + 1000])]  # fmt: skip

    def items(self, table: str) -> list[tuple[str, Any]]:
        keys = self.server.zrange(self._keys(table)[1], 0, -1)
        return [(k, json.loads(v)) for k, v in zip(keys, self._values(table, keys), strict=True) if v is not None]

    def add(self, table: str, key: str, counts: Mapping[str, float]) -> None:
        self._write(table, key, json.dumps(dict(counts)), "add")

    def changed(self, since: float, known: Mapping[tuple[str, str], float]) -> list[tuple[str, str, Any, float]]:
        """Every table row written after ``since`` but those ``known`` as written then, oldest first: ``(table, key,
        value, when)``."""
        tables, pipe = list(STATE_TABLES), self.server.pipeline(transaction=False)
        for table in tables:
            pipe.zrangebyscore(self._keys(table)[1], f"({since}", "+inf", withscores=True)
        rows = []
        for table, written in zip(tables, pipe.execute(), strict=True):
            new = [(k, at) for k, at in written if known.get((table, k)) != at]
            values = self._values(table, [k for k, _ in new]) if new else []
            rows += [(table, k, json.loads(v), at) for (k, at), v in zip(new, values, strict=True) if v is not None]
        return sorted(rows, key=lambda row: row[3])

    def claim(self, key: str, seconds: float) -> bool:
        return bool(self.server.set(f"{self.prefix}lease:{key}", self.owner, nx=True, px=int(seconds * 1000)))

    def release(self, key: str) -> None:
        self.free(keys=[f"{self.prefix}lease:{key}"], args=[self.owner])

    def archive(self, entries: Sequence[Mapping[str, Any]], max_bytes: int, max_days: float) -> int:
        bounds = (1 << 62, max_bytes, max_days)
        return sum(self._write("archive", f"{e['conversation']}:{e['hash']}", json.dumps(e, ensure_ascii=False,
                               default=str), "new", bounds, e["time"]) for e in entries)  # fmt: skip

    def _catch_up(self) -> None:
        """The local index given what the server archived since it last read, and reconciled when it holds too
        many messages the server dropped."""
        sequence = f"{self._keys('archive')[0]}#q"
        new = self.server.zrangebyscore(sequence, f"({self.read_up_to}", "+inf", withscores=True)
        if new:
            read = [json.loads(v) for v in self._values("archive", [k for k, _ in new]) if v is not None]
            slim = [{**{k: v for k, v in e.items() if k != "message"},
                     "words": archive_words(archive_text(e["message"]))} for e in read]  # fmt: skip
            self.indexed += self.index.archive(slim, 1 << 62, 36500)
            self.read_up_to = new[-1][1]
        if self.indexed > self.server.zcard(sequence) + REDIS_INDEX_SLACK:
            kept = set(self.server.zrange(sequence, 0, -1))
            gone = [(c, h) for c, h in self.index.archived() if f"{c}:{h}" not in kept]
            self.index.forget(gone)
            self.indexed -= len(gone)

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        self._catch_up()
        while True:
            searched, hits = self.index.found(query, conversation, limit)
            keys = [f"{h['conversation']}:{h['hash']}" for h in hits]
            values = self._values("archive", keys)
            gone = [(h["conversation"], h["hash"]) for h, v in zip(hits, values, strict=True) if v is None]
            if not gone:
                return searched, [_entry_out(json.loads(v)) for v in values if v is not None]
            self.index.forget(gone)  # dropped by the server since they were read
            self.indexed -= len(gone)

    def namespaces(self) -> dict[str, int]:
        found = {}
        for key in self.server.scan_iter(match="cs:*:z:archive", count=1000):
            found[key[len("cs:") : -len(":z:archive")]] = int(self.server.zcard(key))
        return {ns: n for ns, n in found.items() if n}

    def close(self) -> None:
        self.server.close()
        self.index.close()


class FallbackStore:
    """The store configured, kept serving from memory while it is unreachable: a failure is logged once, the
    calls go to a :class:`MemoryStore` meanwhile (``down`` says why; the proxy's header and live page show it),
    and the store is tried again every :data:`STATE_RETRY_SECONDS`."""

    errors: tuple[type[BaseException], ...] = ()

    def __init__(self, name: str, opener: Callable[[], Store]) -> None:
        self.name, self.opener, self.memory = name, opener, MemoryStore(f"memory (while {name} is unreachable)")
        self.inner: Store | None = None
        self.down: str | None = None
        self.retry_at = -math.inf
        self.held = threading.Lock()
        self.current()

    def current(self) -> Store:
        """The store configured, when it answers; else the memory stand-in (tried again when it is time)."""
        if self.inner is None and time.monotonic() >= self.retry_at:
            with self.held:
                if self.inner is None and time.monotonic() >= self.retry_at:
                    try:
                        self.inner = self.opener()
                    except store_errors() as exc:
                        self.lost(exc)
                    else:
                        if self.down is not None:
                            log.info("state: %s answers again; what was learnt meanwhile stays in memory only",
                                     self.name)  # fmt: skip
                        self.down = None
        return self.inner or self.memory

    def lost(self, exc: BaseException) -> None:
        if self.down is None:
            log.warning("state: %s is unreachable (%s: %s): serving from memory, trying again every %g s", self.name,
                        type(exc).__name__, exc, STATE_RETRY_SECONDS)  # fmt: skip
        self.down, self.retry_at = f"{type(exc).__name__}: {exc}", time.monotonic() + STATE_RETRY_SECONDS
        if self.inner is not None:
            with contextlib.suppress(Exception):
                self.inner.close()
        self.inner = None

    def _call(self, method: str, *args: Any) -> Any:
        store = self.current()
        try:
            return getattr(store, method)(*args)
        except store.errors as exc:
            self.lost(exc)
            return getattr(self.memory, method)(*args)

    def get(self, table: str, key: str) -> Any:
        return self._call("get", table, key)

    def first(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        return self._call("first", table, keys)

    def latest(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        return self._call("latest", table, keys)

    def put(self, table: str, key: str, value: Any) -> None:
        self._call("put", table, key, value)

    def delete(self, table: str, key: str) -> None:
        self._call("delete", table, key)

    def items(self, table: str) -> list[tuple[str, Any]]:
        return self._call("items", table)

    def add(self, table: str, key: str, counts: Mapping[str, float]) -> None:
        self._call("add", table, key, counts)

    def claim(self, key: str, seconds: float) -> bool:
        return self._call("claim", key, seconds)

    def release(self, key: str) -> None:
        self._call("release", key)

    def archive(self, entries: Sequence[Mapping[str, Any]], max_bytes: int, max_days: float) -> int:
        return self._call("archive", entries, max_bytes, max_days)

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        return self._call("search", query, conversation, limit)

    def namespaces(self) -> dict[str, int]:
        return self._call("namespaces")

    def changed(self, since: float, known: Mapping[tuple[str, str], float]) -> list[tuple[str, str, Any, float]]:
        return self._call("changed", since, known)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.memory.close()


SYNC_SECONDS = 0.5  # how often the mirror reads what other processes wrote to the store (and at each request)
SYNC_OVERLAP = 2.0  # seconds of writes read again each time (another machine's clock may lag a little)
WRITES_MOST = 50_000  # writes waiting for the store at most: beyond, the newest learnt values are not kept there
ARCHIVE_WAITING_BYTES = 64 << 20  # and messages waiting to be archived, at most
ARCHIVE_CHUNK = 32 << 10  # bytes of messages archived in one transaction: a request's learnt values wait no longer
ARCHIVE_CHUNK_ROWS = 64  # and messages (each is indexed: ~0.05 ms)
STORE_WAIT = 2.0  # seconds a lease, a fresh read or a search waits for the store before it goes on without
APPLIED_MOST = 20_000  # rows the mirror remembers having read (their write times): those it does not are read again
SETTLE_SECONDS = 0.05  # seconds a request waits for what it learnt to reach the store (when the store keeps up)


class Writer:
    """Two lines of writes to a store, applied in order by one thread: the first line's (``urgent``: learnt
    values) always before the second's (the archive's, a chunk at a time: a value waits for one chunk at most).
    ``mark`` is a place in a line (an event set when the writes before it in that line are done)."""

    def __init__(self, name: str, apply: Callable[[str, tuple[Any, ...]], None]) -> None:
        self.apply, self.held = apply, threading.Condition()
        self.lines: tuple[collections.deque[tuple[str, tuple[Any, ...]]], ...] = (collections.deque(),
                                                                                 collections.deque())  # fmt: skip
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=f"context-shrink {name}", daemon=True)
        self.thread.start()

    def waiting(self, urgent: bool = True) -> int:
        return len(self.lines[0 if urgent else 1])

    def put(self, kind: str, *args: Any, urgent: bool = True) -> None:
        with self.held:
            self.lines[0 if urgent else 1].append((kind, args))
            self.held.notify_all()

    def mark(self, urgent: bool = True) -> threading.Event:
        reached = threading.Event()
        self.put("mark", reached, urgent=urgent)
        return reached

    def close(self, seconds: float) -> None:
        with self.held:
            self.closing = True
            self.held.notify_all()
        self.thread.join(seconds)

    def _run(self) -> None:
        while True:
            with self.held:
                while not any(self.lines) and not self.closing:
                    self.held.wait()
                if not any(self.lines):
                    return
                kind, args = (self.lines[0] or self.lines[1]).popleft()
            if kind == "mark":
                args[0].set()
            else:
                self.apply(kind, args)


class MirroredStore:
    """The store as the proxy's request path sees it: every read from memory (a mirror of the store), every write
    to the mirror at once and to the store by writer threads, in order: so a store that is slow, locked by another
    process or unreachable never holds up the event loop, and nothing of it runs there. The mirror reads what other
    processes wrote (:meth:`sync`) every :data:`SYNC_SECONDS` and when a request begins (:meth:`refresh`, waited for
    at most :data:`SETTLE_SECONDS`); a request waits for what it learnt to reach the store when it ends
    (:meth:`settle`, as long at most, and not at all while the store is behind): a replica serving the next request
    sees it.
    Learnt values and the archive have a line each, one writer for both, the values first (a large archive, written
    :data:`ARCHIVE_CHUNK` bytes or :data:`ARCHIVE_CHUNK_ROWS` messages at a time, never holds them up long). A
    lease (``claim``) and a fresh read (``latest``) ask the store itself, at most :data:`STORE_WAIT` seconds; a lease
    held brings the mirror up to date first (a summary another replica filed before it let the lease go is seen);
    ``release`` waits in line behind the writes before it, ``search`` for the archive's. ``close`` writes what is
    waiting first."""

    errors: tuple[type[BaseException], ...] = ()

    def __init__(self, inner: Store) -> None:
        self.inner, self.name = inner, inner.name
        self.mirror = MemoryTables()
        self.held = threading.Lock()
        self.pending: collections.Counter[tuple[str, str]] = collections.Counter()  # writes waiting, by key
        self.added: dict[tuple[str, str], dict[str, float]] = {}  # counters added that the store has not yet
        self.waiting_bytes, self.dropped, self.seen, self.behind = 0, 0, 0.0, False
        self.applied: dict[tuple[str, str], float] = {}  # what was read, as written when: not read again
        self.syncing: threading.Event | None = None  # a refresh under way (set when done)
        self.sync()  # the whole store, once
        self.writer = Writer("store writer", self._write)
        self.closing = threading.Event()
        self.syncer = threading.Thread(target=self._syncs, name="context-shrink store sync", daemon=True)
        self.syncer.start()

    @property
    def down(self) -> str | None:
        return self.inner.down

    def get(self, table: str, key: str) -> Any:
        return self.mirror.get(table, key)

    def first(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        return self.mirror.first(table, keys)

    def items(self, table: str) -> list[tuple[str, Any]]:
        return self.mirror.items(table)

    def latest(self, table: str, keys: Sequence[str]) -> tuple[int, Any]:
        answer = self._asked(lambda: self.inner.latest(table, keys))
        return self.mirror.first(table, keys) if answer is None else answer

    def put(self, table: str, key: str, value: Any) -> None:
        self.mirror.put(table, key, value)
        self._queue("put", table, key, value)

    def delete(self, table: str, key: str) -> None:
        self.mirror.delete(table, key)
        self._queue("delete", table, key)

    def add(self, table: str, key: str, counts: Mapping[str, float]) -> None:
        with self.held:
            self.mirror.add(table, key, counts)
            added = self.added.setdefault((table, key), {})
            for name, n in counts.items():
                added[name] = added.get(name, 0) + n
        self._queue("add", table, key, dict(counts))

    def archive(self, entries: Sequence[Mapping[str, Any]], max_bytes: int, max_days: float) -> int:
        chunks: list[list[Mapping[str, Any]]] = [[]]
        size = 0
        for entry in entries:  # in transactions of ARCHIVE_CHUNK bytes: the learnt values' line waits for no more
            if chunks[-1] and (size >= ARCHIVE_CHUNK or len(chunks[-1]) >= ARCHIVE_CHUNK_ROWS):
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += int(entry.get("size") or 0)
        for k, chunk in enumerate(chunks):  # the bounds kept once, with the last chunk
            bounds = (max_bytes, max_days) if k == len(chunks) - 1 else (1 << 62, math.inf)
            self._queue("archive", chunk, *bounds)
        return len(entries)

    def claim(self, key: str, seconds: float) -> bool:
        if (held := self._asked(lambda: self.inner.claim(key, seconds))) is None:  # slow or locked: a lease is a
            log.info("state: %s did not answer a lease in %g s; going on without it", self.name, STORE_WAIT)
            return True  # courtesy between replicas, made here
        if held:
            self.sync()
        return held

    def release(self, key: str) -> None:
        self.writer.put("release", key)

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        self.writer.mark(urgent=False).wait(STORE_WAIT)
        return self.inner.search(query, conversation, limit)

    def namespaces(self) -> dict[str, int]:
        return self.inner.namespaces()

    def refresh(self) -> bool:
        """What other processes wrote, read into the mirror before a request is fitted: one :meth:`sync` at a time,
        waited for at most :data:`SETTLE_SECONDS` (a store that is slow or stopped is read in the background, and
        the request goes on with the mirror as it is); whether it was read."""
        with self.held:
            if self.syncing is None or self.syncing.is_set():
                self.syncing = threading.Event()
                threading.Thread(target=self._synced, args=(self.syncing,), name="context-shrink store refresh",
                                 daemon=True).start()  # fmt: skip
            syncing = self.syncing
        return syncing.wait(SETTLE_SECONDS)

    def _synced(self, done: threading.Event) -> None:
        try:
            self.sync()
        finally:
            done.set()

    def settle(self) -> bool:
        """Wait for the learnt values waiting now to reach the store, at most :data:`SETTLE_SECONDS` (not at all
        while the store is behind: once it missed, until it catches up); whether they did."""
        if self.behind:
            return False
        self.behind = not self.writer.mark().wait(SETTLE_SECONDS)
        if self.behind:
            log.info("state: %s is behind (%d writes waiting); requests no longer wait for it", self.name,
                     self.writer.waiting())  # fmt: skip
            self.writer.put("caught up")
        return not self.behind

    def close(self) -> None:
        waiting = [self.writer.mark(urgent) for urgent in (True, False)]
        if not all(event.wait(10.0) for event in waiting):
            log.warning("state: %s did not take what was waiting in 10 s: %d write(s) not kept", self.name,
                        self.writer.waiting() + self.writer.waiting(urgent=False))  # fmt: skip
        self.closing.set()
        self.writer.close(5.0)
        self.syncer.join(5.0)
        self.inner.close()

    def _asked(self, ask: Callable[[], Any]) -> Any:
        """What the store answers ``ask`` within :data:`STORE_WAIT` seconds, else None (it goes on alone)."""
        answer: list[Any] = []
        asking = threading.Thread(target=lambda: answer.append(ask()), daemon=True)
        asking.start()
        asking.join(STORE_WAIT)
        return answer[0] if answer else None

    def _queue(self, kind: str, *args: Any) -> None:
        size = sum(int(e.get("size") or 0) for e in args[0]) if kind == "archive" else 0
        urgent = kind != "archive"
        with self.held:
            waiting = self.writer.waiting(urgent)
            if waiting >= WRITES_MOST or self.waiting_bytes + size > ARCHIVE_WAITING_BYTES:
                self.dropped += 1
                if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                    log.warning("state: %s is %d writes behind: %d write(s) kept in this process only", self.name,
                                waiting, self.dropped)  # fmt: skip
                return
            self.waiting_bytes += size
            if kind in ("put", "delete", "add"):
                self.pending[args[0], args[1]] += 1
        self.writer.put(kind, *args, urgent=urgent)

    def _write(self, kind: str, args: tuple[Any, ...]) -> None:
        """One write reaching the store (a writer's thread), and what it leaves waiting."""
        try:
            if kind == "caught up":
                self.behind = False
            else:
                getattr(self.inner, kind)(*args)
        except Exception as exc:  # the store's own failures are its fallback's (memory); anything else: said
            log.warning("state: a write to %s failed (%s: %s)", self.name, type(exc).__name__, exc)
        with self.held:
            if kind == "archive":
                self.waiting_bytes -= sum(int(e.get("size") or 0) for e in args[0])
            if kind not in ("put", "delete", "add"):
                return
            key = (args[0], args[1])
            self.pending[key] -= 1
            if kind == "add":
                added = self.added.get(key, {})
                for name, n in args[2].items():
                    added[name] = added.get(name, 0) - n
            if self.pending[key] <= 0:
                del self.pending[key]
                self.added.pop(key, None)

    def _syncs(self) -> None:
        """The sync thread: what other processes wrote, read into the mirror every :data:`SYNC_SECONDS`."""
        while not self.closing.wait(SYNC_SECONDS):
            self.sync()

    def sync(self) -> None:
        """Read what the store holds that was written since the last time (everything, the first time) into the
        mirror, but the values this process wrote that the store does not hold yet; counters with what this
        process added that the store does not hold yet."""
        try:
            rows = self.inner.changed(self.seen - SYNC_OVERLAP if self.seen else 0.0, dict(self.applied))
        except Exception as exc:  # a store's own failures are its fallback's: anything else is said, and retried
            log.warning("state: reading what changed in %s failed (%s: %s)", self.name, type(exc).__name__, exc)
            return
        with self.held:
            for table, key, value, at in rows:
                self.seen, self.applied[table, key] = max(self.seen, at), at
                while len(self.applied) > APPLIED_MOST:
                    self.applied.pop(next(iter(self.applied)))
                if table not in STATE_TABLES or ((table, key) in self.pending and (table, key) not in self.added):
                    continue
                if (added := self.added.get((table, key))) and isinstance(value, dict):
                    value = {**value, **{n: value.get(n, 0) + k for n, k in added.items()}}
                self.mirror.put(table, key, value)


def open_store(
    spec: str | None, namespace: str = "default", environ: Mapping[str, str] | None = None, mirrored: bool = False
) -> Store:
    """The store ``spec`` names (:meth:`Settings.state`; None: SQLite in the default place), kept serving from
    memory while it is unreachable (:class:`FallbackStore`); ``memory`` is memory alone. ``mirrored``: read and
    written in memory, the store kept up to date behind (:class:`MirroredStore`: the proxy's request path)."""
    spec = spec or f"sqlite:{default_state_path(environ)}"
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("sqlite:"):
        path = Path(spec[len("sqlite:") :]).expanduser()
        store: Store = FallbackStore(f"sqlite:{path}", lambda: SqliteStore(path, namespace))
    elif importlib.util.find_spec("redis") is None:
        raise ContextShrinkError("--state redis://... needs the redis client: pip install 'context-shrink-mcp[redis]'")
    else:
        store = FallbackStore(redis_name(spec), lambda: RedisStore(spec, namespace))
    return MirroredStore(store) if mirrored else store


IMPORT_BATCH = 10_000  # messages of an earlier JSONL archive written to the store at a time (progress between)


def import_jsonl_archive(store: Store, directory: Path, max_bytes: int, max_days: float) -> int:
    """The JSONL archive an earlier version kept in ``directory``, written into ``store`` once (a meta entry
    records it), within the archive's bounds (what is older than ``max_days`` is not kept); how many messages it
    added. A line that is not an entry (no hash, id, time or message) is skipped."""
    key = state_key(["imported", str(directory.resolve())])
    if store.get("meta", key) is not None or not archive_files(directory):
        return 0
    entries = [{**e, "size": len(json.dumps(e["message"], ensure_ascii=False, default=str))}
               for e in read_archive(directory) if isinstance(e.get("hash"), str) and isinstance(e.get("message"), dict)
               and isinstance(e.get("time"), (int, float)) and isinstance(e.get("id"), str)]  # fmt: skip
    added = 0
    for start in range(0, len(entries), IMPORT_BATCH):
        added += store.archive(entries[start : start + IMPORT_BATCH], max_bytes, max_days)
        if len(entries) > IMPORT_BATCH:
            log.info("archive: importing %s: %d of %d messages", directory, start + IMPORT_BATCH, len(entries))
    store.put("meta", key, {"at": time.time(), "messages": added})
    log.info("archive: imported %d message(s) from the JSONL archive in %s", added, directory)
    return added


def recalled_elsewhere(state: ServerState, query: str, conversation: str | None, limit: int) -> dict[str, Any]:
    """``recall_context``'s answer when its own namespace holds nothing archived: the store's other namespaces
    that do, searched (each entry says its ``namespace``) when the server was started on stdio (``state.local``:
    its user owns the store file and could read it whole) and the namespace was derived, not named; else only
    listed. A proxy archives under its upstream's namespace, which the MCP server can only guess
    (``CONTEXT_SHRINK_BASE_URL``): this is how it finds the proxy's archive of the same machine unasked. ``{}``
    when no other namespace holds anything. Runs in a worker thread."""
    config = state.config
    others = sorted(((n, ns) for ns, n in state.store().namespaces().items() if ns != config.namespace), reverse=True)
    if not others:
        return {}
    listed = ", ".join(f"{ns} ({n} messages)" for n, ns in others)
    if not state.local or config.namespace_named:
        why = "named by CONTEXT_SHRINK_NAMESPACE" if config.namespace_named else "this server's over HTTP"
        return {"note": f"nothing is archived under namespace {config.namespace} ({why}); the store holds {listed}: "
                f"set CONTEXT_SHRINK_NAMESPACE to one of them to search it"}  # fmt: skip
    searched, entries, names = 0, [], []
    for _, ns in others:
        store = open_store(config.state, ns)
        try:
            counted, found = store.search(query, conversation, limit - len(entries))
        finally:
            store.close()
        searched, names = searched + counted, [*names, ns]
        entries += [{**entry, "namespace": ns} for entry in found]
        if len(entries) >= limit:
            break
    note = (f"nothing is archived under this server's namespace {config.namespace} (derived from "
            f"CONTEXT_SHRINK_BASE_URL); searched the store's others: {listed}. CONTEXT_SHRINK_NAMESPACE=<one> "
            "searches that one alone")  # fmt: skip
    return {"searched": searched, "found": len(entries), "entries": entries, "namespaces": names, "note": note}
