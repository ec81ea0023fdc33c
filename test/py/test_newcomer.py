"""A newcomer's first hour (#60): what a person meets in a terminal, the README and the docs, as met."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from agent_requests import chat_request
from builders import chat_history
from conftest import ROOT
from fake_openai import FakeOpenAI, serve
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from proxy_helpers import proxy, started
from starlette.responses import JSONResponse
from starlette.routing import Route
from tiny_llama import free_port

import context_shrink as cs
import context_shrink_proxy as csp

MODULE = str(ROOT / "context_shrink.py")
ENV = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "heuristic"}


def wait_for(predicate: object, seconds: float = 30) -> None:
    """Poll ``predicate`` (a callable) until it is true; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stdio_server_started_at_a_terminal_says_what_it_is_and_quits_on_ctrl_c(tmp_path: Path) -> None:
    """Started by a person (stdin a terminal), the MCP server says it waits for an MCP client and how to quit; the
    start line names no ``model None``; Ctrl-C ends it at once with 130, Ctrl-D with 0."""
    err = tmp_path / "err"
    primary, secondary = pty.openpty()
    with err.open("wb") as sink:
        process = subprocess.Popen([sys.executable, MODULE], stdin=secondary, stdout=secondary, stderr=sink, env=ENV)
    wait_for(lambda: "Ctrl-C or Ctrl-D quits" in err.read_text())
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 130
    text = err.read_text()
    assert "waiting for an MCP client" in text and "Traceback" not in text
    assert "model None" not in text and "CONTEXT_SHRINK_MODEL unset" in text
    os.close(primary)
    os.close(secondary)

    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, MODULE], stdin=secondary, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV
    )
    time.sleep(1)
    os.write(primary, b"\x04")  # Ctrl-D: end of input
    assert process.wait(timeout=20) == 0
    os.close(primary)
    os.close(secondary)


def test_stdio_server_started_by_a_client_prints_no_notice() -> None:
    """From an MCP client (stdin a pipe) nothing is added to stderr but the start line."""
    run = subprocess.run([sys.executable, MODULE], input="", capture_output=True, text=True, env=ENV, timeout=60)
    assert run.returncode == 0 and "waiting for an MCP client" not in run.stderr


def test_ctrl_c_on_proxy_and_serve_is_one_line_not_tracebacks(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) on ``proxy`` or ``serve`` ends it with one line and exit 130; no traceback."""
    for arguments in (["proxy", "--upstream", "http://127.0.0.1:9/v1"], ["serve"]):
        port = free_port()
        err = tmp_path / f"{arguments[0]}.err"
        with err.open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, MODULE, *arguments, "--port", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=sink,
                env=ENV,
            )

        def listening(port: int = port) -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
            return False

        wait_for(listening)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 130
        text = err.read_text()
        assert "Traceback" not in text, text
        assert f"context-shrink {arguments[0]}: stopped (Ctrl-C)" in text


def test_proxy_start_line_says_the_window_the_page_and_how_to_quit(tmp_path: Path) -> None:
    """The start line names the window the proxy enforces (``--window``), the live page's address and Ctrl-C; a model
    list that names no window is given the enforced one (``context_length``), so an agent that reads it sees it."""
    log = tmp_path / "log"
    with serve(FakeOpenAI(window=8000)) as upstream, proxy(upstream, "--window", "8000", log=log) as url:
        models = httpx2.get(url + "/models", timeout=30)
    base = url.removesuffix("/v1")
    start = next(line for line in log.read_text().splitlines() if "context-shrink proxy" in line)
    assert "window: 8000 tokens (--window)" in start, start
    assert f"live page {base}/context-shrink/" in start and "Ctrl-C quits" in start
    assert models.status_code == 404  # the fake lists no models: nothing to add to


class Unlisted(FakeOpenAI):
    """An upstream whose model list names no window (as many OpenAI-compatible servers' do)."""

    def __init__(self) -> None:
        super().__init__(window=100_000)
        listing = {"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "n", "max_model_len": 90_000}]}
        self.app.router.routes.insert(0, Route("/v1/models", lambda _: JSONResponse(listing), methods=["GET"]))


def test_a_discovered_window_is_said_once(tmp_path: Path) -> None:
    """The window asked of the upstream for a model is logged once (the start line says it will be asked)."""
    log = tmp_path / "log"
    with serve(Unlisted()) as upstream, proxy(upstream, log=log) as url:
        for model in ("n", "n", "n"):
            body = {**chat_request(2, 20), "model": model}
            assert httpx2.post(url + "/chat/completions", json=body, timeout=60).status_code == 200
    text = log.read_text()
    assert "window: the upstream's, asked per model" in text
    assert text.count("enforcing the window of n, 90000 tokens (the upstream's /v1/models") == 1, text


def test_model_list_without_a_window_gets_the_enforced_one(tmp_path: Path) -> None:
    with serve(Unlisted()) as upstream, proxy(upstream, "--window", "8000", log=tmp_path / "log") as url:
        reply = httpx2.get(url + "/models", timeout=30)
    first, second = reply.json()["data"]
    assert first == {"id": "m", "object": "model", "context_length": 8000}
    assert second == {"id": "n", "max_model_len": 8000}  # named one: lowered, nothing added
    assert "window the proxy enforces in 2 field(s)" in reply.headers["x-context-shrink"]


def test_unknown_window_is_said_once_with_the_fix_and_unread_bodies_are_logged(tmp_path: Path) -> None:
    """With an upstream that reports no window, the log says so once for the model (not at every request), naming
    ``--window N``; a chat body the proxy cannot read is forwarded unchanged, and the log says why."""
    log = tmp_path / "log"
    with serve(FakeOpenAI()) as upstream, proxy(upstream, log=log) as url:
        for _ in range(3):
            assert httpx2.post(url + "/chat/completions", json=chat_request(2, 20), timeout=60).status_code == 200
        raw = httpx2.post(url + "/chat/completions", content=b"{not json", timeout=60)
        wrong = httpx2.post(url + "/chat/completions", json={"model": "m", "messages": "hello"}, timeout=60)
    text = log.read_text()
    assert text.count("window unknown for m ") == 1, text
    assert text.count("no context window found") == 1, text
    assert "start the proxy with --window N" in text and "-c/--ctx-size" in text
    assert "not shrunk: the body is not JSON" in raw.headers["x-context-shrink"]
    assert "not shrunk: the body holds no list of messages" in wrong.headers["x-context-shrink"]
    assert "POST /v1/chat/completions forwarded unchanged, not shrunk: the body is not JSON" in text
    assert "forwarded unchanged, not shrunk: the body holds no list of messages" in text


def proxy_settings(command: str, flags: list[str], environ: dict[str, str]) -> csp.ProxyConfig:
    args = csp.command_parser(command).parse_args(["--upstream", "http://127.0.0.1:9/v1", *flags])
    return csp.proxy_config(args, environ) if command == "proxy" else csp.serve_config(args, environ).proxy


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_archive_takes_on_or_off_and_the_key_has_a_flag(command: str) -> None:
    """``--archive on|off`` as ``--recall``/``--lean-tools`` take (``--no-archive`` still means off), and
    ``--api-key`` beside ``CONTEXT_SHRINK_PROXY_API_KEY``; a wrong value names the flag."""
    assert proxy_settings(command, [], {}).archive_dir is not None
    assert proxy_settings(command, ["--archive", "off"], {}).archive_dir is None
    assert proxy_settings(command, ["--archive", "ON"], {}).archive_dir is not None
    assert proxy_settings(command, ["--no-archive"], {}).archive_dir is None
    assert proxy_settings(command, [], {"CONTEXT_SHRINK_PROXY_ARCHIVE": "off"}).archive_dir is None
    with pytest.raises(cs.ConfigError, match="--archive='maybe'") as raised:
        proxy_settings(command, ["--archive", "maybe"], {})
    assert raised.value.variable == "--archive"
    keyed = proxy_settings(command, ["--api-key", "sk-newcomer-1234567890"], {})
    assert keyed.api_key == "sk-newcomer-1234567890" and "sk-newcomer" not in repr(keyed)
    helptext = csp.command_parser(command).format_help()
    assert "-c/--ctx-size" in helptext and "--api-key" in helptext


def test_doctor_prescribes_only_flags_that_exist() -> None:
    """Every ``--flag`` a doctor fix names is one of the proxy's (it prescribed ``--reserve``, which is not)."""
    report = {"reachable": True, "upstream": "http://x/v1", "window": None, "counting": None,
              "tokens_per_local_token": 2.0, "apis": {"chat completions": "not served"}}  # fmt: skip
    fixes = " ".join(csp.doctor_fixes(report))
    named = set(re.findall(r"--[a-z][a-z-]+", fixes))
    flags = {f for action in csp.command_parser("proxy")._actions for f in action.option_strings}
    assert named and named <= flags, named - flags


def test_the_proxys_root_says_where_the_page_is(tmp_path: Path) -> None:
    """``GET /`` on the proxy, where the server has nothing, says where the live page and the API are."""
    with serve(FakeOpenAI()) as upstream, proxy(upstream, log=tmp_path / "log") as url:
        root = httpx2.get(url.removesuffix("/v1") + "/", timeout=30)
        page = httpx2.get(url.removesuffix("/v1") + "/context-shrink/", timeout=30)
    assert root.status_code == 404 and "/context-shrink/" in root.text and "/v1" in root.text
    assert page.status_code == 200


def recall_over_stdio(environ: dict[str, str], query: str) -> dict[str, Any]:
    """``recall_context`` the way an MCP client calls it: a stdio server started with ``environ`` added."""
    params = StdioServerParameters(command=sys.executable, args=[MODULE], env={**ENV, **environ})

    async def recall() -> Any:
        async with Client(params) as client:
            return await client.call_tool("recall_context", {"query": query})

    result = anyio.run(recall)
    assert not result.is_error, result.content[0].text
    return result.structured_content


def test_recall_finds_the_proxys_archive_without_knowing_its_namespace(tmp_path: Path) -> None:
    """#60 item 6: the proxy archives under its upstream's namespace; an MCP server started on stdio with nothing
    set but the store (the default's, here a test file) finds what it archived, and says where it looked. Named
    another namespace, or served over HTTP, it searches its own alone and lists the others."""
    state = f"sqlite:{tmp_path / 'state.sqlite3'}"
    history = chat_history(30, size=300)[:25]
    with serve(FakeOpenAI(window=6000)) as upstream, proxy(upstream, "--window", "6000", "--state", state,
                                                           log=tmp_path / "log") as url:  # fmt: skip
        body = {"model": "m", "messages": history, "max_tokens": 200}
        assert "action=compact" in httpx2.post(f"{url}/chat/completions", json=body, timeout=120).headers[
            "x-context-shrink"]  # fmt: skip
    theirs = cs.upstream_namespace(upstream)
    found = recall_over_stdio({"CONTEXT_SHRINK_STATE": state}, "file_0.py")
    assert found["found"] >= 1 and found["entries"][0]["message"] == history[1], found
    assert found["entries"][0]["namespace"] == theirs and found["namespaces"] == [theirs]
    assert theirs in found["note"] and "CONTEXT_SHRINK_NAMESPACE" in found["note"]

    named = recall_over_stdio({"CONTEXT_SHRINK_STATE": state, "CONTEXT_SHRINK_NAMESPACE": "mine"}, "file_0.py")
    assert named["found"] == 0 and named["namespaces"] == ["mine"] and theirs in named["note"]

    log = tmp_path / "serve.log"
    with started("serve", log=log, env={"CONTEXT_SHRINK_STATE": state}) as base:

        async def over_http() -> Any:
            async with Client(streamable_http_client(base + "/mcp")) as client:
                return await client.call_tool("recall_context", {"query": "file_0.py"})

        served = anyio.run(over_http).structured_content
    assert served["found"] == 0 and served["entries"] == [] and theirs in served["note"]  # listed, not searched


def cli(*arguments: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, MODULE, *arguments], input=stdin, capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=60, check=False)  # fmt: skip


def test_the_command_line_says_what_was_meant(tmp_path: Path) -> None:
    """#60 item 9: a file as the text commands' argument; a missing file said to be missing, one outside the root
    pointed at ``--root``; a subcommand's flag before any subcommand names the commands that take it; a misspelt
    flag or command gets the closest; ``--on-overflow`` has help."""
    (tmp_path / "log.txt").write_text("one line\nanother\n")
    counted = cli("count", "log.txt", cwd=tmp_path)
    assert (counted.returncode == 0 and "2 lines" in counted.stdout) or "3 lines" in counted.stdout, counted
    assert cli("count", "--input", "log.txt", cwd=tmp_path).stdout == counted.stdout
    assert "1 lines, 15 bytes" in cli("count", cwd=tmp_path, stdin="some words here").stdout  # no file: stdin
    twice = cli("count", "log.txt", "--input", "other.txt", cwd=tmp_path)
    assert twice.returncode == 2 and "give the text file once" in twice.stderr
    missing = cli("count", "nope.txt", cwd=tmp_path)
    assert missing.returncode == 2 and "'nope.txt' does not exist" in missing.stderr
    elsewhere = cli("count", str(ROOT / "README.md"), cwd=tmp_path)
    assert elsewhere.returncode == 2 and "outside the allowed root" in elsewhere.stderr
    assert "--root DIR" in elsewhere.stderr
    assert cli("count", str(ROOT / "README.md"), "--root", str(ROOT), cwd=tmp_path).returncode == 0

    port = cli("--port", "9000", cwd=tmp_path)
    assert port.returncode == 2 and "--port is not a flag of the MCP server" in port.stderr
    assert "proxy, serve" in port.stderr and "'9000'" not in port.stderr
    assert "did you mean --upstream?" in cli("proxy", "--upstrem", "http://x/v1", cwd=tmp_path).stderr
    assert "did you mean --json?" in cli("count", "--jsn", cwd=tmp_path).stderr
    assert "did you mean serve?" in cli("serv", cwd=tmp_path).stderr
    assert "did you mean serve?" in cli("--log-level", "debug", "serv", cwd=tmp_path).stderr
    assert "protected lines alone are over --budget" in cli("pack", "--help", cwd=tmp_path).stdout.replace("\n   ", "")


def test_check_reads_pytests_failed_and_error_lines(tmp_path: Path) -> None:
    """``check``'s default fail markers are unittest's and pytest's words (FAILED and ERROR were read as missing)."""
    report = "test_a.py::test_one PASSED\nFAILED test_a.py::test_two - assert 1 == 2\nERROR test_a.py::test_three\n"
    plan = tmp_path / "plan.txt"
    plan.write_text("test_one\ntest_two\ntest_three\n")
    (tmp_path / "report.txt").write_text(report)
    run = cli("check", "report.txt", "--plan", "plan.txt", "--markers", "PASSED", "--json", cwd=tmp_path)
    statuses = {i["item"]: i["status"] for i in json.loads(run.stdout)["items"]}
    assert statuses == {"test_one": "passed", "test_two": "failed", "test_three": "failed"} and run.returncode == 1
    assert cs.check_text(report, ["test_two"], markers=["PASSED"])["items"][0]["status"] == "failed"


WRONG_TYPES = [  # (arguments, what the error must say): a wrong type named in one line, as a misspelt name is
    ({"messages": "hello"}, "`messages` should be a valid list; got 'hello' (str)"),
    ({"messages": [{"role": "user", "content": "x"}], "keep_last": "lots"}, "`keep_last` should be a valid integer"),
    ({"messages": [{"role": "user", "content": "x"}], "max_context_tokens": 1.5}, "or should be 'auto'; got 1.5"),
]


def test_a_wrong_type_is_one_line_naming_the_argument_over_stdio_and_http(tmp_path: Path) -> None:
    """#60 item 9: the SDK's six-line pydantic dump with URLs, over stdio and over HTTP, is a line naming the
    argument, what it should be and what it got."""

    async def calls(client: Client) -> list[str]:
        texts = []
        async with client:
            for arguments, _ in WRONG_TYPES:
                result = await client.call_tool("trim_context", arguments)
                assert result.is_error
                texts.append(result.content[0].text)
        return texts

    stdio = anyio.run(calls, Client(StdioServerParameters(command=sys.executable, args=[MODULE], env=ENV)))
    with started("serve", log=tmp_path / "serve.log") as base:
        http = anyio.run(calls, Client(streamable_http_client(base + "/mcp")))
    for texts in (stdio, http):
        for text, (_, said) in zip(texts, WRONG_TYPES, strict=True):
            assert said in text and "pydantic" not in text and "\n" not in text, text


def test_a_tokenizer_that_names_nothing_stops_the_server_at_start(tmp_path: Path) -> None:
    """README: an unknown name stops the server at start-up; ``tiktoken:bogus_base`` and a missing ``hf:`` file
    started and fell back at the first call with a multi-line warning."""
    for spec, said in (("tiktoken:bogus_base", "tiktoken has no encoding 'bogus_base'"),
                       ("hf:/nope/tokenizer.json", "no tokenizer file at '/nope/tokenizer.json'")):  # fmt: skip
        run = subprocess.run([sys.executable, MODULE], input="", capture_output=True, text=True, timeout=60,
                             env={**ENV, "CONTEXT_SHRINK_TOKENIZER": spec}, check=False)  # fmt: skip
        assert run.returncode == 2 and said in run.stderr and run.stderr.count("\n") == 1, run.stderr
    with pytest.raises(cs.ConfigError, match="CONTEXT_SHRINK_TOKENIZER"):
        cs.Config.from_env({"CONTEXT_SHRINK_TOKENIZER": "tiktoken:o300k_base"})
    assert cs.Config.from_env({"CONTEXT_SHRINK_TOKENIZER": "tiktoken:o200k_base"}).tokenizer == "tiktoken:o200k_base"
