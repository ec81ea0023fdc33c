"""The proxy: pure helpers, then a real `context-shrink proxy` process in front of a scriptable fake upstream
(the wire cases a real model cannot be made to produce on demand). The same proxy in front of the real
llama.cpp server, driven by the official openai client, is in test_proxy_llama.py."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import string
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx2
import pytest
from agent_requests import chat_request, claude_request, codex_request, opencode_request
from builders import chat_history, conversation
from checks import anthropic_problems, responses_problems
from fake_openai import FakeOpenAI, serve
from mcp_calls import call, ok, run
from proxy_helpers import MODULE, proxy, started
from recalling import PREAMBLE, RecallingModel, SlowRecaller
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tiny_llama import free_port
from upstreams import SUMMARY, Recorder, proxied

import context_shrink as cs
import context_shrink_fit as csf
import context_shrink_proxy as csp
import context_shrink_state as cst
import context_shrink_wire as csw

SECRET = "sk-test-0123456789abcdef"


# --------------------------------------------------------------------------- pure helpers


def test_calibration_is_smoothed_and_bounded() -> None:
    assert csf.calibrated(None, 1000, 1200) == 1.2
    assert csf.calibrated(1.2, 1000, 1000) == 1.1
    assert csf.calibrated(None, 1000, 100_000) == csf.CALIBRATION_LIMITS[1]
    assert csf.calibrated(None, 0, 10) == csf.CALIBRATION_LIMITS[1]  # no division by zero


def test_silent_truncation_is_flagged() -> None:
    assert csp.silently_truncated(10_000, 4_000)
    assert not csp.silently_truncated(10_000, 9_000)
    assert not csp.silently_truncated(100, 10)  # tiny requests say nothing


def test_header_is_one_line_and_says_what_was_done() -> None:
    header = csp.shrink_header(
        {"tokens_before": 9, "tokens_after": 5, "action": "trim", "window": 8, "reason": "summary failed; x\ny"}
    )
    assert header.startswith("tokens_before=9; tokens_after=5; action=trim; window=8; reason=summary failed")
    assert "\n" not in header and header.count(";") == 4


def test_keep_last_gives_way_to_huge_newest_messages() -> None:
    """The proxy passes its keep_last on; the planner gives it up where the newest messages alone do not fit."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]
    for k in range(6):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}]
        messages += [{"role": "tool", "tool_call_id": f"c{k}", "content": "line\n" * 400}]
    result = cs.trim_messages(messages, cs.HEURISTIC, 1500, keep_last=8)
    assert result["fits"] and result["protected_from_index"] > len(messages) - 8


def test_conversation_id_is_stable_as_the_history_grows() -> None:
    history = conversation(6, size=5)
    assert cst.conversation_id(history[:8]) == cst.conversation_id(history)
    assert cst.conversation_id(history) != cst.conversation_id(conversation(6, size=6))


def test_folded_away_lists_what_the_request_lost() -> None:
    history = conversation(2, size=5)
    shrunk = [history[0], *history[5:]]
    assert [i for i, _ in cst.folded_away(history, shrunk)] == [1, 2, 3, 4]


def test_usage_is_read_from_the_stream_tail() -> None:
    tail = b'data: {"choices":[{"delta":{}}],"usage":null}\n\ndata: {"choices":[],"usage":{"prompt_tokens":42}}\n\n'
    assert csp.usage_in_stream(tail + b"data: [DONE]\n\n") == 42
    assert csp.usage_in_stream(b"data: [DONE]\n\n") is None


def args(**given: Any) -> argparse.Namespace:
    names = ("upstream", "host", "port", "window", "summary_url", "summary_model", "archive_dir", "max_body_bytes",
             "keep_last", "max_summary_tokens", "timeout", "state", "namespace")  # fmt: skip
    return argparse.Namespace(**{**dict.fromkeys(names), "no_archive": False, **given})


def test_proxy_config_flags_environment_and_errors(tmp_path: Path) -> None:
    env = {"CONTEXT_SHRINK_PROXY_UPSTREAM": "http://127.0.0.1:8080", "CONTEXT_SHRINK_PROXY_PORT": "9000",
           "CONTEXT_SHRINK_ARCHIVE_DIR": str(tmp_path), "CONTEXT_SHRINK_PROXY_API_KEY": SECRET}  # fmt: skip
    config = csp.proxy_config(args(), env)
    assert (config.base, config.port, config.host) == ("http://127.0.0.1:8080/v1", 9000, "127.0.0.1")
    assert config.window is None
    assert config.archive_dir == tmp_path and SECRET not in repr(config)
    assert config.target("/v1/chat/completions", "") == "http://127.0.0.1:8080/v1/chat/completions"
    assert config.target("/health", "a=1") == "http://127.0.0.1:8080/health?a=1"
    assert csp.proxy_config(args(port="8000", window="4096", no_archive=True), env).window == 4096
    assert csp.proxy_config(args(no_archive=True), env).archive_dir is None
    gateway = csp.proxy_config(args(upstream="https://example.com/api/v1"), {})
    assert gateway.target("/v1/models", "") == "https://example.com/api/v1/models"
    with pytest.raises(cs.ContextShrinkError, match="upstream"):
        csp.proxy_config(args(), {})
    with pytest.raises(cs.ContextShrinkError, match="upstream"):
        csp.proxy_config(args(upstream="ftp://x"), {})
    with pytest.raises(cs.ConfigError, match="port") as raised:
        csp.proxy_config(args(port="http"), env)
    assert raised.value.variable == "--port"
    with pytest.raises(cs.ConfigError, match="window"):
        csp.proxy_config(args(window="12"), env)
    bad = (("PORT", "70000"), ("KEEP_LAST", "-1"), ("TIMEOUT", "0"), ("MAX_SUMMARY_TOKENS", "x"), ("TRIGGER", "0"),
           ("TRIM_RATIO", "1.5"), ("RUNGS", "trim,shred"), ("RUNGS", ","), ("SUMMARY_CONCURRENCY", "99"))  # fmt: skip
    for name, value in bad:
        with pytest.raises(cs.ConfigError) as raised:
            csp.proxy_config(args(), {**env, f"CONTEXT_SHRINK_PROXY_{name}": value})
        assert raised.value.variable == f"CONTEXT_SHRINK_PROXY_{name}"
    tuned = csp.proxy_config(
        args(keep_last="2", timeout="30"), {**env, "CONTEXT_SHRINK_PROXY_MAX_SUMMARY_TOKENS": "300"}
    )
    assert tuned.timeout == 30.0 and tuned.policy.keep_last == 2 and tuned.policy.max_summary_tokens == 300
    assert csp.proxy_config(args(rungs="diet, trim"), env).policy.rungs == ("diet", "trim")


def test_cli_rejects_a_missing_upstream(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTEXT_SHRINK_PROXY_UPSTREAM", raising=False)
    assert cs.main(["proxy"]) == 2
    assert "--upstream" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real proxy, a fake upstream


def chat(url: str, body: dict[str, Any], **headers: str) -> httpx2.Response:
    return httpx2.post(url + "/chat/completions", json=body, headers=headers, timeout=60)


def summary_calls(fake: FakeOpenAI) -> int:
    prompts = (cs.SUMMARY_PROMPT, cs.MERGE_PROMPT)
    return sum(1 for r in fake.requests if r["body"]["messages"][0]["content"] in prompts)


def test_small_requests_pass_unchanged(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", log=tmp_path / "log") as url:
        body = {"model": "m", "messages": conversation(1, size=5), "max_tokens": 10}
        reply = chat(url, body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].startswith("- summary")
    assert fake.requests[0]["body"] == body  # byte for byte what the client sent
    assert "action=none" in reply.headers["x-context-shrink"]


def test_over_the_window_compacts_then_reuses_the_summary(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000)
    state = tmp_path / "state.sqlite3"
    history = chat_history(30, size=300)
    first = history[:25]  # ends on a user message
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and next?"}]
    third = history[:33]  # four turns later: the cut has moved on
    flags = ("--window", "6000", "--state", f"sqlite:{state}")
    key = {"Authorization": f"Bearer {SECRET}"}
    with serve(fake) as upstream, proxy(upstream, *flags, log=tmp_path / "log") as url:
        replies, calls = [], []
        for messages in (first, second, third):
            replies.append(chat(url, {"model": "m", "messages": messages, "max_tokens": 200}, **key))
            calls.append(summary_calls(fake))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    headers = [r.headers["x-context-shrink"] for r in replies]
    assert "action=compact" in headers[0] and calls[0] >= 1
    assert "summary_cached=True" in headers[1] and calls[1] == calls[0]  # the same span: no model call
    # the moved cut: the earlier summary and the newly evicted messages in one request, not all redone
    assert "action=compact" in headers[2] and calls[2] == calls[1] + 1
    fold = fake.requests[-2]["body"]["messages"]
    assert fold[0]["content"] == cs.SUMMARY_PROMPT and "before this part]\n- summary" in fold[1]["content"]
    sent = fake.requests[-1]["body"]["messages"]
    assert sent[1]["content"].startswith(cs.SUMMARY_MARKER) and cs.api_problems(sent) == []
    assert all(r["auth"] == f"Bearer {SECRET}" for r in fake.requests)  # the client's key reaches the upstream
    log = (tmp_path / "log").read_text()
    assert "action=compact" in log and SECRET not in log
    assert all(SECRET.encode() not in p.read_bytes() for p in tmp_path.glob("state.sqlite3*"))
    store = cst.SqliteStore(state, cs.upstream_namespace(upstream))  # the proxy's store: the upstream's namespace
    searched, entries = store.search("file_0.py", None, 100)
    assert history[1] in [e["message"] for e in entries]  # what was folded away is on disk, verbatim
    assert len({e["id"] for e in entries}) == len(entries) and searched >= len(entries)
    store.close()
    # the MCP server reads the same setting the proxy's --state names: recall finds what it wrote
    config = cs.Config.from_env({"CONTEXT_SHRINK_STATE": f"sqlite:{state}", "CONTEXT_SHRINK_ROOT": str(tmp_path),
                                 "CONTEXT_SHRINK_BASE_URL": upstream})  # fmt: skip
    recalled = ok(run(call(cs.build_server(config), "recall_context", {"query": "file_0.py"})))
    assert recalled["archive"] == f"sqlite:{state}" and history[1] in [e["message"] for e in recalled["entries"]]


def test_a_dead_summariser_falls_back_to_trimming(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    flags = ("--window", "6000", "--summary-url", dead, "--no-archive")
    with serve(fake) as upstream, proxy(upstream, *flags, log=tmp_path / "log") as url:
        reply = chat(url, {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200})
    assert reply.status_code == 200, reply.text
    header = reply.headers["x-context-shrink"]
    assert "action=trim" in header and "summary failed" in header and dead in header
    assert "not asked again" in header  # its window probe found no server: no request waits on retries
    assert not fake.oversized and cs.api_problems(fake.requests[-1]["body"]["messages"]) == []
    assert "trimming instead" in (tmp_path / "log").read_text()


def test_a_key_quoted_by_the_summariser_is_redacted(tmp_path: Path) -> None:
    upstream_fake, summariser = FakeOpenAI(window=6000), FakeOpenAI(window=100_000, script=["echo_key"])
    with serve(upstream_fake) as upstream, serve(summariser) as summary_url:
        flags = ("--window", "6000", "--summary-url", summary_url, "--no-archive")
        with proxy(upstream, *flags, log=tmp_path / "log") as url:
            body = {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200}
            reply = chat(url, body, Authorization=f"Bearer {SECRET}")
    assert reply.status_code == 200 and "summary failed: backend 401" in reply.headers["x-context-shrink"]
    assert SECRET not in reply.headers["x-context-shrink"] and SECRET not in (tmp_path / "log").read_text()
    assert summariser.requests[0]["auth"] == f"Bearer {SECRET}"  # it was sent, only never repeated


def test_a_refusal_is_learnt_and_retried_once(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=5000)
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", "--no-archive", log=tmp_path / "log") as url:
        body = {"model": "m", "messages": conversation(14, size=120), "max_tokens": 100}
        reply = chat(url, body)
        second = chat(url, body)  # a second refusal says the same window: now it is believed (#34)
        again = chat(url, body)  # the learnt window is remembered: no refusal this time
    assert reply.status_code == second.status_code == 200, reply.text
    assert "retried=1" in reply.headers["x-context-shrink"] and "window=5000" in reply.headers["x-context-shrink"]
    assert len(fake.oversized) == 2 and "retried" not in again.headers["x-context-shrink"]


def test_a_refusal_after_the_retry_reaches_the_client(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=300)  # nothing fits: the second refusal is the client's answer
    messages = [{"role": "user", "content": "why " * 200}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and " * 400}]  # fmt: skip
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", "--no-archive", log=tmp_path / "log") as url:
        reply = chat(url, {"model": "m", "messages": messages, "max_tokens": 10})
    assert reply.status_code == 400 and "maximum context length" in reply.text
    assert len(fake.oversized) == 2  # tried once more, not in a loop
    assert "retried=1" in reply.headers["x-context-shrink"]


def test_a_refused_request_that_cannot_get_smaller_is_not_sent_again(tmp_path: Path) -> None:
    """Nothing of a system prompt and one long question can go: the refusal reaches the client at once."""
    fake = FakeOpenAI(window=500)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "why " * 2000}]
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", "--no-archive", log=tmp_path / "log") as url:
        reply = chat(url, {"model": "m", "messages": messages, "max_tokens": 10})
    assert reply.status_code == 400 and len(fake.oversized) == 1  # not re-sent unchanged
    assert "a retry would not be smaller" in reply.headers["x-context-shrink"]


def test_an_upstream_error_passes_through_with_the_header(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=100_000, script=["500"])
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", "--no-archive", log=tmp_path / "log") as url:
        reply = chat(url, {"model": "m", "messages": conversation(1, size=5)})
    assert reply.status_code == 500 and reply.json() == {"error": {"message": "internal error"}}
    assert "action=none" in reply.headers["x-context-shrink"] and len(fake.requests) == 1  # not retried


def test_usage_calibrates_the_estimate_and_a_silent_cut_is_flagged(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=1_000_000)
    body = {"model": "m", "messages": conversation(3, size=60), "max_tokens": 10}
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", log=tmp_path / "log") as url:
        fake.usage_ratio = 1.5  # the server's tokenizer needs half as many tokens again
        first = chat(url, body).headers["x-context-shrink"]
        second = chat(url, body).headers["x-context-shrink"]
        fake.usage_ratio = 0.3  # the server kept less than a third of what was sent
        cut = chat(url, body)
    before = [int(h.split("tokens_before=")[1].split(";")[0]) for h in (first, second)]
    assert 1.4 < before[1] / before[0] < 1.6  # the estimate now speaks the server's tokens
    assert "dropped part of the history" in cut.headers["x-context-shrink-warning"]
    assert "may have dropped part of the history" in (tmp_path / "log").read_text()


def test_usage_calibrates_each_class_of_text_apart(tmp_path: Path) -> None:
    """One model, two agents: Chinese conversations cost the server 1.5x the local count, English ones 1.0x. Each
    class keeps its own calibration (one factor per model would swing between them), and the header names the
    class and the factor that sized the request."""
    fake = FakeOpenAI(window=1_000_000)
    chinese = [{"role": "user", "content": "上下文窗口是模型一次能够处理的最大令牌数量。" * 40},
               {"role": "assistant", "content": "好的我会先读取文件然后运行测试。" * 20},
               {"role": "user", "content": "请继续。"}]  # fmt: skip
    english = conversation(3, size=60)
    sent = []
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", log=tmp_path / "log") as url:
        for messages, ratio in ((chinese, 1.5), (english, 1.0), (chinese, 1.5), (english, 1.0)):
            fake.usage_ratio = ratio
            sent.append(chat(url, {"model": "m", "messages": messages, "max_tokens": 10}).headers["x-context-shrink"])
    fields = [dict(part.split("=", 1) for part in header.split("; ") if "=" in part) for header in sent]
    exact = [fake.count_prompt(chinese), fake.count_prompt(english)]
    assert int(fields[2]["tokens_before"]) == pytest.approx(1.5 * exact[0], rel=0.01)  # its own class's 1.5
    assert int(fields[3]["tokens_before"]) == pytest.approx(exact[1], rel=0.01)  # and English its own 1.0
    assert "[Han] x1.5" in fields[2]["counted_by"] and "[Han]" not in fields[3]["counted_by"], fields


def test_unreachable_upstream_is_a_clear_502(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with proxy(dead, "--window", "4096", "--no-archive", log=tmp_path / "log") as url:
        reply = chat(url, {"model": "m", "messages": conversation(1, size=5)})
        models = httpx2.get(url + "/models", timeout=30)
    assert reply.status_code == 502 and models.status_code == 502
    assert dead in reply.json()["error"]["message"] and "unreachable" in reply.json()["error"]["message"]


def test_transparent_for_other_paths_and_unknown_bodies(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=100_000)
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", log=tmp_path / "log") as url:
        for method, path, content in (
            ("GET", "/models", None),
            ("POST", "/chat/completions", b"{not json"),
            ("POST", "/chat/completions", b'{"messages": "not a list"}'),
            ("POST", "/embeddings", b'{"input": "x"}'),
        ):
            direct = httpx2.request(method, upstream + path, content=content, timeout=30)
            relayed = httpx2.request(method, url + path, content=content, timeout=30)
            assert (relayed.status_code, relayed.content) == (direct.status_code, direct.content), path
            assert relayed.headers.get("content-type") == direct.headers.get("content-type")
        odd = {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}  # a message it cannot validate
        reply = chat(url, odd)
    assert fake.requests[-1]["body"] == odd  # forwarded as it came (fail open)
    assert "action=none" in reply.headers["x-context-shrink"] and "robot" in reply.headers["x-context-shrink"]


def test_body_size_cap(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    with serve(fake) as upstream, proxy(upstream, "--max-body-bytes", "2048", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/chat/completions", content=b"x" * 4096, timeout=30)
    assert reply.status_code == 413 and "2048" in reply.json()["error"]["message"] and not fake.requests


def test_a_configured_key_replaces_the_client_one(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=100_000)
    env = {"CONTEXT_SHRINK_PROXY_API_KEY": SECRET}
    with serve(fake) as upstream, proxy(upstream, "--window", "100000", env=env, log=tmp_path / "log") as url:
        chat(url, {"model": "m", "messages": conversation(1, size=5)}, Authorization="Bearer client-key")
    assert fake.requests[0]["auth"] == f"Bearer {SECRET}"
    assert SECRET not in (tmp_path / "log").read_text()


def test_warns_when_listening_beyond_localhost(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    with serve(fake) as upstream, proxy(upstream, "--host", "0.0.0.0", log=tmp_path / "log"):
        pass
    assert "reachable from other machines" in (tmp_path / "log").read_text()


def test_concurrent_requests_through_the_proxy(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000, latency=0.3)
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        replies: list[httpx2.Response] = []

        def one(k: int) -> None:
            replies.append(chat(url, {"model": "m", "messages": conversation(2 + k, size=40), "max_tokens": 50}))

        threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(replies) == 6 and all(r.status_code == 200 for r in replies)
    assert fake.max_active > 1  # really at the same time
    assert all(json.loads(r.text)["choices"] for r in replies)


@pytest.mark.parametrize("lean", ["off", "on"])
def test_an_opencode_shaped_request_is_shrunk_around_its_fixed_part(lean: str, tmp_path: Path) -> None:
    """The system prompt and tools fill ~85 % of the budget: the proxy counts that fixed part, keeps the
    newest user turn whole and reduces or drops the older turns until the request fits. With the fixed part
    made leaner (#49: its tools described by their first sentence, and its prompt of one repeated rule, still
    over half the budget, sent as its outline), the whole history fits beside it."""
    fake = FakeOpenAI(window=8192)
    body = opencode_request()
    tok = fake.tokenizer
    fixed = cs.count_messages(body["messages"][:1], tok)[1] + cs.count_tools(body["tools"], tok)
    assert 0.8 < fixed / (8192 - 1024) < 0.9 and cs.count_messages(body["messages"], tok)[1] + fixed > 8192
    flags = ("--window", "8192", "--no-archive", "--lean-tools", lean)
    with serve(fake) as upstream, proxy(upstream, *flags, log=tmp_path / "log") as url:
        reply = chat(url, body)
    assert reply.status_code == 200, reply.text
    sent = fake.requests[-1]["body"]
    assert not fake.oversized and sent["messages"][-1] == body["messages"][-1]
    assert cs.api_problems(sent["messages"]) == []
    if lean == "off":
        assert "action=none" not in reply.headers["x-context-shrink"] and sent["tools"] == body["tools"]
    else:
        assert "action=none" in reply.headers["x-context-shrink"] and sent["messages"][1:] == body["messages"][1:]
        assert sent["messages"][0]["content"] == csf.outlined(body["messages"][0]["content"])
        said = "lean=10 tools described by their first sentence, the system prompt outlined (-"
        assert said in reply.headers["x-context-shrink"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXT_SHRINK_PROXY_")}
    return subprocess.run([sys.executable, str(MODULE), *args], capture_output=True, text=True, timeout=60,
                          env={**environment, **(env or {})})  # fmt: skip


def test_a_reply_reserve_over_half_the_window_is_capped() -> None:
    """Claude Code asks 32,000 reply tokens of any model: in a 20,000 window an eighth is reserved, not all."""
    assert csf.request_budget({"max_tokens": 32_000}, 20_000) == (17_500, 2_500)
    assert csf.request_budget({"max_tokens": 32_000}, 4_000) == (2_976, 1_024)  # at least 1,024
    assert csf.request_budget({"max_tokens": 10_000}, 20_000) == (10_000, None)
    assert csf.request_budget({"max_completion_tokens": 512, "max_tokens": 9}, 4096) == (3584, None)
    assert csf.request_budget({}, 4096) == (4096 - 512, None) and csf.request_budget({}, 65_536) == (64_512, None)


def test_rough_edges_at_start_up() -> None:
    """A taken port is an error before anything is announced; a misspelt flag gets the subcommand's usage;
    a missing upstream says what to give."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli("proxy", "--upstream", "http://127.0.0.1:1/v1", "--port", str(taken.getsockname()[1]))
    assert busy.returncode == 2 and "cannot listen on 127.0.0.1" in busy.stderr and "-> http" not in busy.stderr
    typo = run_cli("proxy", "--upstrem", "http://127.0.0.1:1/v1")
    assert typo.returncode == 2 and "usage: context-shrink proxy" in typo.stderr and "--upstrem" in typo.stderr
    missing = run_cli("proxy")
    assert missing.returncode == 2 and "needs its upstream" in missing.stderr and "None" not in missing.stderr


def test_one_server_header_and_keep_alive_answered(tmp_path: Path) -> None:
    upstream = Recorder(lambda request, body: JSONResponse(SUMMARY, headers={"keep-alive": "timeout=60"}))
    with serve(upstream) as url, proxy(url, "--window", "8192", "--no-archive", log=tmp_path / "log") as front:
        reply = chat(front, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.headers.get_list("server") == ["uvicorn"]  # the upstream's, once
    assert reply.headers["keep-alive"] == "timeout=5"  # the proxy's own idle timeout, not the upstream's


def test_stats_metrics_and_one_log_line_per_request(tmp_path: Path) -> None:
    """Every chat request is logged (one line) and counted; /context-shrink/stats and /metrics are the
    proxy's own paths (never relayed); a request that cannot be cut is said to be forwarded unchanged."""
    fake = FakeOpenAI(window=6000)
    log = tmp_path / "log"
    huge = [{"role": "user", "content": "word " * 9000}]  # the newest request alone is over the window
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=log) as url:
        small = chat(url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100})
        shrunk = chat(url, {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200})
        stuck = chat(url, {"model": "m", "messages": huge, "max_tokens": 100})
        stats = httpx2.get(url.removesuffix("/v1") + "/context-shrink/stats").json()
        metrics = httpx2.get(url.removesuffix("/v1") + "/metrics")
    assert small.status_code == shrunk.status_code == 200 and stuck.status_code == 400
    assert "action=forwarded unchanged" in stuck.headers["x-context-shrink"]
    assert fake.requests[-1]["body"]["messages"] == huge  # sent once as it was, not retried the same
    totals = stats["totals"]
    assert (totals["requests"], totals["shrunk"], totals["forwarded_unchanged"], totals["errors"]) == (3, 1, 1, 1)
    assert totals["tokens_saved"] > 0 and totals["refusals"] == 1 and totals["summariser_calls"] >= 1
    assert len(stats["models"]["m"]["conversations"]) == 3
    assert metrics.status_code == 200 and 'context_shrink_requests_total{model="m"} 3.0' in metrics.text
    assert 'context_shrink_actions_total{action="compact",model="m"} 1.0' in metrics.text
    lines = [line for line in log.read_text().splitlines() if "proxy: m " in line and "status=" in line]
    assert len(lines) == 3 and all("action=" in line for line in lines)


@pytest.mark.parametrize("rendered", [False, True], ids=["template drops the tools", "template renders them"])
def test_near_the_limit_the_upstreams_own_count_decides(tmp_path: Path, rendered: bool) -> None:
    """OpenCode's request with a chat template that ignores ``tools`` (SmolLM2's): the estimate with the
    tools is over the budget, the upstream's count without them is under it, so the request goes as it is
    and no warning claims the upstream dropped part of it. Where the template renders them, the request is
    shrunk around what the upstream said the tools cost. Either way: no refusal."""
    fake = FakeOpenAI(window=8192)
    fake.render_tools, fake.counting = rendered, True
    body = opencode_request(turns=3, file_lines=20)
    estimate = cs.count_messages(body["messages"], fake.tokenizer)[1] + cs.count_tools(body["tools"], fake.tokenizer)
    assert estimate > 8192 - 1024 > cs.count_messages(body["messages"], fake.tokenizer)[1] + 100
    log = tmp_path / "log"
    longer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "and now?"}]}  # fmt: skip
    flags = ("--window", "8192", "--no-archive", "--lean-tools", "off")  # the tools as they came (counted whole)
    with serve(fake) as upstream, proxy(upstream, *flags, log=log) as url:
        replies = [chat(url, b) for b in (body, body, longer)]
    assert [r.status_code for r in replies] == [200, 200, 200] and not fake.oversized
    header = replies[0].headers["x-context-shrink"]
    assert ("action=none" in header) != rendered
    whole = [c for c in fake.counted if len(c["messages"]) >= len(body["messages"])]  # not shrunk ones, summaries
    assert len(whole) == 2  # with and without the tools, once: the same request and its extension reuse it
    assert "x-context-shrink-warning" not in replies[1].headers and "dropped part" not in log.read_text()
    stats_line = [line for line in log.read_text().splitlines() if "status=200" in line]
    assert len(stats_line) == 3


def test_a_codex_responses_request_is_shrunk_in_its_own_format(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000)
    body = codex_request(turns=24, result_size=40)
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/responses", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        stored = {**body, "previous_response_id": "resp_0", "input": body["input"][-1:]}
        relayed = httpx2.post(url + "/responses", json=stored, timeout=60)
    header = reply.headers["x-context-shrink"]
    assert "action=none" not in header and not fake.oversized
    sent = fake.responses_requests[0]
    assert responses_problems(sent) == [] and sent["input"][-1] == body["input"][-1]
    assert sent["instructions"] == body["instructions"] and sent["tools"][:-1] == body["tools"]
    assert sent["tools"][-1]["name"] == cs.RECALL_TOOL  # offered: something was folded away
    changed = [item for item in sent["input"] if item not in body["input"]]  # a summary, cleared outputs
    assert all(item.get("type") in ("message", "function_call_output") for item in changed), changed
    kinds = [item.get("type", "message") for item in sent["input"]]
    assert all(kinds[k + 1] == "function_call" for k, kind in enumerate(kinds) if kind == "reasoning"), kinds
    assert relayed.status_code == 200 and fake.responses_requests[1] == stored
    said = relayed.headers["x-context-shrink"]
    assert "forwarded unchanged" in said and "previous_response_id" in said


def test_metrics_without_prometheus_client_is_a_clear_501(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with serve(FakeOpenAI()) as upstream, proxied(upstream, window=4096) as front:
        reply = httpx2.get(front.removesuffix("/v1") + "/metrics")
        stats = httpx2.get(front.removesuffix("/v1") + "/context-shrink/stats")
    assert reply.status_code == 501 and "context-shrink-mcp[metrics]" in reply.json()["error"]["message"]
    assert stats.status_code == 200 and stats.json()["totals"]["requests"] == 0


def test_a_claude_code_messages_request_is_shrunk_in_its_own_format(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=6000)
    body = claude_request(turns=30, result_size=40)
    assert anthropic_problems(body) == []
    view = csw.messages_view(body)
    assert view.messages[2]["role"] == "system" and csw.messages_body(body, view, view.messages) == body
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "action=none" not in reply.headers["x-context-shrink"] and not fake.oversized
    sent = fake.anthropic_requests[0]
    assert anthropic_problems(sent) == [] and sent["messages"][-1] == body["messages"][-1]
    assert sent["system"] == body["system"] and sent["tools"][:-1] == body["tools"]
    assert sent["tools"][-1]["name"] == cs.RECALL_TOOL  # offered: something was folded away
    kept = [m for m in sent["messages"] if m in body["messages"]]
    assert any(m["role"] == "assistant" and m["content"][0]["type"] == "thinking" for m in kept)  # as sent, signed


def rich_claude_request(turns: int) -> dict[str, Any]:
    """A Claude Code request whose blocks carry what the chat view does not: tool results with ``is_error``
    and ``cache_control`` beside an image and a text in the same user message, text with citations,
    assistant turns that hold only a thinking block."""
    body = claude_request(turns=turns, result_size=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    for k, message in enumerate(body["messages"]):
        blocks = message["content"]
        if message["role"] == "user" and isinstance(blocks, list) and blocks[0].get("type") == "tool_result":
            blocks[0].update(is_error=k % 3 == 0, cache_control={"type": "ephemeral"})
            cite = {"type": "char_location", "cited_text": "x", "document_index": 0, "start_char_index": 0,
                    "end_char_index": 1}  # fmt: skip
            blocks += [image, {"type": "text", "text": f"screenshot {k}", "citations": [cite]}]
    at = len(body["messages"]) // 2
    body["messages"][at:at] = [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                               "signature": "s"}]}, {"role": "user", "content": "go on"}]  # fmt: skip
    return body


def test_an_edited_anthropic_message_keeps_every_part_it_did_not_change(tmp_path: Path) -> None:
    """#34: when the proxy clears an old tool result, the rest of that message goes out byte-identical (its
    image, the result's is_error and cache_control, citations); no message leaves with empty content."""
    fake = FakeOpenAI(window=8000)
    body = rich_claude_request(turns=12)
    sent_blocks = {json.dumps(b, sort_keys=True) for m in body["messages"] if isinstance(m["content"], list)
                   for b in m["content"]}  # fmt: skip
    results = {b["tool_use_id"]: b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "tool_result"}  # fmt: skip
    with serve(fake) as upstream, proxy(upstream, "--window", "8000", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    sent = fake.anthropic_requests[0]
    assert anthropic_problems(sent) == []
    kept_results = partly_edited = 0
    for message in sent["messages"]:
        blocks = message["content"] if isinstance(message["content"], list) else []
        for block in blocks:
            if block.get("type") == "tool_result" and block["tool_use_id"] in results:
                original = results[block["tool_use_id"]]
                assert {k: v for k, v in block.items() if k != "content"} == \
                    {k: v for k, v in original.items() if k != "content"}  # fmt: skip
                kept_results += 1
            elif block.get("type") == "image" or str(block.get("text")).startswith("screenshot"):
                assert json.dumps(block, sort_keys=True) in sent_blocks, block  # as the client sent it
        partly_edited += any("[image removed" in str(b.get("text")) for b in blocks) and any(
            "citations" in b for b in blocks
        )
    assert kept_results and partly_edited, "nothing was edited in part: the test checks nothing"


# --------------------------------------------------------------------------- recall by the model (#27)


RECALL_APIS = {"chat": ("/chat/completions", chat_request), "responses": ("/responses", codex_request),
               "messages": ("/messages", claude_request)}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", list(RECALL_APIS))
def test_a_model_that_recalls_gets_the_folded_content_and_the_agent_never_sees_the_call(
    api: str, stream: bool, tmp_path: Path
) -> None:
    path, build = RECALL_APIS[api]
    model = RecallingModel(6000, "cat f0")
    body = {**build(24, 80), "stream": stream}
    with serve(model) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert not model.refused  # a streamed reply's header goes out before the model recalls: the log says it
    assert (
        "recalled=1" in reply.headers["x-context-shrink"]
        if not stream
        else "the model recalled" in (tmp_path / "log").read_text()
    )
    assert model.recalled and "line 0" in model.recalled[0]  # the first output, folded away, came back
    assert cs.RECALL_TOOL not in reply.text and "done" in reply.text  # the agent sees only the answer
    first, second = [b for _, b in model.log[-2:]]
    assert cs.RECALL_TOOL in json.dumps(first["tools"]) and "line 0" in json.dumps(second)
    problems = {"chat": lambda b: cs.api_problems(b["messages"]), "responses": responses_problems,
                "messages": anthropic_problems}[api]  # fmt: skip
    assert problems(second) == []


def streamed_reply_problems(api: str, payloads: list[Any]) -> list[str]:
    """What a client of ``api`` would trip on in a streamed reply made of several rounds: its events out of
    order or numbered twice, an opening or a closing event repeated."""
    events = [p for p in payloads if isinstance(p, dict)]
    if api == "chat":
        return [] if payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1 else ["[DONE] not once, last"]
    if api == "responses":
        numbers = [e["sequence_number"] for e in events]
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        kinds = [e["type"] for e in events]
        problems = [] if numbers == list(range(len(numbers))) else [f"sequence numbers {numbers}"]
        problems += [] if added == list(range(len(added))) else [f"output items {added}"]
        problems += [] if kinds.count("response.created") == 1 and kinds[-1] == "response.completed" else [str(kinds)]
        return problems
    started = [e["index"] for e in events if e["type"] == "content_block_start"]
    kinds = [e["type"] for e in events]
    problems = [] if started == list(range(len(started))) else [f"content blocks {started}"]
    problems += [] if kinds.count("message_start") == 1 and kinds[-1] == "message_stop" else [str(kinds)]
    return problems


def reply_words(api: str, payloads: list[Any]) -> str:
    """The text the client assembles from a streamed reply."""
    events = [p for p in payloads if isinstance(p, dict)]
    if api == "chat":
        return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices") or [])
    if api == "responses":
        return "".join(e.get("delta") or "" for e in events if e["type"] == "response.output_text.delta") + "".join(
            p["text"] for e in events if e["type"] == "response.output_item.done"
            for p in e["item"].get("content") or [] if e["output_index"] > 0
        )  # fmt: skip
    return "".join(e["delta"].get("text") or "" for e in events if e["type"] == "content_block_delta")


@pytest.mark.parametrize("recalls", [0, 1])
@pytest.mark.parametrize("api", list(RECALL_APIS))
def test_a_streamed_reply_with_recall_offered_reaches_the_agent_as_it_comes(
    api: str, recalls: int, tmp_path: Path
) -> None:
    """#50: while the recall tool is offered, the model's first words reach the agent while the model is still
    replying (the model waits for the client to have them); a recall call is answered in the same stream, the
    agent never sees it, and the rounds read as one reply (one opening, one end, blocks and items numbered on)."""
    path, build = RECALL_APIS[api]
    model = SlowRecaller(6000, "cat f0", times=recalls)
    body = {**build(24, 80), "stream": True}
    payloads: list[Any] = []
    flags = ("--window", "6000", "--no-archive")
    with (
        serve(model) as upstream,
        proxy(upstream, *flags, log=tmp_path / "log") as url,
        httpx2.stream("POST", url + path, json=body, timeout=60) as reply,
    ):
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data:"):
                payloads.append(cs.json_or(line[5:].strip(), line[5:].strip()))
                model.heard.set() if PREAMBLE in line else None
    assert model.in_time and model.in_time[0], "the agent had no word before the model's reply ended"
    assert len(model.log) == 1 + recalls and (not recalls or "line 0" in model.recalled[0])
    text = json.dumps(payloads)
    assert cs.RECALL_TOOL in json.dumps(model.log[0][1]["tools"]) and cs.RECALL_TOOL not in text
    assert reply_words(api, payloads).startswith(PREAMBLE) and "done" in reply_words(api, payloads)
    assert streamed_reply_problems(api, payloads) == []
    if recalls:
        assert "the model recalled 'cat f0'" in (tmp_path / "log").read_text()


def sdk_reply(api: str, url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """A streamed request through the official SDK's streaming helper, which assembles the events into one reply
    (and refuses events out of order): the reply's text and the kinds of its parts."""
    import anthropic
    import openai

    if api == "messages":
        client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="sk-local-test", max_retries=0)
        fields = {k: body[k] for k in ("model", "max_tokens", "system", "messages", "tools") if k in body}
        with client.messages.stream(**fields) as stream:
            message = stream.get_final_message()
        return "".join(getattr(b, "text", "") for b in message.content), [b.type for b in message.content]
    llm = openai.OpenAI(base_url=url, api_key="sk-local-test", max_retries=0)
    if api == "responses":
        fields = {k: body[k] for k in ("model", "input", "instructions", "tools") if k in body}
        with llm.responses.stream(**fields) as stream:
            response = stream.get_final_response()
        return response.output_text, [item.type for item in response.output]
    with llm.chat.completions.stream(model=body["model"], messages=body["messages"], tools=body["tools"]) as stream:
        completion = stream.get_final_completion()
    message = completion.choices[0].message
    return message.content or "", ["tool_calls"] * len(message.tool_calls or []) + ["content"]


@pytest.mark.parametrize("api", list(RECALL_APIS))
def test_the_official_sdks_read_a_streamed_reply_with_a_recall_as_one_reply(api: str, tmp_path: Path) -> None:
    """The openai and anthropic Python SDKs' streaming helpers (which check each event's place and the
    response's identity) assemble the rounds of a recall into one reply: the model's words, no recall call."""
    build = RECALL_APIS[api][1]
    model = SlowRecaller(6000, "cat f0", times=1)
    model.heard.set()  # the model does not wait: this test reads the reply whole
    with serve(model) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        text, parts = sdk_reply(api, url, build(24, 80))
    assert len(model.log) == 2 and "line 0" in model.recalled[0]  # recalled, then asked again
    assert text.startswith(PREAMBLE) and text.endswith("done") and "function_call" not in parts
    assert "tool_use" not in parts and "tool_calls" not in parts


def test_recalls_are_bounded_per_request_and_the_last_answer_has_no_tool(tmp_path: Path) -> None:
    model = RecallingModel(6000, "cat f0", times=5)  # it would recall forever
    with serve(model) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/chat/completions", json=chat_request(24, 80), timeout=60)
    assert reply.status_code == 200 and f"recalled={csp.RECALL_ROUNDS}" in reply.headers["x-context-shrink"]
    assert len(model.recalled) == csp.RECALL_ROUNDS and cs.RECALL_TOOL not in reply.text
    assert cs.RECALL_TOOL not in json.dumps(model.log[-1][1]["tools"])  # the last ask offers no recall


def test_recall_off_offers_no_tool(tmp_path: Path) -> None:
    model = RecallingModel(6000, "cat f0")
    flags = ("--window", "6000", "--no-archive", "--recall", "off")
    with serve(model) as upstream, proxy(upstream, *flags, log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/chat/completions", json=chat_request(24, 80), timeout=60)
    assert reply.status_code == 200 and "action=none" not in reply.headers["x-context-shrink"]
    assert not model.recalled and all(cs.RECALL_TOOL not in json.dumps(b.get("tools")) for _, b in model.log)


def test_an_agent_whose_fixed_part_cannot_fit_is_told_so_in_plain_words(tmp_path: Path) -> None:
    fake = FakeOpenAI(window=4096)
    rng = random.Random(4)  # a prompt no lean can shorten: distinct lines in a code fence (kept whole)
    code = "\n".join(f"{k}: " + " ".join(rng.choice(string.ascii_lowercase) * 3 for _ in range(8)) for k in range(900))
    body = {"model": "m", "messages": [{"role": "system", "content": f"Follow the rules.\n```\n{code}\n```"},
                                        {"role": "user", "content": "hi"}], "max_tokens": 256}  # fmt: skip
    with serve(fake) as upstream, proxy(upstream, "--window", "4096", "--no-archive", log=tmp_path / "log") as url:
        reply = httpx2.post(url + "/chat/completions", json=body, timeout=60)
    header = reply.headers["x-context-shrink"]
    assert "action=forwarded unchanged" in header and "the agent's system prompt and tools need" in header
    assert "the window is 4,096 tokens" in header
    assert "the agent's system prompt and tools need" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("behaviour", ["copy", "empty", "cut", "tool_call", "500"])
def test_a_failing_summariser_is_asked_once_per_back_off_and_counted(behaviour: str, tmp_path: Path) -> None:
    """A summariser answering degenerate or short replies was asked again on every request (seconds each),
    and ``summariser_calls`` stayed 0. Now any failure backs it off: the later requests are trimmed without
    asking it, the header says so, and the stats count every call and failure."""
    upstream_fake, summariser = FakeOpenAI(window=6000), FakeOpenAI(window=100_000)
    summariser.default = behaviour
    with serve(upstream_fake) as upstream, serve(summariser) as summary_url:
        flags = ("--window", "6000", "--summary-url", summary_url, "--no-archive")
        with proxy(upstream, *flags, log=tmp_path / "log") as url:
            headers, asked = [], []
            for turns in range(14, 20):
                body = {"model": "m", "messages": chat_history(turns, size=200), "max_tokens": 200}
                reply = chat(url, body)
                assert reply.status_code == 200, reply.text
                headers.append(reply.headers["x-context-shrink"])
                asked.append(len(summariser.requests))
            stats = httpx2.get(url.removesuffix("/v1") + "/context-shrink/stats").json()
    assert asked[0] >= 1 and asked[-1] == asked[0], (asked, headers)  # asked on the first request only
    assert all("action=trim" in h and "summary failed" in h for h in headers), headers
    assert all("not asked again" in h for h in headers[1:]), headers
    calls = asked[-1] // (1 + cs.MAX_RETRIES) if behaviour == "500" else asked[-1]  # a retried 500 is one call
    assert stats["totals"]["summariser_calls"] == calls, stats["totals"]
    (health,) = stats["summarisers"].values()
    assert health["calls"] == calls and health["failures"] == 1 and 100 < health["backoff_left_s"] <= 120
    assert health["last_error"] and health["seconds"] > 0
    assert not upstream_fake.oversized


@pytest.mark.parametrize("counting", [True, False])
def test_the_header_says_whether_the_count_was_exact_and_what_counted(counting: bool, tmp_path: Path) -> None:
    """The docs said the header tells an exact count from an estimate; it never did (the same request was
    reported at 13,777 and 16,137 tokens on two runs with no word of which was the upstream's)."""
    fake = FakeOpenAI(window=6000)
    fake.counting = counting
    with serve(fake) as upstream, proxy(upstream, "--window", "6000", "--no-archive", log=tmp_path / "log") as url:
        body = {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200}
        header = chat(url, body).headers["x-context-shrink"]
        small = chat(url, {**body, "messages": chat_history(1, size=20)}).headers["x-context-shrink"]
        stats = httpx2.get(url.removesuffix("/v1") + "/context-shrink/stats").json()["totals"]
    fields = dict(part.split("=", 1) for part in header.split("; "))
    if counting:
        assert fields["count"] == "exact" and fields["counted_by"] == "llama.cpp /v1/chat/completions/input_tokens"
        assert int(fields["tokens_before"]) == fake.count_prompt(body["messages"]), fields
    else:
        assert fields["count"] == "estimated" and fields["counted_by"].startswith("tiktoken"), fields
    assert "count=estimated" in small  # far under the window: never worth the upstream's count
    assert stats["exact_counts"] == counting and stats["estimated_counts"] == 2 - counting, stats


def test_log_levels_show_the_decisions_not_the_wire(tmp_path: Path) -> None:
    """There was no --log-level; at DEBUG a user got the HTTP client's wire chatter and no line of the proxy's
    own decisions, and a 413 was not logged. Now DEBUG shows the counts and the plan, TRACE adds the
    libraries' lines, INFO logs every request (a 413 too), and a wrong level names the flag."""
    fake = FakeOpenAI(window=6000)
    body = {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200}
    logs = {}
    for level in ("debug", "trace", "info"):
        log = tmp_path / f"{level}.log"
        flags = ("--window", "6000", "--no-archive", "--log-level", level, "--max-body-bytes", "60000")
        with serve(fake) as upstream, proxy(upstream, *flags, log=log) as url:
            assert chat(url, body).status_code == 200
            assert chat(url, {**body, "messages": chat_history(60, size=400)}).status_code == 413
        logs[level] = log.read_text()
    assert "budget 5800 of the window 6000" in logs["debug"] and "messages by compact" in logs["debug"], logs["debug"]
    assert "HTTP Request:" not in logs["debug"] and "HTTP Request:" in logs["trace"]
    assert "budget" not in logs["info"] and "action=compact" in logs["info"] and "HTTP Request:" not in logs["info"]
    assert all("status=413: the request body is over 60000 bytes" in text for text in logs.values())
    command = [sys.executable, str(MODULE), "proxy", "--log-level", "loud"]
    wrong = subprocess.run(command, capture_output=True, text=True)
    assert wrong.returncode == 2 and "--log-level" in wrong.stderr and "'LOUD'" in wrong.stderr


def test_doctor_checks_the_install_and_a_running_proxy(tmp_path: Path) -> None:
    """doctor probed the upstream only, misread a URL without http://, and its lines drowned in the HTTP
    client's. Now it checks the install, the upstream and a running proxy (its stats, its summariser's
    health), each problem with a fix, accepts host:port saying what it assumed, and keeps library lines out."""
    upstream_fake, summariser = FakeOpenAI(window=6000), FakeOpenAI(window=100_000)
    summariser.default = "copy"
    env = {**os.environ, "CONTEXT_SHRINK_TOKENIZER": "tiktoken"}

    def doctor(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(MODULE), "doctor", *flags], capture_output=True, text=True,
                              timeout=120, env=env)  # fmt: skip

    with serve(upstream_fake) as upstream, serve(summariser) as summary_url:
        flags = ("--window", "6000", "--summary-url", summary_url, "--no-archive")
        with proxy(upstream, *flags, log=tmp_path / "log") as url:
            chat(url, {"model": "m", "messages": chat_history(14, size=200), "max_tokens": 200})
            hostport = url.removeprefix("http://").removesuffix("/v1")
            human = doctor("--proxy", hostport, "--upstream", upstream.removeprefix("http://"))
            report = json.loads(doctor("--proxy", hostport, "--json").stdout)
        token = "doctor-token-0123456789"
        with started("serve", "--token", token, "--upstream", upstream, log=tmp_path / "serve.log") as base:
            locked = json.loads(doctor("--proxy", base, "--json").stdout)
            opened = json.loads(doctor("--proxy", base, "--token", token, "--json").stdout)
    assert human.returncode == 0, human.stdout + human.stderr
    out = human.stdout
    assert f"read '{hostport}' as http://{hostport}" in out and "counter    tiktoken" in out
    assert "1 requests, 1 shrunk" in out and "fix: the summariser" in out and "backed off" in out
    assert "upstream     http://" in out and "HTTP Request" not in out + human.stderr  # no wire chatter
    assert [c["name"] for c in report["install"]][:2] == ["counter", "tiktoken"]
    assert report["proxy"]["stats"]["totals"]["requests"] == 1 and report["proxy"]["fixes"]
    assert "token" in locked["proxy"]["state"] and "--token" in locked["proxy"]["fixes"][0]
    assert opened["proxy"]["state"] == "up" and opened["proxy"]["stats"]["totals"]["requests"] == 0
    bad = doctor("--proxy", "http://a b")
    assert bad.returncode == 2 and "--proxy" in bad.stderr and "Traceback" not in bad.stderr


def test_the_repeated_share_is_what_a_prompt_cache_keeps() -> None:
    """The live page's prefix reuse: the share (by characters) of a request that repeats the start of the
    previous one. An appended turn keeps the whole previous request; a changed first message keeps nothing."""
    first = chat_history(4, size=30)
    grown = [*first, {"role": "user", "content": "and now the tests"}]
    before, after = csp.prefix_prints(first), csp.prefix_prints(grown)
    assert csp.repeated_share(before, after) == round(before[-1][2] / after[-1][2], 4) < 1
    assert csp.repeated_share(before, before) == 1.0 and csp.repeated_share(None, before) is None
    changed = [{**first[0], "content": "another system prompt"}, *first[1:]]
    assert csp.repeated_share(before, csp.prefix_prints(changed)) == 0.0
    cut = [first[0], *first[3:]]  # a cut after the system prompt: only the system prompt is kept
    assert csp.repeated_share(before, csp.prefix_prints(cut)) == round(before[0][2] / csp.prefix_prints(cut)[-1][2], 4)
    long = chat_history(300, size=5)  # a long request keeps a sample (here every 4th prefix): the share still meets
    grown_long = [*long, {"role": "user", "content": "go on"}]
    sampled = csp.prefix_prints(long, most=100), csp.prefix_prints(grown_long, most=100)
    assert len(sampled[0]) <= 100 + csp.PRINTS_TAIL and csp.repeated_share(*sampled) == csp.repeated_share(
        csp.prefix_prints(long), csp.prefix_prints(grown_long))  # fmt: skip


class ChangingModels(FakeOpenAI):
    """An upstream whose ``GET /v1/models`` answers differently every time (as llama.cpp's does: its ``created``
    is the time of the request), saying which answer it gave in a header, so each relayed answer can be checked
    against the very one the upstream sent."""

    def __init__(self) -> None:
        super().__init__(window=100_000)
        self.given: dict[str, bytes] = {}
        self.app.router.routes.insert(0, Route("/v1/models", self.models, methods=["GET"]))

    async def models(self, request: Request) -> Response:
        answer = os.urandom(8).hex()
        entry = {"id": "m", "created": answer, "context_length": 8000, "pad": "x" * 3000}  # no more than --window
        body = json.dumps({"object": "list", "data": [entry]}).encode()
        self.given[answer] = body
        return Response(body, media_type="application/json", headers={"x-answer": answer})


class OverstatedWindow(FakeOpenAI):
    """An upstream whose model list says a window four times the one it serves (a llama.cpp whose slots share it
    out), and its training window larger still."""

    async def models(self, request: Request) -> Response:
        meta = {"n_ctx": self.window * 4, "n_ctx_train": self.window * 32, "n_vocab": 151936}
        return JSONResponse({"object": "list", "data": [{"id": "m", "owned_by": "llamacpp", "meta": meta}]})

    def __init__(self) -> None:
        super().__init__(window=3000)
        self.app.router.routes.insert(0, Route("/v1/models", self.models, methods=["GET"]))


def test_the_model_list_says_the_window_a_refusal_taught(tmp_path: Path) -> None:
    """#49: once refusals taught the proxy the window the upstream really serves, an agent that reads the window
    from ``GET /v1/models`` through the proxy reads that one (and the byte-identical list before)."""
    fake = OverstatedWindow()
    with serve(fake) as upstream, proxy(upstream, "--no-archive", log=tmp_path / "log") as url:
        direct = httpx2.get(upstream + "/models", timeout=30)
        before = httpx2.get(url + "/models", timeout=30)
        for _ in range(2):  # a refusal's window is believed when a second one says it again
            reply = httpx2.post(url + "/chat/completions", json=chat_request(60, 300), timeout=120)
        after = httpx2.get(url + "/models", timeout=30)
    assert before.content == direct.content and "x-context-shrink" not in before.headers  # nothing learnt yet
    assert reply.status_code == 200 and fake.oversized  # the window the list said was refused
    meta = after.json()["data"][0]["meta"]
    assert meta["n_ctx"] == meta["n_ctx_train"] <= 3000 and meta["n_vocab"] == 151936
    assert "window the proxy enforces in 2 field(s)" in after.headers["x-context-shrink"]


def test_a_small_answer_is_relayed_byte_for_byte_under_load(tmp_path: Path) -> None:
    """#50: 400 ``GET /v1/models`` from 16 clients at once, while long requests are shrunk beside them: every
    answer the client gets is byte for byte the one the upstream gave for that request. (The attack run's one
    difference was llama.cpp's own: its ``created`` is the time of each request, so two GETs a second apart
    differ, straight to it as through the proxy.)"""
    fake = ChangingModels()
    wrong: list[str] = []

    def get_models(url: str) -> None:
        with httpx2.Client(timeout=60) as client:
            for _ in range(25):
                reply = client.get(url + "/models")
                if reply.status_code != 200 or reply.content != fake.given.get(reply.headers.get("x-answer", "")):
                    wrong.append(f"{reply.status_code} {reply.headers.get('x-answer')}")

    def shrink_long(url: str) -> None:
        for _ in range(3):
            httpx2.post(url + "/chat/completions", json=chat_request(200, 400), timeout=120)

    with serve(fake) as upstream, proxy(upstream, "--window", "8000", "--no-archive", log=tmp_path / "log") as url:
        threads = [threading.Thread(target=get_models, args=(url,)) for _ in range(16)]
        threads += [threading.Thread(target=shrink_long, args=(url,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(fake.given) >= 400 and wrong == []
