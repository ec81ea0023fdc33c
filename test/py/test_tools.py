"""The MCP tools through the SDK's in-memory client: schemas, results, files and errors."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from builders import assistant, conversation, tool, user
from conftest import LOCAL_SESSIONS
from mcp import Client
from mcp_calls import call, error, ok, run

import context_shrink as cs

COMMON = ["tools"]
CONTRACT = {
    "estimate_context": [
        "messages",
        "max_context_tokens",
        "messages_path",
        *COMMON,
        "model",
        "reserve_tokens",
        "session",
    ],
    "trim_context": [
        "messages",
        "keep_last",
        "max_context_tokens",
        "messages_path",
        "output_path",
        *COMMON,
        "model",
        "reserve_tokens",
        "strategy",
        "diet_tool_results",
        "target_ratio",
        "session",
        "dry_run",
    ],
    "analyze_context": [
        "messages",
        "messages_path",
        "max_context_tokens",
        "sort",
        "limit",
        "offset",
        *COMMON,
        "model",
        "reserve_tokens",
        "session",
    ],
    "prune_context": [
        "messages",
        "messages_path",
        "output_path",
        "remove_ids",
        "images",
        "clear_tool_results_before",
        "dry_run",
        "max_context_tokens",
        *COMMON,
        "reserve_tokens",
        "session",
        "scrub",
    ],
    "compact_context": [
        "messages",
        "keep_last",
        "max_context_tokens",
        "threshold",
        "force",
        "summary",
        "model",
        "max_summary_tokens",
        "messages_path",
        "output_path",
        *COMMON,
        "reserve_tokens",
        "target_ratio",
        "summary_context_tokens",
        "previous_summary",
        "fallback",
        "diet_tool_results",
        "anchor_identifiers",
        "session",
        "dry_run",
    ],
    "shrink_text": ["text", "path", "budget", "query", "protect", "exact_only", "on_overflow"],
    "check_text": ["plan", "text", "path", "markers", "fail_markers", "skipped"],
    "recall_context": ["query", "conversation", "limit"],
    "list_sessions": ["agent", "limit"],
}


@pytest.fixture
def server(tmp_path: Path) -> Any:
    return cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))


def test_tools_and_parameters_are_the_public_contract(server: Any) -> None:
    async def listing() -> Any:
        async with Client(server) as client:
            return (await client.list_tools()).tools

    tools = {t.name: t for t in run(listing())}
    assert sorted(tools) == sorted(CONTRACT)
    for name, params in CONTRACT.items():
        schema = tools[name].input_schema
        assert list(schema["properties"]) == params
        assert schema["additionalProperties"] is False  # an argument the tool does not take is refused
        assert not schema.get("required") or name in ("check_text", "recall_context")
        assert tools[name].description and "Args:" not in tools[name].description
        assert tools[name].output_schema is None  # "an object" told a client nothing; results are structured
    assert tools["estimate_context"].annotations.read_only_hint is True
    props = tools["compact_context"].input_schema["properties"]
    assert "default" not in props["max_context_tokens"]  # the server's window, stated in its instructions
    assert props["keep_last"]["default"] == 8
    assert props["threshold"]["default"] == 0.8
    assert props["max_summary_tokens"]["default"] == 1024


def test_environment_sets_the_default_window(tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, max_context_tokens=4096))
    result = ok(run(call(server, "estimate_context", {"messages": [user("hi")]})))
    assert result["max_context_tokens"] == 4096


def test_estimate_inline(server: Any) -> None:
    result = ok(run(call(server, "estimate_context", {"messages": [user("hello world")], "max_context_tokens": 100})))
    assert result == {
        "tokens": 9,  # 3 per message + "user" + "hello world" (2) + 3 priming
        "max_context_tokens": 100,
        "remaining": 91,
        "should_trim": False,
        "tokenizer": "tiktoken:cl100k_base",
        "tokenizer_note": None,
        "message_count": 1,
        "tools_tokens": 0,
        "reserve_tokens": 0,
        "max_context_source": "given",
    }


def test_estimate_from_files(server: Any, tmp_path: Path) -> None:
    session = json.loads((LOCAL_SESSIONS / "openhands_claude-3-5-sonnet_vue-todo-app.json").read_text())
    (tmp_path / "s.json").write_text(json.dumps(session))  # an object with a "messages" key
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(m) + "\n" for m in session["messages"]))
    a = ok(run(call(server, "estimate_context", {"messages_path": "s.json"})))
    b = ok(run(call(server, "estimate_context", {"messages_path": str(tmp_path / "s.jsonl")})))
    assert a == b and a["message_count"] == 10 and a["tokens"] > 3000


def test_trim_inline_and_to_a_file(server: Any, tmp_path: Path) -> None:
    messages = conversation(6, size=100)
    arguments = {"messages": messages, "max_context_tokens": 2000, "keep_last": 2, "strategy": "drop"}
    inline = ok(run(call(server, "trim_context", arguments)))
    assert inline["fits"] and inline["dropped"] > 0 and inline["output_path"] is None
    assert inline["messages"] == messages[:1] + messages[inline["kept_from_index"] :]
    (tmp_path / "in.json").write_text(json.dumps({"model": "m", "messages": messages}))
    report = ok(
        run(
            call(
                server,
                "trim_context",
                {
                    "messages_path": "in.json",
                    "output_path": "out/trimmed.json",
                    "max_context_tokens": 2000,
                    "strategy": "drop",
                },
            )
        )
    )
    assert report["messages"] is None and report["output_path"] == str(tmp_path / "out" / "trimmed.json")
    written = json.loads((tmp_path / "out" / "trimmed.json").read_text())
    assert written["model"] == "m" and written["messages"] == messages[:1] + messages[report["kept_from_index"] :]


def test_compact_modes(tmp_path: Path) -> None:
    # A configured model, but model="" forces plan mode.
    server = cs.build_server(cs.Config(root=tmp_path, model="configured", tokenizer="tiktoken"))
    messages = conversation(5, size=100)
    plan = ok(run(call(server, "compact_context", {"messages": messages, "max_context_tokens": 2000, "model": ""})))
    assert plan["mode"] == "plan" and plan["needs_summary"] and plan["messages"] is None
    assert plan["summary_prompt"] == cs.SUMMARY_PROMPT
    assert "word word" not in json.dumps(plan)
    done = ok(
        run(
            call(
                server,
                "compact_context",
                {"messages": messages, "max_context_tokens": 2000, "summary": "Five files were fixed."},
            )
        )
    )
    assert done["mode"] == "summary" and done["compacted"] and done["fits"] and done["model_calls"] == 0
    assert done["messages"][1]["content"].startswith(cs.SUMMARY_MARKER)
    assert cs.api_problems(done["messages"]) == []
    below = ok(run(call(server, "compact_context", {"messages": messages[:6], "max_context_tokens": 2000})))
    assert below["compacted"] is False and below["messages"] == messages[:6] and "below" in below["reason"]


def test_compact_model_failure_returns_messages_untouched(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = cs.Config(root=tmp_path, tokenizer="tiktoken", timeout=5, base_url="http://127.0.0.1:9/v1",
                       api_key="sk-do-not-leak")  # fmt: skip
    server = cs.build_server(config)
    messages = conversation(5, size=100)
    with caplog.at_level(logging.DEBUG):
        result = ok(
            run(
                call(
                    server,
                    "compact_context",
                    {
                        "messages": messages,
                        "max_context_tokens": 2000,
                        "model": "m",
                        "max_summary_tokens": 256,
                        "output_path": "never.json",
                    },
                )
            )
        )
    assert result["compacted"] is False and result["mode"] == "model"
    assert "backend unreachable: http://127.0.0.1:9/v1/chat/completions" in result["reason"]
    assert (tmp_path / "never.json").exists()  # the untouched history is still delivered where asked
    assert json.loads((tmp_path / "never.json").read_text()) == messages
    assert "sk-do-not-leak" not in json.dumps(result) and "sk-do-not-leak" not in caplog.text


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("estimate_context", {}, "give exactly one of messages or messages_path"),
        ("estimate_context", {"messages": [], "messages_path": "x.json"}, "give exactly one"),
        ("estimate_context", {"messages": "hello"}, "valid list"),
        ("estimate_context", {"messages": [{"content": "x"}]}, "messages[0].role is missing"),
        ("trim_context", {"messages": [user("a"), {"role": "bot", "content": "x"}]}, "messages[1].role 'bot'"),
        ("trim_context", {"messages": [user("a")], "keep_last": -1}, "keep_last"),
        ("trim_context", {"messages": [user("a")], "max_context_tokens": 0}, "max_context_tokens"),
        ("trim_context", {"messages": [user("a")], "max_context_tokens": 10**9}, "max_context_tokens"),
        ("trim_context", {"messages_path": "../etc/passwd"}, "outside the allowed root"),
        ("trim_context", {"messages_path": "missing.json"}, "does not exist"),
        ("compact_context", {"messages": [user("a")], "threshold": 2}, "threshold"),
        ("compact_context", {"messages": [user("a")], "summary_role": "system"}, "unknown argument `summary_role`"),
        ("estimate_context", {"messages": [user("a")], "max_context_tokns": 5}, "did you mean `max_context_tokens`?"),
        ("trim_context", {"messages": [user("a")], "target_raito": 0.6}, "did you mean `target_ratio`?"),
        ("compact_context", {"messages": [user("a")], "base_url": "http://attacker/v1"}, "unknown argument"),
        ("compact_context", {"messages": [tool("x", "y"), 3]}, "`messages[1]` should be a valid dictionary; got 3"),
    ],
)
def test_bad_input_is_a_readable_tool_error(server: Any, name: str, arguments: dict[str, Any], expected: str) -> None:
    assert expected in error(run(call(server, name, arguments)))


def test_errors_write_nothing_and_the_server_keeps_running(server: Any, tmp_path: Path) -> None:
    async def session() -> tuple[Any, Any]:
        async with Client(server) as client:
            bad = await client.call_tool(
                "trim_context", {"messages": [user("a"), {"role": "user", "content": 7}], "output_path": "o.json"}
            )
            good = await client.call_tool("estimate_context", {"messages": [user("a"), assistant("b")]})
            return bad, good

    bad, good = run(session())
    assert "messages[1].content" in error(bad)
    assert not (tmp_path / "o.json").exists()
    assert ok(good)["message_count"] == 2


def test_malformed_file_is_reported(server: Any, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"role": "user", "content": "a"}\n{"role": \n')
    assert "line 2" in error(run(call(server, "estimate_context", {"messages_path": "bad.jsonl"})))


def listed(config: cs.Config) -> list[Any]:
    async def listing() -> Any:
        async with Client(cs.build_server(config)) as client:
            return (await client.list_tools()).tools

    return run(listing())


def test_tools_subset_from_the_environment(tmp_path: Path) -> None:
    config = cs.Config.from_env({"CONTEXT_SHRINK_TOOLS": "core, shrink_text, core"})
    assert config.tools == (*cs.CORE_TOOLS, "shrink_text")
    with pytest.raises(cs.ConfigError, match="bogus"):
        cs.Config.from_env({"CONTEXT_SHRINK_TOOLS": "core, shrink_text, bogus"})
    names = [t.name for t in listed(dataclasses.replace(config, root=tmp_path))]
    assert names == ["estimate_context", "trim_context", "compact_context", "shrink_text"]


def test_tools_list_is_small(tmp_path: Path) -> None:
    tok = cs.resolve_tokenizer("tiktoken:cl100k_base")

    def size(tools: list[Any]) -> int:
        dumped = [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in tools]
        return tok.count(json.dumps({"tools": dumped}, separators=(",", ":")))

    everything = listed(cs.Config(root=tmp_path))
    core = listed(cs.Config(root=tmp_path, tools=cs.CORE_TOOLS))
    assert size(core) <= 600  # the documented figures are lower; this catches schema bloat
    assert size(everything) <= 1200  # all nine tools, as the model pays for them on every turn
    schema = json.dumps([t.input_schema for t in everything])
    assert '"title"' not in schema and '{"type": "null"}' not in schema


def test_compact_schema() -> None:
    schema = {
        "title": "X",
        "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "A"},
            "b": {"anyOf": [{"type": "integer"}, {"const": "auto", "type": "string"}], "default": 5},
            "c": {"items": {"additionalProperties": True, "type": "object"}, "type": "array"},
            "d": {"type": "boolean", "default": False},
            "e": {"type": "integer", "default": 0, "minimum": 0, "maximum": 9},
            "f": {"type": "number", "default": 0.5, "exclusiveMinimum": 0},
            "g": {"type": "boolean", "default": True},
            "h": {"type": "string", "enum": ["x", "y"], "default": "x"},
            "i": {"type": "array", "items": {"type": "string"}},
        },
    }
    assert cs.compact_schema(schema) == {
        "properties": {
            "a": {"type": "string"},
            "b": {"anyOf": [{"type": "integer"}, {"const": "auto"}], "default": 5},
            "c": {"type": "array"},
            "d": {"type": "boolean"},  # false, 0 and null go without saying; True and 0.5 stay
            "e": {"type": "integer"},
            "f": {"type": "number", "default": 0.5},
            "g": {"type": "boolean", "default": True},
            "h": {"enum": ["x", "y"], "default": "x"},
            "i": {"type": "array"},
        }
    }
