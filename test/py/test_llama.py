"""Model mode against a real llama.cpp server (xllamacpp wheel, tiny generated model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from conftest import LOCAL_SESSIONS
from test_tools import call, ok, run

import context_shrink as cs

pytestmark = pytest.mark.llama


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
    assert result["summariser"] == f"tiny @ {llama_url}"
    out = result["messages"]
    assert out[0] == messages[0] and out[1]["content"].startswith(cs.SUMMARY_MARKER)
    assert out[2] == messages[1]  # the task (newest user message) is pinned after the summary
    assert out[3:] == messages[result["kept_from_index"] :]
    assert cs.api_problems(out) == []
    assert result["tokens_after"] < result["tokens_before"]


def test_overflow_refusal_returns_messages_untouched(llama_url: str, tmp_path: Path) -> None:
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="tiktoken", model="tiny", base_url=llama_url))
    messages = session()
    # Claim a window far larger than the server's: the first chunk is refused for length.
    result = ok(
        run(
            call(
                server,
                "compact_context",
                {"messages": messages, "max_context_tokens": 60000, "force": True, "output_path": "out.json"},
            )
        )
    )
    assert result["compacted"] is False
    assert "backend 400: request (" in result["reason"]
    assert "exceeds the available context size (8192 tokens)" in result["reason"]
    assert json.loads((tmp_path / "out.json").read_text()) == messages
