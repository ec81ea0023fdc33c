"""The state store (--state): one contract for memory, SQLite and a real redis-server; what survives a proxy's
restart and what two replicas share, measured on the bytes the upstream receives; the archive's index and its
query; a store that cannot be reached."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from builders import chat_history, conversation
from conftest import redis_server
from fake_openai import FakeOpenAI, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_calls import call, ok, run
from proxy_helpers import MODULE, proxy
from state_runs import run as run_turns
from state_runs import summary_call, turns
from tiny_llama import free_port

import context_shrink as cs
import context_shrink_proxy as csp
import context_shrink_state as cst

KINDS = ("memory", "sqlite", "redis")


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[cs.Store]:
    """Each kind of store, fresh."""
    if request.param == "memory":
        yield cst.MemoryStore()
    elif request.param == "sqlite":
        opened = cst.SqliteStore(tmp_path / "state" / "state.sqlite3", "test")
        yield opened
        opened.close()
    else:
        with redis_server(tmp_path) as (url, _):
            opened = cst.RedisStore(url, "test")
            yield opened
            opened.close()


def folded(history: list[dict[str, Any]], keep: int = 1, action: str = "trim") -> list[dict[str, Any]]:
    return cst.archive_entries(history, history[-keep:], action)


# --------------------------------------------------------------------------- the contract, on every store


def test_namespaces_name_every_deployment_that_archived(store: cs.Store, tmp_path: Path) -> None:
    """``namespaces`` lists each namespace whose archive holds messages, with how many, on every store but memory
    (which holds this process's alone)."""
    assert store.namespaces() == {}
    store.archive(folded(conversation(3, size=5)), 1 << 30, 30)
    if isinstance(store, cst.MemoryStore):
        assert store.namespaces() == {}
        return
    sqlite = isinstance(store, cst.SqliteStore)  # the same file or server, another deployment's name (no password)
    other = cst.SqliteStore(Path(store.name.removeprefix("sqlite:")), "other:ns") if sqlite else cst.RedisStore(
        store.name, "other:ns")  # fmt: skip
    other.archive(folded(conversation(2, size=3)), 1 << 30, 30)
    counts = store.namespaces()
    assert set(counts) == {"test", "other:ns"} and counts == other.namespaces()
    assert counts["test"] > counts["other:ns"] > 0
    other.close()


def test_tables_keep_keys_of_any_shape_and_find_the_first_present(store: cs.Store) -> None:
    table = cs.StoredTable(store, "factors")
    table[("m", "Han")], table["m"], table[None] = 1.5, 1.2, 0.9
    assert table[("m", "Han")] == 1.5 and table["m"] == 1.2 and table[None] == 0.9
    assert ("m", "ascii") not in table and table.get(("m", "ascii"), 7) == 7
    assert list(table) == [("m", "Han"), "m", None]  # tuples come back as tuples, oldest written first
    assert table.first([("x",), "m", ("m", "Han")]) == (1, 1.2) and table.first([("x",)]) == (-1, None)
    assert table.pop("m") == 1.2 and "m" not in table and table.pop("m", "gone") == "gone"
    counts = cs.StoredTable(store, "counts")
    counts[("m", "tools", "prefix")] = (120, 30, "llama.cpp")
    assert counts[("m", "tools", "prefix")] == [120, 30, "llama.cpp"]  # what JSON keeps


def test_every_table_is_bounded_by_entries_and_the_oldest_go_first(store: cs.Store) -> None:
    windows = cs.StoredTable(store, "windows")
    most = cs.STATE_TABLES["windows"][0]
    for n in range(most + 40):
        windows[f"model-{n}"] = n
    assert len(windows) == most and f"model-{most + 39}" in windows and "model-0" not in windows
    spans = cs.StoredTable(store, "spans")
    for n in range(40):  # 40 summaries of 1 MB against 16 MB
        spans[f"span-{n}"] = f"{n}" + "x" * 1_000_000
    assert 14 <= len(spans) <= 16 and "span-39" in spans


def test_counters_add_up_and_leases_are_exclusive(store: cs.Store) -> None:
    for _ in range(3):
        store.add("stats", "row", {"requests": 1, "share": 0.25})
    assert store.get("stats", "row") == {"requests": 3, "share": 0.75}
    assert store.claim("span", 30) and not store.claim("span", 30)
    store.release("span")
    assert store.claim("span", 0.2)
    time.sleep(0.4)
    assert store.claim("span", 30)  # an expired lease is taken over


def test_the_archive_keeps_each_message_once_and_finds_it_by_words_phrase_prefix_or_id(store: cs.Store) -> None:
    history = conversation(3, size=5)
    entries = folded(history)
    assert store.archive(entries, 1 << 30, 30) == len(entries) == len(history) - 1
    assert store.archive(entries, 1 << 30, 30) == 0  # each message once
    searched, found = store.search("file_0.py", None, 5)
    assert searched == len(entries) and found[0]["message"] == history[1]
    assert store.search('"file 0 py"', None, 5)[1][0]["message"] == history[1]
    assert history[1] in [e["message"] for e in store.search("fil*", None, 10)[1]]
    assert store.search(entries[2]["id"], None, 5)[1][0]["message"] == entries[2]["message"]
    assert store.search("no such words", None, 5)[1] == []
    assert store.search("file_0.py", "0" * 16, 5) == (0, [])  # another conversation's
    assert set(found[0]) == set(cst.ARCHIVE_FIELDS)
    with pytest.raises(cs.ContextShrinkError, match="query"):
        store.search("  ", None, 5)


def test_the_archive_is_bounded_by_size_and_age(store: cs.Store) -> None:
    for n in range(40):  # 40 conversations of ~100 KB against 1 MiB
        history = [{"role": "user", "content": f"conversation {n}"}, {"role": "tool", "tool_call_id": "t",
                    "content": f"zz{n} " + "y" * 100_000}, {"role": "user", "content": "next"}]  # fmt: skip
        store.archive(folded(history), 1 << 20, 30)
    assert store.search("zz39", None, 5)[1] and not store.search("zz0", None, 5)[1]
    assert store.search("next", None, 100)[0] <= 2 * 11  # ten of the 100 KB messages at most, and their neighbours
    old = {**folded([{"role": "user", "content": "old one"}, {"role": "user", "content": "now"}])[0], "time": 0}
    store.archive([old], 1 << 20, 30)  # archived in 1970: gone at once
    assert store.search("old", None, 5)[1] == []


WORDS = ["parser", "pars", "token", "tokens", "cafe", "café", "Über", "uber", "id_42", "x", "fix", "src/app.py"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12), min_size=1, max_size=25),
    query=st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(["", "*", '"'])), min_size=1, max_size=3),
    conversation=st.booleans(),
)
def test_every_store_answers_a_query_alike(
    tmp_path: Path, redis_url: str, texts: Any, query: Any, conversation: bool
) -> None:
    """One query semantics on every store (each runs it on FTS5: SQLite's file, memory's database, a replica's
    index of what Redis keeps): the same hits in the same BM25 order, or the same error."""
    history = [{"role": "user", "content": " ".join(t)} for t in texts] + [{"role": "user", "content": "end"}]
    entries = folded(history)
    text = " ".join(f'"{w}"' if mark == '"' else w + mark for w, mark in query)
    namespace = os.urandom(4).hex()
    stores = [cst.MemoryStore(), cst.SqliteStore(tmp_path / f"{namespace}.db"), cst.RedisStore(redis_url, namespace)]
    answers = []
    for store in stores:
        store.archive(entries, 1 << 30, 30)
        try:
            searched, found = store.search(text, entries[0]["conversation"] if conversation else None, 100)
            answers.append((searched, [e["index"] for e in found]))
        except cs.ContextShrinkError as exc:
            answers.append(str(exc))
        store.close()
    assert answers[0] == answers[1] == answers[2]


# --------------------------------------------------------------------------- SQLite on disk


def test_the_default_store_is_a_private_sqlite_file_in_the_state_folder(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    assert cst.default_state_path(env) == tmp_path / "xdg" / "context-shrink" / "state.sqlite3"
    store = cst.open_store(None, "default", env)
    assert store.name == f"sqlite:{tmp_path / 'xdg' / 'context-shrink' / 'state.sqlite3'}" and store.down is None
    store.put("windows", '"m"', 4096)
    store.archive(folded(conversation(2, size=3)), 1 << 30, 30)
    folder = tmp_path / "xdg" / "context-shrink"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert [p.name for p in files] == ["state.sqlite3", "state.sqlite3-shm", "state.sqlite3-wal"]  # WAL mode
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    store.close()
    again = cst.open_store(f"sqlite:{folder / 'state.sqlite3'}", "default")
    assert again.get("windows", '"m"') == 4096 and cst.open_store(f"sqlite:{folder / 'state.sqlite3'}", "other").get(
        "windows", '"m"') is None  # fmt: skip
    again.close()


def test_the_state_settings_are_checked_at_start(tmp_path: Path) -> None:
    read = cs.Settings({"CONTEXT_SHRINK_STATE": "sqlite:~/s.db", "CONTEXT_SHRINK_NAMESPACE": "team-a"})
    assert read.state() == f"sqlite:{Path('~/s.db').expanduser()}" and read.namespace() == "team-a"
    assert cs.Settings({}, {"state": "redis://cache:6380/2"}).state("state") == "redis://cache:6380/2"
    for bad in ("postgres://x", "sqlite:", "redis://", "disk"):
        with pytest.raises(cs.ConfigError, match="CONTEXT_SHRINK_STATE"):
            cs.Settings({"CONTEXT_SHRINK_STATE": bad}).state()
    with pytest.raises(cs.ConfigError) as caught:
        cs.Settings({}, {"state": "redis://:hunter2@cache:6380/x"}).state("state")
    assert "hunter2" not in str(caught.value) and caught.value.variable == "--state"
    with pytest.raises(cs.ConfigError, match="NAMESPACE"):
        cs.Settings({"CONTEXT_SHRINK_NAMESPACE": "a b"}).namespace()
    config = cs.Config.from_env({"CONTEXT_SHRINK_STATE": f"sqlite:{tmp_path}/s.db", "CONTEXT_SHRINK_NAMESPACE": "n"})
    assert (config.state, config.namespace) == (f"sqlite:{tmp_path}/s.db", "n")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["http", "https"]), st.sampled_from(["127.0.0.1", "vllm", "api.example.com", "[::1]"]),
       st.one_of(st.none(), st.integers(1, 65535)), st.sampled_from(["", "/v1", "/api/v1", "/team-b/v1"]))  # fmt: skip
def test_the_default_namespace_is_the_upstreams(scheme: str, host: str, port: int | None, path: str) -> None:
    url = f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"
    name = cs.upstream_namespace(url)
    assert cs.Settings({"CONTEXT_SHRINK_NAMESPACE": name}).namespace() == name  # a namespace the flag accepts
    shouted = f"{scheme.upper()}://{host.upper()}{'' if port is None else f':{port}'}{path}"
    written = {url, shouted, url + "/", url if path.endswith("/v1") else url + "/v1"}
    assert {cs.upstream_namespace(u) for u in written} == {name}  # however one upstream is written: one store
    assert cs.upstream_namespace(url.replace(host, "other-host")) != name
    assert cs.upstream_namespace(f"{scheme}://{host}:{(port or 80) % 65535 + 1}{path}") != name
    assert cs.Config(base_url=url).namespace == name == csp.ProxyConfig(upstream=url).namespace
    assert cs.Config(base_url=url, namespace="team-a").namespace == "team-a"


def test_redis_without_its_client_is_an_error_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # as if the redis extra were not installed
    with pytest.raises(cs.ConfigError, match=r"context-shrink-mcp\[redis\]") as caught:
        cs.Settings({"CONTEXT_SHRINK_STATE": "redis://127.0.0.1:6379/0"}).state()
    assert caught.value.variable == "CONTEXT_SHRINK_STATE"


# --------------------------------------------------------------------------- an unreachable store


def test_an_unreachable_store_serves_from_memory_and_comes_back(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = cst.open_store(f"sqlite:{blocked}/state.sqlite3")  # a folder that cannot be made
    assert store.down is not None and "NotADirectoryError" in store.down
    store.put("windows", '"m"', 4096)
    assert store.get("windows", '"m"') == 4096  # kept in memory meanwhile
    blocked.unlink()
    blocked.mkdir()
    store.retry_at = 0  # type: ignore[attr-defined]  # its next try is now
    assert store.get("windows", '"m"') is None and store.down is None  # the store answers again (empty)
    store.close()


def test_a_proxy_whose_redis_is_down_keeps_serving_and_says_so(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    fake = FakeOpenAI(window=4096)
    with serve(fake) as upstream, proxy(upstream, "--state", url, log=tmp_path / "log") as base:
        replies = [httpx2.post(f"{base}/chat/completions", json={"model": "m", "messages": m, "max_tokens": 256},
                               timeout=60) for m in turns(8)]  # fmt: skip
        stats = httpx2.get(base.removesuffix("/v1") + "/context-shrink/stats").json()
    assert all(r.status_code == 200 for r in replies)
    assert "action=compact" in replies[-1].headers["x-context-shrink"]
    said = replies[-1].headers["x-context-shrink-state"]
    assert said.startswith(f"redis://127.0.0.1:{port}/0 unreachable") and "serving from memory" in said
    assert stats["state"]["degraded"] == said and stats["state"]["store"] == f"redis://127.0.0.1:{port}/0"
    log = (tmp_path / "log").read_text()
    assert "unreachable" in log and "hunter2" not in log + json.dumps(stats) + said


# --------------------------------------------------------------------------- restart and replicas, end to end


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_restarted_proxy_makes_no_summary_call_again_and_sends_the_same_bytes(tmp_path: Path, kind: str) -> None:
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path))[0] if kind == "redis" else None
        state = f"sqlite:{tmp_path / 'state.sqlite3'}" if url is None else url
        restarted = run_turns("restart", state, tmp_path / "log", 24, 14)
    throughout = run_turns("one", f"sqlite:{tmp_path / 'one.sqlite3'}", tmp_path / "log", 24, 14)
    forgetful = run_turns("restart", "memory", tmp_path / "log", 24, 14)
    assert throughout.summary_calls >= 4
    assert restarted.summary_calls == throughout.summary_calls < forgetful.summary_calls
    assert restarted.bodies == throughout.bodies  # the first request after the restart included, byte for byte


def test_two_replicas_on_one_redis_make_no_more_summary_calls_and_forward_the_same_bytes(
    tmp_path: Path, redis_url: str
) -> None:
    alone = run_turns("one", "memory", tmp_path / "log", 24)
    replicas = run_turns("replicas", redis_url, tmp_path / "log", 24)
    apart = run_turns("replicas", "memory", tmp_path / "log", 24)
    assert replicas.summary_calls == alone.summary_calls < apart.summary_calls
    assert replicas.bodies == alone.bodies
    stats = json.loads(replicas.headers[-1].get("x-context-shrink-stats", "{}") or "{}")
    assert stats == {}  # nothing of the store in a normal reply's headers


def test_replicas_asked_the_same_span_at_once_summarise_it_once(tmp_path: Path, redis_url: str) -> None:
    fake = FakeOpenAI(window=4096, latency=0.3)  # a summary takes a while: the other replica asks meanwhile
    messages = turns(12)[-1]
    with serve(fake) as upstream, proxy(upstream, "--state", redis_url, log=tmp_path / "log") as a, proxy(
        upstream, "--state", redis_url, log=tmp_path / "log"
    ) as b:  # fmt: skip
        body = {"model": "m", "messages": messages, "max_tokens": 256}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda u: httpx2.post(f"{u}/chat/completions", json=body, timeout=120), [a, b]))
        stats = httpx2.get(a.removesuffix("/v1") + "/context-shrink/stats").json()
    assert [r.status_code for r in replies] == [200, 200]
    sent = [r["raw"] for r in fake.requests if not summary_call(r["body"]) and r["tokens"] <= fake.window]
    made = sum(summary_call(r["body"]) for r in fake.requests)
    alone = FakeOpenAI(window=4096)
    with serve(alone) as upstream, proxy(upstream, "--state", "memory", log=tmp_path / "log") as c:
        assert httpx2.post(f"{c}/chat/completions", json=body, timeout=120).status_code == 200
    assert made == sum(summary_call(r["body"]) for r in alone.requests) >= 1  # one replica wrote it, once
    assert len(set(sent)) == 1 and any("summary_cached=True" in r.headers["x-context-shrink"] for r in replies)
    assert stats["totals"]["requests"] == 2  # both replicas' requests, on either one's page


# --------------------------------------------------------------------------- the archive through the doors


def test_recall_finds_what_the_proxy_archived_through_the_mcp_tool(tmp_path: Path) -> None:
    state = f"sqlite:{tmp_path / 'state.sqlite3'}"
    fake = FakeOpenAI(window=6000)
    history = chat_history(30, size=300)[:25]
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--state", state, log=tmp_path / "log") as url:
        reply = httpx2.post(f"{url}/chat/completions", json={"model": "m", "messages": history, "max_tokens": 200},
                            timeout=120)  # fmt: skip
    assert reply.status_code == 200 and "action=compact" in reply.headers["x-context-shrink"]
    conversation_id = cst.conversation_id(history)
    assert f"conversation={conversation_id}" in reply.headers["x-context-shrink"]
    env = {"CONTEXT_SHRINK_STATE": state, "CONTEXT_SHRINK_ROOT": str(tmp_path)}
    other = cs.build_server(cs.Config.from_env({**env, "CONTEXT_SHRINK_BASE_URL": "http://127.0.0.1:1/v1"}))
    assert ok(run(call(other, "recall_context", {"query": "file_0.py"})))["found"] == 0  # another upstream's store
    config = cs.Config.from_env({**env, "CONTEXT_SHRINK_BASE_URL": upstream.upper().removesuffix("/V1") + "/"})
    server = cs.build_server(config)  # the same upstream however written: the proxy's namespace
    recalled = ok(run(call(server, "recall_context", {"query": "file_0.py"})))
    assert recalled["archive"] == state and recalled["entries"][0]["message"] == history[1]
    assert recalled["entries"][0]["conversation"] == conversation_id
    mine = ok(run(call(server, "recall_context", {"query": "file_0.py", "conversation": conversation_id})))
    assert mine["found"] == 1 and mine["searched"] == recalled["searched"] >= 10
    by_id = ok(run(call(server, "recall_context", {"query": recalled["entries"][0]["id"]})))
    assert by_id["entries"][0]["message"] == history[1]
    bad = run(call(server, "recall_context", {"query": "x", "conversation": "../../etc/passwd"}))
    assert bad.is_error and "conversation" in bad.content[0].text
    empty = run(call(server, "recall_context", {"query": "  "}))
    assert empty.is_error and "query" in empty.content[0].text


def test_an_old_jsonl_archive_is_imported_once(tmp_path: Path) -> None:
    archive, state = tmp_path / "archive", f"sqlite:{tmp_path / 'state.sqlite3'}"
    archive.mkdir()
    old = [{"role": "user", "content": f"old note {n}: zebra{n}"} for n in range(5)]
    lines = [json.dumps({"id": cst.message_hash(m)[:12], "hash": cst.message_hash(m), "index": n, "action": "trim",
                         "time": int(time.time()), "message": m}) for n, m in enumerate(old)]  # fmt: skip
    broken = [json.dumps({"id": "x", "hash": "y" * 64, "message": {"role": "user"}}), json.dumps({"message": 3})]
    (archive / ("a" * 16 + ".jsonl")).write_text("\n".join([*lines, *broken]) + "\nnot json\n")
    fake = FakeOpenAI(window=4096)
    with serve(fake) as upstream:
        for _ in range(2):  # started twice in front of one upstream (one namespace): imported once
            with proxy(upstream, "--state", state, "--archive-dir", str(archive), log=tmp_path / "log"):
                pass
    store = cst.SqliteStore(tmp_path / "state.sqlite3", cs.upstream_namespace(upstream))
    searched, found = store.search("zebra3", None, 5)
    assert searched == 5 and found[0]["message"] == old[3] and found[0]["conversation"] == "a" * 16
    assert (tmp_path / "log").read_text().count("imported 5 message(s)") == 1
    store.close()
    # recall_context alone (no proxy started since the upgrade) imports it into the store it searches
    env = {"CONTEXT_SHRINK_STATE": f"sqlite:{tmp_path / 'mcp.sqlite3'}", "CONTEXT_SHRINK_ARCHIVE_DIR": str(archive)}
    recalled = ok(run(call(cs.build_server(cs.Config.from_env(env)), "recall_context", {"query": "zebra4"})))
    assert recalled["entries"][0]["message"] == old[4] and recalled["searched"] == 5


def test_recall_over_stdio_searches_the_store_the_environment_names(tmp_path: Path) -> None:
    """The tool as an MCP client starts it: a stdio server given CONTEXT_SHRINK_STATE."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    path = tmp_path / "state.sqlite3"
    history = conversation(3, size=5)
    store = cst.SqliteStore(path, "team")
    store.archive(folded(history), 1 << 30, 30)
    store.close()
    env = {**os.environ, "CONTEXT_SHRINK_STATE": f"sqlite:{path}", "CONTEXT_SHRINK_NAMESPACE": "team"}
    params = StdioServerParameters(command=sys.executable, args=[str(MODULE)], env=env)

    async def recall() -> Any:
        async with Client(params) as client:
            return await client.call_tool("recall_context", {"query": "file_0.py"})

    result = anyio.run(recall)
    assert not result.is_error and result.structured_content["entries"][0]["message"] == history[1]
