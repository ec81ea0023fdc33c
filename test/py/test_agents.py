"""The real coding agents, headless, through the proxy: OpenCode (Chat Completions), Codex CLI (Responses)
and Claude Code (Anthropic Messages), each configured exactly as the README says.

Each agent runs one task of ``STEPS`` tool calls, every one of which reads a file of about 2,000 tokens,
against a scripted model (agent_upstream.py) that, like llama.cpp, refuses any prompt over ``WINDOW``
tokens. Without the proxy the session is refused; through it, no request is refused, the agent finishes,
and every body that reached the server is valid for its API. The agents are installed from npm by
./test/test.sh (test/agents, pinned versions); outside CI a missing install skips these tests, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_upstream import fixed_tokens, request_view
from agents import (
    AGENTS,
    PROMPT,
    README,
    ROOT,
    STEPS,
    TOKEN,
    WINDOW,
    Setup,
    binary,
    output_limit,
    problems,
    readme_fixed_parts,
    run_session,
)
from proxy_helpers import started


@pytest.fixture(scope="module", params=list(AGENTS))
def agent(request: pytest.FixtureRequest) -> Iterator[str]:
    binary(request.param)
    yield request.param


@pytest.mark.parametrize("name", ["codex", "claude"])
def test_without_the_proxy_the_session_is_refused(name: str, tmp_path: Path) -> None:
    """The task really overflows the window: going direct, the server refuses Codex CLI and Claude Code (which
    do not compact on their own here). OpenCode, given its limit, compacts before it overflows on this task;
    the test below shows it sends requests over the window all the same once the proxy answers for it."""
    binary(name)
    session = run_session(name, tmp_path, proxied=False, stop_at_refusal=True)
    assert session.upstream.refused, f"{name} was never refused going direct:\n{session.output[-2000:]}"


@pytest.mark.parametrize("door", ["proxy", "serve", "serve+token"])
def test_through_the_proxy_no_request_is_refused(agent: str, door: str, tmp_path: Path) -> None:
    """Through ``context-shrink proxy``, and through the proxy at /v1 of ``context-shrink serve`` (with a
    token the agent sends as its key, configured as docs/deploy.md says, and which never goes upstream)."""
    served, token = door.startswith("serve"), door.endswith("token")
    session = run_session(agent, tmp_path, proxied=door == "proxy", served=served, token=token)
    assert not any(TOKEN in value for value in session.upstream.credentials), session.upstream.credentials
    upstream = session.upstream
    assert not upstream.refused, f"refused: {upstream.refused}\n{session.proxy_log[-3000:]}"
    assert session.returncode == 0, session.output[-3000:]
    assert upstream.calls == STEPS and "done" in session.output, session.output[-3000:]
    for path, body in upstream.log:
        assert problems(path, body) == [], (path, problems(path, body))
    lines = [line for line in session.proxy_log.splitlines() if "proxy: " in line and "status=" in line]
    shrunk = [line for line in lines if re.search(r"action=(diet|clear|compact|trim)", line)]
    assert shrunk and all("status=200" in line for line in lines), "\n".join(lines)
    assert "forwarded unchanged" not in session.proxy_log, session.proxy_log[-3000:]
    before = [int(m) for m in re.findall(r"tokens_before=(\d+)", session.proxy_log)]
    assert max(before) > WINDOW, "the agent never sent a request over the window: the test proves nothing"
    assert max(upstream.over_window(request_view(path, body), 0)[0] for path, body in upstream.log) <= WINDOW


def deploy_block(client: str) -> str:
    """The fenced block after ``**<client>**`` in docs/deploy.md."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    found = re.search(rf"\*\*{re.escape(client)}\*\*.*?```\w*\n(.*?)```", text, re.S)
    assert found, f"docs/deploy.md has no block for {client}"
    return found.group(1)


@pytest.mark.parametrize("name", ["opencode", "claude"])
def test_the_agents_reach_a_remote_server_as_the_deploy_page_says(name: str, tmp_path: Path) -> None:
    """OpenCode's remote MCP configuration and Claude Code's ``claude mcp add --transport http``, as written in
    docs/deploy.md, against a real ``context-shrink serve`` with a token: connected with the token, not
    without it."""
    program = binary(name)
    token = "agent-token-0123456789abcdef"
    states = []
    with started("serve", "--token", token, log=tmp_path / "log", env={"CONTEXT_SHRINK_ROOT": str(tmp_path)}) as base:
        for given in (token, "wrong-token-0123456789abcdef"):
            home, project = tmp_path / given / "home", tmp_path / given / "project"
            project.mkdir(parents=True)
            env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "CONTEXT_SHRINK_HTTP_TOKEN": given}
            env.update({f"XDG_{k}_HOME": str(home / k.lower()) for k in ("CONFIG", "DATA", "CACHE", "STATE")})
            if name == "opencode":
                config = deploy_block("OpenCode").replace("https://shrink.example.com", base)
                (project / "opencode.json").write_text(config)
            else:
                add = deploy_block("Claude Code").replace("https://shrink.example.com", base).replace("<token>", given)
                subprocess.run([str(program), *shlex.split(add)[1:]], cwd=project, env=env, check=True,
                               capture_output=True, timeout=120)  # fmt: skip
            listed = subprocess.run([str(program), "mcp", "list"], cwd=project, env=env, capture_output=True,
                                    text=True, timeout=120)  # fmt: skip
            states.append(listed.stdout + listed.stderr)
    assert "connected" in states[0].lower() and "context-shrink" in states[0], states[0]
    assert "connected" not in states[1].lower().replace("not connected", "").replace("disconnected", ""), states[1]


def test_the_agents_own_prompts_and_tools_are_what_the_readme_says(agent: str, tmp_path: Path) -> None:
    """Each agent's own system prompt and tools (its first request, less the task) are within 15 % of the
    README's figure, and Claude Code asks the reply size the README says."""
    stated, reply = readme_fixed_parts()[agent]
    session = run_session(agent, tmp_path, proxied=False, steps=1)
    path, body = next((p, b) for p, b in session.upstream.log if b.get("tools"))
    measured = fixed_tokens(path, body, PROMPT)
    assert abs(measured - stated) <= 0.15 * stated, (agent, measured, stated)
    if agent == "claude":
        assert f"`max_tokens: {body['max_tokens']}`" in reply, (body["max_tokens"], reply)


@pytest.mark.parametrize("proxied", [False, True], ids=["direct", "proxy"])
def test_opencode_compacts_in_a_loop_when_its_output_limit_leaves_no_room(proxied: bool, tmp_path: Path) -> None:
    """As the README says: at an 8k window, ``limit.output`` 4096 leaves less than OpenCode's own prompt, and
    going direct it compacts again and again (stopped after 60 requests for a 4-read task); through the proxy,
    whose leaner fixed part (#49: its tools described by their first sentence) leaves it room, it finishes."""
    binary("opencode")
    setup = Setup(window=8192, edit=output_limit(4096), max_requests=60)
    session = run_session("opencode", tmp_path, proxied=proxied, steps=4, setup=setup)
    said = (len(session.upstream.log), session.returncode)
    if proxied:
        assert session.returncode == 0 and not session.upstream.refused and len(session.upstream.log) < 30, said
    else:
        assert len(session.upstream.log) >= 60 and session.returncode is None, said
    assert "8k window `output: 4096`" in README.read_text()


def test_opencode_with_room_for_its_prompt_finishes_through_the_proxy(tmp_path: Path) -> None:
    """``limit.output`` 1024 at the same 8k window: OpenCode finishes the task through the proxy, no refusal."""
    binary("opencode")
    setup = Setup(window=8192, edit=output_limit(1024), max_requests=60)
    session = run_session("opencode", tmp_path, proxied=True, steps=4, setup=setup)
    assert session.returncode == 0 and "done" in session.output and not session.upstream.refused
    assert len(session.upstream.log) < 30
    assert "`output: 1024` works" in README.read_text()


def test_codex_given_its_window_compacts_on_its_own(tmp_path: Path) -> None:
    """As the README says: Codex CLI with ``model_context_window`` compacts by itself (no refusal, its own
    checkpoint summary); without it, it is refused going direct (test_without_the_proxy_the_session_is_refused)."""
    binary("codex")
    window = f'model_provider = "local"\nmodel_context_window = {WINDOW}'
    setup = Setup(edit=lambda block: block.replace('model_provider = "local"', window))
    session = run_session("codex", tmp_path, proxied=False, setup=setup)
    assert session.returncode == 0 and "done" in session.output and not session.upstream.refused
    asked = [json.dumps(b) for _, b in session.upstream.log]
    assert any("CONTEXT CHECKPOINT" in text for text in asked), "Codex never compacted"
    assert "`model_context_window`" in README.read_text()
