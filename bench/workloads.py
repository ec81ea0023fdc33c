"""What the benchmarks run on: the real agent transcripts and generated coding sessions, all inside the
repository (a clone reproduces every figure): the eight transcripts of ``test/data`` (three, which the suite
reads too) and ``bench/data/sessions`` (five), and sessions from ``bench/gen_session.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = (ROOT / "test" / "data", ROOT / "bench" / "data" / "sessions")
GENERATOR = ROOT / "bench" / "gen_session.py"
Messages = list[dict[str, Any]]


def transcript_paths() -> list[Path]:
    """The real transcripts (each names its source, commit and license), by name."""
    return sorted((path for folder in SESSIONS for path in folder.glob("*.json")), key=lambda p: p.name)


def load(path: Path) -> Messages:
    """The messages of one transcript file."""
    return json.loads(path.read_text(encoding="utf-8"))["messages"]


def generated(n: int, end: str | None = None, seed: int = 7) -> Messages:
    """A synthetic coding session of ``n`` messages from ``bench/gen_session.py``, ending on ``end`` ("tool" or
    "user") when given."""
    command = [sys.executable, str(GENERATOR), "--messages", str(n), "--seed", str(seed)]
    command += ["--end", end] if end else []
    data = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return data["messages"] if isinstance(data, dict) else data
