"""Every figure's command in the docs runs from a clone: each ``bench/*.py`` the README, CHANGELOG, CONTRIBUTING,
docs/ and bench/README name has a quick form here, every flag they give it is one the script takes, and the quick
form runs to a Markdown table with nothing outside the repository (figures drawn into a temporary folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / n for n in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "bench/README.md")]
DOCS += sorted((ROOT / "docs").rglob("*.md"))
COMMAND = re.compile(r"(?:python3? )?bench/(\w+)\.py((?:[ \t]+(?:\[?--?[\w-]+\]?|[\w./<>=,-]+))*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")

# script -> the arguments of its quick form (seconds on the 2-core machine), or why it is not run here.
QUICK: dict[str, list[str] | str] = {
    "agent_shapes": ["--turns", "2"],  # 9 s
    "appends": ["--steps", "2"],  # 6 s
    "budget_use": [],  # 1 s
    "compaction": ["--latency", "0.01", "--concurrency", "2", "--window", "4096"],  # 3 s
    "diet": ["--tests", "test/py/test_diet.py"],  # 12 s
    "build_corpus": "the maintainer's rebuild of test/data/corpus from the sources test/data/corpus/SOURCES.md names "
    "(downloaded); the figures are measured on the corpus the repository carries (fit_heuristic, model_tokenizers)",
    "fidelity": ["--seeds", "1", "--summary-tokens", "64", "--threads", "1", "--only", "chat, facts first"],  # 12 s
    "first_token": ["--requests", "1", "--delay", "0.1"],  # 8 s
    "fit_heuristic": [],  # 5 s
    "gen_session": ["--messages", "20"],  # 0 s
    "model_tokenizers": [],  # 1 s
    "proxy": ["--requests", "3", "--only-latency"],  # 5 s
    "qwen_templates": "needs the Qwen families' own chat templates (a model's tokenizer_config.json from Hugging "
    "Face), which this repository cannot carry; test_qwen_renders_its_family_template_exactly checks the same "
    "renders against test/data/qwen",
    "real_agents": ["--agents", "opencode", "--turns", "2", "--windows", "16384"],  # 15 s
    "replay": ["--no-server", "--no-door", "--budgets", "8192"],  # 9 s
    "run": ["--tools-list"],  # 2 s (--quick --runs 1: minutes)
    "speed": ["--messages", "200", "--runs", "1", "--sweep", "200", "400"],  # 1 s
    "stall": ["--cases", "messages", "--messages", "2000"],  # 10 s
    "state": ["--turns", "3", "--archive", "100", "--queries", "5", "--no-redis"],  # 11 s
    "tokens": ["--runs", "1", "--no-server"],  # 7 s
    "transports": ["--calls", "3"],  # 11 s
    "workloads": "the sessions the others read (a module they import, not a command)",
}
NO_TABLE = {"gen_session"}  # prints a session as JSON, not a table


BENCH_TABLE = re.compile(r"^\| `(\w+)\.py([^`]*)`", re.MULTILINE)  # bench/README's rows name scripts bare


def documented() -> dict[str, set[str]]:
    """Each bench script the docs name, with the flags they give it anywhere."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        if path.exists():
            text = path.read_text(encoding="utf-8")
            table = BENCH_TABLE.finditer(text) if path.parent.name == "bench" else ()
            for match in [*COMMAND.finditer(text), *table]:
                found.setdefault(match.group(1), set()).update(FLAG.findall(match.group(2)))
    return found


def test_the_docs_name_benchmarks_and_each_has_a_quick_form() -> None:
    named = documented()
    assert {"run", "speed", "proxy", "stall"} <= set(named), sorted(named)  # the collector reads the docs
    assert sorted(set(named) - set(QUICK)) == [], "a documented benchmark needs a quick form in QUICK"
    assert sorted(n for n in named if not (ROOT / "bench" / f"{n}.py").exists()) == []


@pytest.mark.parametrize("name", sorted(n for n, flags in documented().items() if flags))
def test_every_documented_flag_is_one_the_script_takes(name: str) -> None:
    flags = documented()[name]
    run = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(f for f in flags if f not in run.stdout) == [], run.stdout


def quick_cases() -> list[object]:
    cases: list[object] = []
    for name in sorted(documented()):
        quick = QUICK.get(name, [])
        marks = [pytest.mark.skip(reason=quick)] if isinstance(quick, str) else []
        cases.append(pytest.param(name, quick, marks=marks, id=name))
    return cases


@pytest.mark.parametrize(("name", "arguments"), quick_cases())
def test_the_quick_form_runs_from_a_clone(name: str, arguments: list[str], tmp_path: Path) -> None:
    if name == "real_agents" and not (ROOT / "test/agents/node_modules").is_dir() and os.environ.get("CI") != "true":
        pytest.skip("the real agents are not installed (./test/test.sh installs them; CI fails without them)")
    environment = {**os.environ, "CONTEXT_SHRINK_BENCH_FIGURES": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [sys.executable, f"bench/{name}.py", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=environment,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    if name in NO_TABLE:
        assert run.stdout.strip(), run.stderr[-2000:]
    else:
        assert re.search(r"^\|.*\|\s*$\n^\|[-:| ]+\|\s*$", run.stdout, re.MULTILINE), run.stdout[-3000:]
    drawn = re.findall(r"^figure: (.+)$", run.stderr, re.MULTILINE)
    assert [f for f in drawn if not Path(f).is_relative_to(tmp_path)] == []  # docs/img holds the measured ones
