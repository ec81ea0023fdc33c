"""context_shrink_state: the proxy's store (SQLite, Redis, memory) and the archive of what it folded away.

A companion of :mod:`context_shrink` (it imports the core; the core reaches it through
:func:`context_shrink.companion` when ``recall_context`` first searches). Each store is a
:class:`context_shrink.Store`: the core's :class:`context_shrink.Tables` plus the archive, which answers
``recall_context``'s query the same on every store. :func:`open_store` opens the one ``--state`` names.
"""

from __future__ import annotations

__all__ = [
    "ARCHIVE_FIELDS",
    "TYPED",
    "MemoryStore",
    "RedisStore",
    "SqliteStore",
    "archive_entries",
    "archive_files",
    "conversation_id",
    "default_state_path",
    "folded_away",
    "message_hash",
    "open_store",
    "read_archive",
]


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
    Store,
    fingerprint,
    json_or,
    leading_system,
    log,
    plain_content,
    redis_name,
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


def archive_terms(query: str) -> list[tuple[tuple[str, ...], bool]]:
    """A query's terms: each a phrase (its words) and whether its last word is a prefix. A clear error when
    it holds no word."""
    terms = []
    for quoted, star, bare in re.findall(r'"([^"]*)"(\*?)|(\S+)', query):
        if words := tuple(archive_words(quoted or bare)):
            terms.append((words, bool(star) if quoted else bare.endswith("*")))
    if not terms:
        raise ContextShrinkError("query must hold a word, a phrase or an id from the archive")
    return terms


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

    def found(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many messages were searched, and the best ``limit`` entries as archived."""
        mine = "" if conversation is None else " AND conversation = ?"
        scope = (self.ns,) if conversation is None else (self.ns, conversation)
        with self.held:
            (searched,) = self.db.execute(f"SELECT count(*) FROM archive WHERE ns = ?{mine}", scope).fetchone()
            if is_entry_id(query):
                start = query.strip()
                rows = self.db.execute(f"SELECT entry FROM archive WHERE ns = ?{mine} AND hash >= ? AND hash < ? "
                                       "ORDER BY time DESC, id DESC LIMIT ?", (*scope, start, start + "g",
                                                                              limit)).fetchall()  # fmt: skip
                if rows:
                    return searched, [json.loads(r[0]) for r in rows]
            rows = self.db.execute(
                f"SELECT a.entry FROM {self.fts} f JOIN archive a ON a.id = f.rowid WHERE {self.fts} MATCH ?"
                + ("" if conversation is None else " AND f.conversation = ?")
                + " ORDER BY f.rank, a.time DESC, a.id DESC LIMIT ?",
                (fts_query(query), *scope[1:], limit),
            ).fetchall()
        return searched, [json.loads(r[0]) for r in rows]

    def search(self, query: str, conversation: str | None, limit: int) -> tuple[int, list[dict[str, Any]]]:
        searched, entries = self.found(query, conversation, limit)
        return searched, [_entry_out(e) for e in entries]

    def close(self) -> None:
        with self.held:
            self.db.close()


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

    def close(self) -> None:
        self.index.close()


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

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.memory.close()


def open_store(spec: str | None, namespace: str = "default", environ: Mapping[str, str] | None = None) -> Store:
    """The store ``spec`` names (:meth:`Settings.state`; None: SQLite in the default place), kept serving from
    memory while it is unreachable (:class:`FallbackStore`); ``memory`` is memory alone."""
    spec = spec or f"sqlite:{default_state_path(environ)}"
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("sqlite:"):
        path = Path(spec[len("sqlite:") :]).expanduser()
        return FallbackStore(f"sqlite:{path}", lambda: SqliteStore(path, namespace))
    if importlib.util.find_spec("redis") is None:
        raise ContextShrinkError("--state redis://... needs the redis client: pip install 'context-shrink-mcp[redis]'")
    return FallbackStore(redis_name(spec), lambda: RedisStore(spec, namespace))


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
