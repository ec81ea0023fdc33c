"""Opt-in tests against a live backend (oMLX, Ollama, LM Studio, vLLM, a cloud API).

    CONTEXT_SHRINK_LIVE=1 CONTEXT_SHRINK_LIVE_BASE_URL=http://127.0.0.1:11434/v1 \\
    CONTEXT_SHRINK_LIVE_MODEL=qwen3:4b [CONTEXT_SHRINK_LIVE_API_KEY=...] ./test/test.sh --only live
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from builders import conversation
from mcp_calls import call, ok, run

import context_shrink as cs

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("CONTEXT_SHRINK_LIVE") != "1", reason="set CONTEXT_SHRINK_LIVE=1 to run"),
]


def test_live_backend_writes_a_summary(tmp_path: Path) -> None:
    base_url = os.environ.get("CONTEXT_SHRINK_LIVE_BASE_URL", cs.DEFAULT_BASE_URL)
    model = os.environ.get("CONTEXT_SHRINK_LIVE_MODEL")
    if not model:
        pytest.skip("set CONTEXT_SHRINK_LIVE_MODEL")
    server = cs.build_server(cs.Config(root=tmp_path, base_url=base_url, model=model, timeout=300))
    arguments = {
        "messages": conversation(6, size=200),
        "max_context_tokens": 4096,
        "max_summary_tokens": 256,
        "api_key": os.environ.get("CONTEXT_SHRINK_LIVE_API_KEY"),
    }
    result = ok(run(call(server, "compact_context", arguments)))
    assert result["compacted"], result["reason"]
    assert result["fits"] and cs.api_problems(result["messages"]) == []
