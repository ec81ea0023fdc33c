"""Session writes that cannot lose an agent's lines (#34): an agent writing its session while a tool rewrites
it, a kill -9 during an undo, a full disk, a locked database, leftovers of a killed write.

The race tests sweep the moment the agent writes over the whole operation (seeded), 200 runs per store, so
the windows between a read and a replace, and between a replace and a read-back, are hit; every line the
agent wrote must be in the store afterwards, whatever the tool answered."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp_calls import call, error, run
from stores import claude_store, environ, opencode_store, write_jsonl

import context_shrink as cs
import context_shrink_sessions as css

RUNS = 200
FUTURE = time.time() + 10**6  # a "now" at which every store has been quiet long enough


def codex_store(home: Path) -> Path:
    call_item = {"type": "function_call", "call_id": "k1", "name": "exec_command", "arguments": "{}"}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]}, call_item,
             {"type": "function_call_output", "call_id": "k1", "output": "a.py " * 40},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]  # fmt: skip
    return write_jsonl(home / ".codex" / "sessions" / "2026" / "12" / "01" / "rollout-c1.jsonl",
                       [{"type": "session_meta", "payload": {"id": "c1", "cwd": "/x"}},
                        *({"type": "response_item", "payload": i} for i in items)])  # fmt: skip


def appended_record(agent: str, k: int) -> dict[str, Any]:
    """A record the agent appends: Claude Code's next user prompt chained to the leaf, Codex's next item."""
    if agent == "claude":
        parent = "r3" if k == 0 else f"new{k - 1}"
        return {"sessionId": "s1", "cwd": "/x", "type": "user", "uuid": f"new{k}", "parentUuid": parent,
                "message": {"role": "user", "content": f"more {k}"}}  # fmt: skip
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"more {k}"}]}
    return {"type": "response_item", "payload": item}


def cleared_result(found: css.AgentSession) -> list[dict[str, Any]]:
    """The session with its first tool result cleared (a prune every store can write)."""
    k = next(i for i, m in enumerate(found.messages) if m["role"] == "tool")
    return [*found.messages[:k], {**found.messages[k], "content": "[cleared]"}, *found.messages[k + 1 :]]


def appender(path: Path, lines: list[str], start: float, gap: float) -> threading.Thread:
    """The agent: ``lines`` appended one at a time (open, write, close, as Node's appendFileSync does)."""

    def go() -> None:
        time.sleep(start)
        for line in lines:
            with open(path, "a", encoding="utf-8") as out:
                out.write(line)
            time.sleep(gap)

    return threading.Thread(target=go)


def timed(action: Callable[[], Any]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


@pytest.mark.parametrize("agent", ["claude", "codex"])
def test_an_agent_appending_during_a_jsonl_write_loses_no_line(agent: str, tmp_path: Path) -> None:
    """200 runs of a prune while the agent appends three lines, its start swept over the whole write (the
    read-back included): every line the agent wrote is in the file afterwards, once; when the tool says it
    succeeded, the change is in the file too."""
    rng = random.Random(34)

    def fresh(home: Path) -> tuple[css.AgentSession, Path]:
        path = claude_store(home, "/x") if agent == "claude" else codex_store(home)
        found = css.read_session(f"{agent}:{'s1' if agent == 'claude' else 'c1'}", [agent], Path("/x"), environ(home))
        return found, path

    probe, _ = fresh(tmp_path / "probe")
    span = max(timed(lambda: css.write_session(probe, cleared_result(probe), dry_run=False, now=FUTURE)), 0.005)
    outcomes: dict[str, int] = {"written": 0, "refused": 0}
    lost = wrong = 0
    for run_no in range(RUNS):
        home = tmp_path / f"r{run_no}"
        found, path = fresh(home)
        lines = [json.dumps(appended_record(agent, k)) + "\n" for k in range(3)]
        agent_thread = appender(path, lines, start=rng.uniform(0, 1.2 * span), gap=rng.uniform(0, span / 4))
        agent_thread.start()
        try:
            css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
            outcomes["written"] += 1
            written = True
        except cs.ContextShrinkError as exc:
            assert "nothing written" in str(exc) or "restored from" in str(exc), exc
            outcomes["refused"] += 1
            outcomes[str(exc)[:90]] = outcomes.get(str(exc)[:90], 0) + 1
            written = False
        agent_thread.join()
        text = path.read_text()
        lost += any(text.count(line) != 1 for line in lines)
        wrong += written and "[cleared]" not in text
    assert (lost, wrong) == (0, 0), f"{lost} of {RUNS} runs lost the agent's lines; {wrong} said written wrongly"
    assert outcomes["written"] > RUNS // 2, outcomes  # appends are merged, not refused


def test_an_agent_appending_during_a_compaction_is_refused_or_kept(tmp_path: Path) -> None:
    """A compaction the agent's new lines would not follow: refused when they arrive before the swap, kept
    after the agent's own compaction records when they arrive after it; never lost."""
    rng = random.Random(7)
    for run_no in range(40):
        home = tmp_path / f"r{run_no}"
        path = claude_store(home, "/x")
        found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(home))
        summary = {"role": "system", "content": f"{cs.SUMMARY_MARKER} fixed a.py"}
        line = json.dumps(appended_record("claude", 0)) + "\n"
        agent_thread = appender(path, [line], start=rng.uniform(0, 0.03), gap=0)
        agent_thread.start()
        with_suppressed = True
        try:
            css.write_session(found, [summary, found.messages[-1]], dry_run=False, now=FUTURE)
        except cs.ContextShrinkError as exc:
            with_suppressed = "nothing written" in str(exc) or "restored from" in str(exc)
        agent_thread.join()
        assert with_suppressed and path.read_text().count(line) == 1


def wal_store(home: Path) -> Path:
    path = opencode_store(home, "/x")
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
    return path


def opencode_writer(path: Path, count: int, start: float, gap: float) -> threading.Thread:
    """OpenCode: ``count`` new messages with a part each, each in its own transaction (it waits on a lock)."""

    def go() -> None:
        time.sleep(start)
        with sqlite3.connect(path, timeout=10, isolation_level=None) as db:
            for k in range(count):
                now = int(time.time() * 1000)
                db.execute("BEGIN IMMEDIATE")
                db.execute("INSERT INTO message VALUES (?, 'ses_1', ?, ?, ?)", (f"n{k}", 100 + k, now,
                           json.dumps({"role": "user"})))  # fmt: skip
                db.execute("INSERT INTO part VALUES (?, ?, 'ses_1', ?, ?, ?)", (f"np{k}", f"n{k}", 100 + k, now,
                           json.dumps({"type": "text", "text": f"more {k}"})))  # fmt: skip
                db.execute("COMMIT")
                time.sleep(gap)

    return threading.Thread(target=go)


def test_opencode_writing_during_a_write_loses_no_row(tmp_path: Path) -> None:
    """200 runs of a prune while OpenCode commits three messages, its start swept over the write: every row
    OpenCode committed is there afterwards; a write that succeeded is there too."""
    rng = random.Random(18)
    probe = wal_store(tmp_path / "probe")
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path / "probe"))
    span = max(timed(lambda: css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)), 0.005)
    assert probe.exists()
    written = lost = wrong = 0
    for run_no in range(RUNS):
        home = tmp_path / f"r{run_no}"
        path = wal_store(home)
        found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(home))
        writer = opencode_writer(path, 3, start=rng.uniform(0, 1.2 * span), gap=rng.uniform(0, span / 4))
        writer.start()
        succeeded = False
        try:
            css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
            written, succeeded = written + 1, True
        except cs.ContextShrinkError as exc:
            assert "nothing written" in str(exc) or "locked" in str(exc), exc
        writer.join()
        with sqlite3.connect(path) as db:
            ids = {row[0] for row in db.execute("SELECT id FROM part")}
            output = json.loads(db.execute("SELECT data FROM part WHERE id = 'p5'").fetchone()[0])["state"]["output"]
        lost += not {"np0", "np1", "np2"} <= ids
        wrong += (output == "[cleared]") != succeeded
    assert (lost, wrong) == (0, 0), f"{lost} of {RUNS} runs lost OpenCode's rows; {wrong} answered wrongly"
    assert written > 0


UNDO_LOOP = """
import sys, dataclasses
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import context_shrink as cs
import context_shrink_sessions as css
path = Path(sys.argv[2]) / ".claude" / "projects" / "-x" / "s1.jsonl"
store = css.AGENT_STORES["claude"]
read = store.read
store.read = lambda *a: dataclasses.replace(read(*a), messages=[])  # every read-back fails: undone each time
print("ready", flush=True)
while True:
    found = css.ClaudeStore().read(path, "s1")
    try:
        css.write_session(found, found.messages[:2] + found.messages[4:], dry_run=False, now=1e12)
    except cs.ContextShrinkError:
        pass
"""


def test_kill_9_during_an_undo_never_leaves_a_broken_session(tmp_path: Path) -> None:
    """A process doing writes that are undone again and again (each read-back made to fail), killed with
    SIGKILL at swept moments: the session file is always whole (the original bytes, or the change written),
    never empty or half a file."""
    path = claude_store(tmp_path, "/x")
    original = path.read_bytes()
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    changed_home = tmp_path / "changed"
    changed = claude_store(changed_home, "/x")
    css.write_session(css.read_session("claude:s1", ["claude"], Path("/x"), environ(changed_home)),
                     found.messages[:2] + found.messages[4:], dry_run=False, now=FUTURE)  # fmt: skip
    whole = {original, changed.read_bytes()}
    root = str(Path(cs.__file__).parent)
    rng = random.Random(9)
    for _ in range(6):
        child = subprocess.Popen([sys.executable, "-c", UNDO_LOOP, root, str(tmp_path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL)  # fmt: skip
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert path.read_bytes() in whole, f"the session was left broken by a kill: {path.read_bytes()!r}"
        path.write_bytes(original)  # the next process starts from the original again
        for leftover in path.parent.glob("*.pre-shrink-*"):
            leftover.unlink()


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not enough room for the backup and the new file: a clear error, the session as it was, no backup."""
    path = claude_store(tmp_path, "/x")
    original = path.read_bytes()
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
    with pytest.raises(cs.ContextShrinkError, match=r"not enough free space .* nothing written"):
        css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
    assert path.read_bytes() == original and list(path.parent.glob("*.pre-shrink-*")) == []


def test_a_disk_that_fills_during_the_backup_leaves_no_partial_backup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the backup is written (through the MCP tool): the partial backup removed, a clear error
    naming the file, the session untouched."""
    fsync = os.fsync

    def full(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith("s1.jsonl.pre-shrink-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    for name, value in environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    path = claude_store(tmp_path, str(tmp_path))
    original = path.read_bytes()
    os.utime(path, (time.time() - 60, time.time() - 60))  # quiet long enough
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", session_stores=("claude",)))
    said = error(run(call(server, "prune_context", {"session": "claude:s1", "dry_run": False,
                                                     "clear_tool_results_before": 0})))  # fmt: skip
    assert "No space left on device" in said and "nothing written" in said and str(path) in said
    assert path.read_bytes() == original and list(path.parent.glob("*.pre-shrink-*")) == []


def test_a_killed_writes_temporary_file_is_swept(tmp_path: Path) -> None:
    path = claude_store(tmp_path, "/x")
    stale = path.with_name(f".{path.name}{cs.TEMP_MARK}dead.tmp")
    fresh = path.with_name(f".{path.name}{cs.TEMP_MARK}live.tmp")
    for leftover in (stale, fresh):
        leftover.write_text("half")
    os.utime(stale, (time.time() - 600, time.time() - 600))
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to a write in progress


def test_reading_an_opencode_database_does_not_make_it_look_busy(tmp_path: Path) -> None:
    """The quiet rule reads the session's own rows: the tool's own read (which touches SQLite's files) does
    not make the next write wait."""
    wal_store(tmp_path)
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    report = css.write_session(found, cleared_result(found), dry_run=False)  # now: just after the reads
    assert report["tool_results_replaced"] == 1


def test_a_locked_opencode_database_says_so_and_leaves_no_backup(tmp_path: Path) -> None:
    path = opencode_store(tmp_path, "/x")  # a rollback journal: a writer's lock also blocks readers
    found = css.read_session("opencode:ses_1", ["opencode"], Path("/x"), environ(tmp_path))
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(cs.ContextShrinkError, match="locked"):
            css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
        with pytest.raises(cs.ContextShrinkError, match="locked"):
            css.read_session("opencode:latest", ["opencode"], Path("/x"), environ(tmp_path))
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert list(path.parent.glob("*.pre-shrink-*")) == []


def test_a_session_that_is_a_symlink_is_not_written_through(tmp_path: Path) -> None:
    """A write replaced the link with a file (and wrote wherever the link pointed); now it refuses, and the
    link and its target stay as they were."""
    path = claude_store(tmp_path, "/x")
    target = path.with_name("elsewhere.jsonl.orig")  # inside the store (one outside is not even read)
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)
    found = css.read_session("claude:s1", ["claude"], Path("/x"), environ(tmp_path))
    before = target.read_bytes()
    with pytest.raises(cs.ContextShrinkError, match="nothing written"):
        css.write_session(found, cleared_result(found), dry_run=False, now=FUTURE)
    assert path.is_symlink() and target.read_bytes() == before and list(path.parent.glob("*.pre-shrink-*")) == []


def test_symlinks_leading_out_of_a_store_are_not_followed(tmp_path: Path) -> None:
    """A session file, or a project folder, that is a symlink out of the agent's store was listed and read
    (its text handed to the caller); now only what lies inside the store is. A symlink inside it still reads."""
    path = claude_store(tmp_path, "/x")
    outside = tmp_path / "outside"
    (outside / "proj").mkdir(parents=True)
    secret = path.read_text().replace('"s1"', '"evil"').replace("list the files", "SECRET-OUTSIDE")
    (outside / "evil.jsonl").write_text(secret)
    (outside / "proj" / "evil2.jsonl").write_text(secret.replace('"evil"', '"evil2"'))
    (path.parent / "evil.jsonl").symlink_to(outside / "evil.jsonl")
    (path.parent.parent / "linked").symlink_to(outside / "proj", target_is_directory=True)
    (path.parent / "alias.jsonl").symlink_to(path)  # inside the store: followed
    listed = [s["session"] for s in css.list_sessions(["claude"], environ(tmp_path))]
    assert sorted(listed) == ["claude:alias", "claude:s1"]
    for ident in ("evil", "evil2"):
        with pytest.raises(cs.ContextShrinkError, match="no claude session"):
            css.read_session(f"claude:{ident}", ["claude"], Path("/x"), environ(tmp_path))
    assert css.read_session("claude:alias", ["claude"], Path("/x"), environ(tmp_path)).messages


def bounded(action: Callable[[], Any], seconds: float) -> Any:
    """``action()`` in a thread, which must end within ``seconds`` (a write that waits forever fails the test
    instead of hanging the suite); its result, or the exception it raised."""
    done: list[Any] = []

    def go() -> None:
        try:
            done.append(action())
        except BaseException as exc:  # the tool's answer, whatever it is
            done.append(exc)

    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(seconds)
    assert done, f"still waiting after {seconds} s"
    return done[0]


def session_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    for name, value in environ(tmp_path).items():
        monkeypatch.setenv(name, value)
    path = claude_store(tmp_path, str(tmp_path))
    os.utime(path, (time.time() - 60, time.time() - 60))  # quiet long enough
    return cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", session_stores=("claude",))), path


PRUNE_SESSION = {"session": "claude:s1", "dry_run": False, "clear_tool_results_before": 0}


def test_a_session_swapped_for_a_fifo_during_the_write_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session file replaced by a FIFO between the read and the write (through the MCP tool): opening it
    waited for a writer that never came; now it is refused at once, naming the file."""
    server, path = session_server(tmp_path, monkeypatch)
    sweep = cs.Folder.sweep

    def swapped(folder: cs.Folder, beside: str) -> None:
        sweep(folder, beside)
        path.unlink()
        os.mkfifo(path)

    monkeypatch.setattr(cs.Folder, "sweep", swapped)
    said = bounded(lambda: error(run(call(server, "prune_context", PRUNE_SESSION))), 60)
    assert "not a regular file" in said and str(path) in said, said
    assert list(path.parent.glob("*.pre-shrink-*")) == []


def test_a_writer_that_holds_the_folders_lock_is_waited_for_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the session folder's lock (stopped, or hung) made a write wait forever; now the
    write waits LOCK_WAIT_SECONDS, then says so and writes nothing. Released in time, the write goes on."""
    server, path = session_server(tmp_path, monkeypatch)
    original = path.read_bytes()
    monkeypatch.setattr(cs, "LOCK_WAIT_SECONDS", 1.0)
    hold = "import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold + "print('held', flush=True)\ntime.sleep(600)",
                               str(path.parent)], stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        said = bounded(lambda: error(run(call(server, "prune_context", PRUNE_SESSION))), 60)
        assert "another writer" in said and "nothing written" in said and str(path.parent) in said, said
        assert path.read_bytes() == original and list(path.parent.glob("*.pre-shrink-*")) == []
    finally:
        holder.kill()
        holder.wait()
    quick = subprocess.Popen([sys.executable, "-c", hold + "time.sleep(0.3)", str(path.parent)])
    try:
        result = bounded(lambda: run(call(server, "prune_context", PRUNE_SESSION)), 60)
        assert not result.is_error, result.content[0].text
    finally:
        quick.wait()
