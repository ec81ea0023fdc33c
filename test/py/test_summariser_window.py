"""The summariser is never sent more than its window, whatever its tokenizer.

A real llama.cpp server (xllamacpp wheel) with the tiny generated model, whose tokenizer makes about 3.4
tokens per cl100k token, serves a 2,048-token window; a server-wide grammar makes every reply a short
summary sentence. A ~6,000-token (cl100k) history is compacted through it, by the MCP tool and by the proxy,
and the server's own log is searched for its length refusals: none when the server can count (/tokenize is
used first), at most one when it cannot (the ratio is learnt from the refusal's numbers).
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import LOCAL_SESSIONS, served_llama
from fake_openai import serve
from mcp_calls import call, ok, run

import context_shrink as cs
import context_shrink_proxy as csp

pytestmark = pytest.mark.llama

SENTENCE = "The user asked to fix the failing parser test; the assistant changed src/parser.py and the tests pass."
REFUSAL = "exceeds the available context size"


@pytest.fixture(scope="module")
def llama_2k(tiny_model: Path) -> Iterator[str]:
    with served_llama(tiny_model, n_ctx=2048, alias="tiny", threads=2, grammar=f'root ::= "{SENTENCE}"') as url:
        yield url


def history(tokens: int = 6000) -> list[dict[str, Any]]:
    """The first messages of a real SWE-agent session, about ``tokens`` cl100k tokens, then an answer and a new
    user turn (so the turn in progress is that message: the proxy never summarises the turn in progress)."""
    messages = json.loads((LOCAL_SESSIONS / "swe-agent_function-calling_marshmallow-1867.json").read_text())["messages"]
    tokenizer = cs.resolve_tokenizer("tiktoken:cl100k_base")
    counts = cs.count_messages(messages, tokenizer)[0]
    end = next(k for k in range(len(messages)) if sum(counts[:k]) >= tokens)
    while messages[end - 1]["role"] == "assistant" and messages[end - 1].get("tool_calls"):
        end += 1  # never end between a tool call and its results
    answer = {"role": "assistant", "content": "I changed src/parser.py; the parser tests pass."}
    return [*messages[:end], answer, {"role": "user", "content": "Go on: run the tests again."}]


def refusals(capfd: pytest.CaptureFixture[str]) -> int:
    """The server's length refusals in its log since the last look (llama.cpp logs to this process's stderr)."""
    return capfd.readouterr().err.count(REFUSAL)


def no_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    async def cannot(*_: Any, **__: Any) -> Any:
        raise cs.ContextShrinkError("counting disabled for this test")

    monkeypatch.setattr(cs.Backend, "count_tokens", cannot)


def test_the_history_is_three_windows_of_the_summariser(llama_2k: str) -> None:
    messages = history()
    local = cs.count_messages(messages, cs.resolve_tokenizer("tiktoken:cl100k_base"))[1]
    body = {"model": "tiny", "messages": messages, "max_tokens": 1}
    refused = httpx2.post(llama_2k + "/chat/completions", json=body, timeout=60).json()["error"]
    assert 5500 <= local <= 7000
    assert refused["n_ctx"] == 2048 and refused["n_prompt_tokens"] > 2.5 * local  # about nine windows


def compact_by_tool(url: str, tmp_path: Path) -> dict[str, Any]:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="tiny", base_url=url))
    arguments = {"messages": history(), "force": True, "max_context_tokens": 32768, "max_summary_tokens": 128}
    return ok(run(call(server, "compact_context", arguments)))


@pytest.mark.parametrize("counting", [True, False])
def test_the_tool_compacts_without_overflowing_the_summariser(
    llama_2k: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, counting: bool
) -> None:
    if not counting:
        no_counting(monkeypatch)
    refusals(capfd)
    result = compact_by_tool(llama_2k, tmp_path)
    seen = refusals(capfd)
    assert result["compacted"], result["reason"]
    assert result["map_chunks"] > 3 and result["summary_window_tokens"] == 2048
    assert 2.5 < result["summary_token_ratio"] < 5  # learnt: the tiny model's tokens per cl100k token
    assert seen == result["summary_refusals"] == (0 if counting else 1)
    assert SENTENCE in result["summary"] and cs.api_problems(result["messages"]) == []


@pytest.mark.parametrize("counting", [True, False])
def test_the_proxy_compacts_without_overflowing_the_summariser(
    llama_2k: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, counting: bool
) -> None:
    if not counting:
        no_counting(monkeypatch)
    settings = csp.ProxyConfig(upstream=llama_2k, archive_dir=None, state="memory")
    app = csp.build_proxy(settings, cs.resolve_tokenizer("tiktoken:cl100k_base"))
    refusals(capfd)
    with serve(types.SimpleNamespace(app=app)) as url:  # type: ignore[arg-type]
        body = {"model": "tiny", "messages": history(), "max_tokens": 16}
        reply = httpx2.post(url + "/chat/completions", json=body, timeout=300)
    seen = refusals(capfd)
    assert reply.status_code == 200, reply.text
    header = reply.headers["x-context-shrink"]
    assert "action=compact" in header, header
    # Without counting the first refusal teaches the tokens-per-token ratio on one chunk; the span is the
    # cleared history (placeholders dense with ids), so one denser chunk may be refused once more before
    # it is re-split at its own ratio. Never more, and the compaction succeeds.
    assert seen <= (0 if counting else 2), header
