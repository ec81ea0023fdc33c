"""The one real stdio round trip through the Python SDK (the shipped example), and the command line."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

import context_shrink as cs


def test_python_example_over_stdio() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "python-client.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "tools: " + ", ".join(cs.TOOL_NAMES)
    assert lines[1].startswith("estimate_context: 1309 tokens of 32768 (tiktoken:cl100k_base)")
    assert re.search(r"dropped \d+ messages, fits=True", lines[2])
    assert "compact_context (plan): needs_summary=True" in lines[3]
    assert "messages[0].role 'robot'" in lines[4]
    assert "context-shrink 0.1.0" in run.stderr  # logs go to stderr, never stdout


def test_version_and_help() -> None:
    version = subprocess.run(
        [sys.executable, str(ROOT / "context_shrink.py"), "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == f"context-shrink {cs.__version__}"
    helptext = subprocess.run(
        [sys.executable, str(ROOT / "context_shrink.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "CONTEXT_SHRINK_" in helptext.stdout
