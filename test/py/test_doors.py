"""The doors are one contract: every core option reaches every door that offers it (an MCP tool argument of the
same name, a proxy flag and variable), or is listed in ``DOOR_OPTIONS``'s omissions with its reason; an argument
a tool does not take is an error naming it over stdio and over HTTP; and stable trimming through the MCP door
saves what it saves in-process."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from agent_shapes import agent_history
from conftest import LOCAL_SESSIONS, ROOT, load_session, session_files
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from prefill import excess_ratio, mcp_door, trim_in_process, trim_through
from proxy_helpers import started

import context_shrink as cs
import context_shrink_proxy as csp

MCP_DOORS = [door for door in cs.DOOR_OPTIONS if door != "proxy"]


def schemas() -> dict[str, dict[str, Any]]:
    async def listing() -> Any:
        async with Client(cs.build_server(cs.Config(root=Path.cwd()))) as client:
            return (await client.list_tools()).tools

    return {t.name: t.input_schema for t in anyio.run(listing)}


def offered(door: str) -> list[tuple[type, dataclasses.Field[Any]]]:
    """The core options ``door`` takes: every field of its option classes but the written omissions."""
    fields = [(kind, f) for kind in cs.DOOR_OPTIONS[door] for f in dataclasses.fields(kind)]
    return [(kind, f) for kind, f in fields if (door, f.name) not in cs.DOOR_OMISSIONS]


def other_value(field: dataclasses.Field[Any], schema: dict[str, Any] | None = None) -> Any:
    """A valid value of ``field`` other than its default (what a caller changes)."""
    default = field.default
    if schema and "enum" in schema:
        return next(v for v in schema["enum"] if v != default)
    if field.name == "rungs":
        return ("trim",)
    if field.name == "remove_ids":
        return ["abcdef12"]
    if field.name == "previous_summary":
        return "- the earlier summary"
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return 0.7 if default != 0.7 else 0.65
    if isinstance(default, int):
        return default + 1
    if default is None:  # an optional count
        return 1
    raise AssertionError(f"no test value for {field.name}")


def test_every_core_option_is_a_door_option_or_a_written_omission() -> None:
    """Fails when a core option has no tool argument (and no reason in DOOR_OMISSIONS), or when a reason names
    an option that is not there (a stale entry): the contract is one fact, checked both ways."""
    tools = schemas()
    missing = [
        (door, f.name) for door in MCP_DOORS for _, f in offered(door) if f.name not in tools[door]["properties"]
    ]
    assert missing == [], f"core options no MCP tool takes, and no reason in DOOR_OMISSIONS: {missing}"
    known = {
        (door, f.name) for door in cs.DOOR_OPTIONS for kind in cs.DOOR_OPTIONS[door] for f in dataclasses.fields(kind)
    }
    assert set(cs.DOOR_OMISSIONS) <= known, set(cs.DOOR_OMISSIONS) - known
    assert all(len(why) > 20 for why in cs.DOOR_OMISSIONS.values())


@pytest.mark.parametrize("door", MCP_DOORS)
def test_every_tool_argument_reaches_the_core(door: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each option, given a value other than its default through the MCP tool, is what the core is given."""
    seen: list[Any] = []
    for kind in cs.DOOR_OPTIONS[door]:

        def record(self: Any, _kind: type = kind) -> None:
            _kind.__post_init__(self)
            seen.append(self)

        monkeypatch.setattr(cs, kind.__name__, type(kind.__name__, (kind,), {"__post_init__": record}))
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="heuristic"))
    properties = schemas()[door]["properties"]
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    for kind, field in offered(door):
        value = other_value(field, properties[field.name])
        seen.clear()

        async def call(name: str = field.name, value: Any = value) -> Any:
            async with Client(server) as client:
                return await client.call_tool(door, {"messages": messages, name: value})

        result = anyio.run(call)
        given = [getattr(o, field.name) for o in seen if isinstance(o, kind)]
        expected = list(value) if isinstance(value, list) else value
        assert any((list(g) if isinstance(g, tuple | list) else g) == expected for g in given), (
            door, field.name, value, given, result.content[0].text if result.is_error else "",
        )  # fmt: skip


def proxy_settings(command: str, flags: list[str], environ: dict[str, str]) -> csp.ProxyConfig:
    args = csp.command_parser(command).parse_args(["--upstream", "http://127.0.0.1:9/v1", *flags])
    return csp.proxy_config(args, environ) if command == "proxy" else csp.serve_config(args, environ).proxy


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_every_proxy_option_is_a_flag_and_a_variable(command: str) -> None:
    """The proxy takes each of its core options as ``--name-with-dashes`` and as ``CONTEXT_SHRINK_PROXY_NAME``,
    in ``context-shrink proxy`` and in ``serve --upstream`` alike."""
    for kind, field in offered("proxy"):
        value = other_value(field)
        text = ",".join(value) if isinstance(value, tuple) else str(value)
        by_flag = proxy_settings(command, [f"--{field.name.replace('_', '-')}", text], {})
        by_variable = proxy_settings(command, [], {f"CONTEXT_SHRINK_PROXY_{field.name.upper()}": text})
        for settings in (by_flag, by_variable):
            options = settings.policy if kind is cs.Policy else settings.summary_options
            assert getattr(options, field.name) == value, (command, field.name)


def misspelt(name: str) -> str:
    return name[:-2] + name[-1] + name[-2]  # the last two letters swapped: max_context_tokens -> ...tokesn


def refuses_misspellings(target: Any) -> None:
    """Every tool of the server at ``target``, called with its first argument misspelt: a tool error that names
    the argument and the one meant."""
    tools = schemas()

    async def session() -> dict[str, Any]:
        async with Client(target) as client:
            return {
                t: await client.call_tool(t, {misspelt(next(iter(s["properties"]))): "x"}) for t, s in tools.items()
            }

    for tool, result in anyio.run(session).items():
        name = next(iter(tools[tool]["properties"]))
        assert result.is_error, tool
        assert f"unknown argument `{misspelt(name)}`; did you mean `{name}`?" in result.content[0].text, tool


def test_every_tool_refuses_a_misspelt_argument_over_stdio(tmp_path: Path) -> None:
    env = {**os.environ, "CONTEXT_SHRINK_ROOT": str(tmp_path)}
    refuses_misspellings(StdioServerParameters(command=sys.executable, args=[str(ROOT / "context_shrink.py")], env=env))


def test_every_tool_refuses_a_misspelt_argument_over_http(tmp_path: Path) -> None:
    token = "doors-token-0123456789abcdef"
    with started("serve", "--token", token, log=tmp_path / "log", env={"CONTEXT_SHRINK_ROOT": str(tmp_path)}) as base:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
        refuses_misspellings(streamable_http_client(base + "/mcp", http_client=http))


def histories(budget: int) -> dict[str, list[dict[str, Any]]]:
    """The transcripts in test/data that overflow ``budget``, and generated Codex-style and Claude-Code-style
    histories sized for it (seeds 2 and 3, which overflow at 16k and 32k)."""
    found = {p.stem: load_session(p) for p in session_files()}
    found.update({f"generated {shape} {seed}": agent_history(seed, budget, shape) for shape in ("codex", "claude")
                  for seed in (2, 3)})  # fmt: skip
    return {name: m for name, m in found.items() if cs.count_messages(m, cs.resolve_tokenizer("tiktoken"))[1] > budget}


@pytest.mark.parametrize("budget", [16384, 32768])
def test_stable_trimming_through_the_mcp_door_saves_what_it_saves_in_process(budget: int, tmp_path: Path) -> None:
    """Replayed turn by turn through ``trim_context`` over the SDK's client (the door users call), target_ratio
    0.6 prefills exactly what the engine called in-process prefills (the door lost nothing), and over the
    histories at most 0.3x a sliding window's excess over the floor (the median; none above 0.6: a history
    that overflows once pays one cut whatever the strategy)."""
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken"))
    found = histories(budget)
    assert all(any(name.startswith(f"generated {shape}") for name in found) for shape in ("codex", "claude")), found
    ratios = {}
    with mcp_door(server) as call:
        for name, messages in found.items():
            ratios[name] = excess_ratio(messages, budget, trim_through(call, 0.6))
            assert ratios[name] == excess_ratio(messages, budget, trim_in_process(0.6)), name
    assert statistics.median(ratios.values()) <= 0.3 and max(ratios.values()) <= 0.6, ratios


def test_local_sessions_are_here() -> None:
    assert LOCAL_SESSIONS.is_dir() and session_files()
