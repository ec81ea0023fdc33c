"""What the benchmarks run on: the shared agent transcripts and generated coding sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
Messages = list[dict[str, Any]]


def transcript_paths() -> list[Path]:
    """The transcripts of ../shared/data/sessions by name; the small copies in test/data without ../shared."""
    folder = SHARED / "data" / "sessions"
    return sorted((folder if folder.is_dir() else ROOT / "test" / "data").glob("*.json"))


def load(path: Path) -> Messages:
    """The messages of one transcript file."""
    return json.loads(path.read_text(encoding="utf-8"))["messages"]


def generated(n: int, end: str | None = None, seed: int = 7) -> Messages | None:
    """A synthetic coding session of ``n`` messages from ../shared/bench/gen_session.py (None without it),
    ending on ``end`` ("tool" or "user") when given."""
    generator = SHARED / "bench" / "gen_session.py"
    if not generator.exists():
        return None
    command = [sys.executable, str(generator), "--messages", str(n), "--seed", str(seed)]
    command += ["--end", end] if end else []
    data = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return data["messages"] if isinstance(data, dict) else data
