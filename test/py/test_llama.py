"""Model mode against a real llama.cpp server (xllamacpp wheel, tiny generated model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from builders import conversation
from conftest import LOCAL_SESSIONS
from mcp_calls import call, ok, run

import context_shrink as cs

pytestmark = pytest.mark.llama


@pytest.fixture(autouse=True)
def gibberish_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny random model writes gibberish until max_tokens, which the degenerate-output guard rightly
    refuses; these tests are about the wire (chunking, refusals, counting), so the guard stands aside.
    The guard itself is tested in test_fidelity.py."""

    def accept(text: str, source: str, limit: int, count: Any, keep: str = "") -> tuple[str, list[str], bool]:
        return cs.clean_summary(text), [], True

    monkeypatch.setattr(cs, "guard_summary", accept)


def session() -> list[dict[str, Any]]:
    path = LOCAL_SESSIONS / "swe-agent_function-calling_marshmallow-1867.json"
    return json.loads(path.read_text())["messages"]


def test_server_is_real_llama_cpp(llama_url: str) -> None:
    props = httpx2.get(llama_url.removesuffix("/v1") + "/props", timeout=10).json()
    assert props["default_generation_settings"]["n_ctx"] == 8192
    models = httpx2.get(llama_url + "/models", timeout=10).json()
    assert models["data"][0]["owned_by"] == "llamacpp"


def test_model_mode_compacts_in_chunks(llama_url: str, tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="tiny", base_url=llama_url))
    messages = session()
    result = ok(
        run(
            call(
                server,
                "compact_context",
                {"messages": messages, "max_context_tokens": 2048, "max_summary_tokens": 96, "force": True},
            )
        )
    )
    assert result["mode"] == "model" and result["compacted"], result["reason"]
    assert result["model_calls"] > 1  # 8k tokens of history through a 2k window: several chunks
    assert result["summariser"] == f"model tiny @ {llama_url}"
    out = result["messages"]
    assert out[0] == messages[0] and out[1]["content"].startswith(cs.SUMMARY_MARKER)
    assert out[2] == messages[1]  # the task (newest user message) is pinned after the summary
    assert out[3:] == messages[result["kept_from_index"] :]
    assert cs.api_problems(out) == []
    assert result["tokens_after"] < result["tokens_before"]


def test_overflow_refusal_is_learned_and_retried(
    llama_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def cannot_count(self: cs.Backend, *args: object, **kwargs: object) -> tuple[int, str]:
        raise cs.BackendError("no counting endpoint", url=self.base_url, status=404)

    monkeypatch.setattr(cs.Backend, "count_tokens", cannot_count)
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="tiny", base_url=llama_url))
    messages = session()
    # Claim a summariser window far larger than the server's, on a server that cannot count: the first
    # chunk is refused for length, the refusal is parsed (prompt tokens vs window), and the summary is
    # retried with chunks re-split at the learnt ratio and window.
    arguments = {"messages": messages, "max_summary_tokens": 96, "force": True, "summary_context_tokens": 60000}
    result = ok(run(call(server, "compact_context", arguments)))
    assert result["compacted"], result["reason"]
    assert result["summary_refusals"] == 1
    assert result["summary_window_tokens"] == 8192
    refused = [w for w in result["warnings"] if "refused a request for its length" in w]
    assert refused and "exceeds the available context size (8192 tokens)" in refused[0]


def test_dead_summariser_returns_messages_untouched(tmp_path: Path) -> None:
    config = cs.Config(root=tmp_path, tokenizer="tiktoken", model="tiny", timeout=5, base_url="http://127.0.0.1:9/v1")
    server = cs.build_server(config)
    messages = session()
    arguments = {"messages": messages, "force": True, "output_path": "o.json"}
    result = ok(run(call(server, "compact_context", arguments)))
    assert result["compacted"] is False and "backend unreachable" in result["reason"]
    assert json.loads((tmp_path / "o.json").read_text()) == messages


def test_server_exact_count_equals_usage(llama_url: str, tmp_path: Path) -> None:
    messages = session()[:6]
    usage = httpx2.post(
        llama_url + "/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60
    ).json()["usage"]["prompt_tokens"]
    server = cs.build_server(cs.Config(root=tmp_path, base_url=llama_url, base_url_configured=True))
    result = ok(run(call(server, "estimate_context", {"messages": messages, "max_context_tokens": "auto"})))
    assert result["tokens"] == usage
    assert result["tokenizer"] == "server:llama.cpp /v1/chat/completions/input_tokens"
    assert (result["max_context_tokens"], result["max_context_source"]) == (8192, "llama.cpp /props")
    counted_here = cs.build_server(cs.Config(root=tmp_path, base_url=llama_url, tokenizer="tiktoken"))
    local = ok(run(call(counted_here, "estimate_context", {"messages": messages})))
    assert local["tokenizer"] == "tiktoken:cl100k_base" and local["tokens"] < usage  # the tiny vocabulary is small


def test_trim_with_the_server_count_really_fits(llama_url: str, tmp_path: Path) -> None:
    messages = conversation(12, size=60)
    server = cs.build_server(cs.Config(root=tmp_path, base_url=llama_url, tokenizer="server"))
    result = ok(run(call(server, "trim_context", {"messages": messages, "max_context_tokens": 3000, "keep_last": 2})))
    out = result["messages"]
    prompt = httpx2.post(llama_url + "/chat/completions", json={"messages": out, "max_tokens": 1}, timeout=60).json()
    assert result["tokens_after"] == prompt["usage"]["prompt_tokens"] <= 3000
    assert result["fits"] and result["dropped"] > 0
    assert result["tokens_before"] > 3000
