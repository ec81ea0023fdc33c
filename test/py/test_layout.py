"""The modules' layout and their prose: the core and its companions, each file's sections using only the ones
above, the core importing no companion at load time, thin shells, the table of contents, the docstring,
CONTRIBUTING.md and docs/README.md saying what the code is, and test modules that do not import each other."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import context_shrink as cs
import context_shrink_models as csm
import context_shrink_proxy as csp
import context_shrink_sessions as css
import context_shrink_state as cst
import context_shrink_wire as csw

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

REPO = Path(__file__).resolve().parents[2]
MODULE = Path(cs.__file__).read_text(encoding="utf-8")
ALIASES: dict[str, ModuleType] = {"cs": cs, "csm": csm, "csp": csp, "css": css, "cst": cst, "csw": csw}
COMPANION_FILES = sorted(REPO.glob("context_shrink_*.py"))
ALL_FILES = [REPO / "context_shrink.py", *COMPANION_FILES]


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imported_modules(tree: ast.Module) -> set[str]:
    """The modules a file imports at load time (its top-level statements)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_companions_are_the_ones_the_core_names() -> None:
    assert sorted(f"context_shrink_{name}.py" for name in cs.COMPANIONS) == [p.name for p in COMPANION_FILES]


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_each_section_uses_only_the_ones_above(path: Path) -> None:
    """Within each file; what a companion imports from the core counts as above everything in it."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    heads = [(i + 1, int(m.group(1))) for i, line in enumerate(lines) if (m := re.match(r"# (\d+)\. ", line))]
    assert [n for _, n in heads] == list(range(2, 2 + len(heads)))  # numbered in order, none missing

    def section(line: int) -> int:
        return max([n for start, n in heads if start <= line], default=1)

    tree = ast.parse(text)
    home: dict[str, int] = {}
    for node in tree.body:
        targets = [node] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else []
        targets += getattr(node, "targets", []) + [t for t in [getattr(node, "target", None)] if t]
        for target in targets:
            name = getattr(target, "name", None) or getattr(target, "id", None)
            if name:
                home.setdefault(name, section(node.lineno))
    upward = []
    for node in tree.body:
        here = section(node.lineno)
        local = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}  # a parameter is local too
        for name in ast.walk(node):
            if isinstance(name, ast.Name) and name.id not in local and home.get(name.id, 0) > here:
                upward.append(
                    f"section {here} ({getattr(node, 'name', node.lineno)}) uses {name.id} (section {home[name.id]})"
                )
    assert upward == []


def test_the_core_imports_no_companion_and_reaches_them_through_one_lookup() -> None:
    """The core names no companion in an import statement anywhere; ``companion`` imports them by name."""
    tree = ast.parse(MODULE)
    imports = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert [m for m in imports if m.startswith("context_shrink")] == []
    callers = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
    ]
    lookup = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "companion")
    assert callers and all(lookup.lineno <= line <= lookup.end_lineno for line in callers)


def test_importing_the_core_loads_no_companion_and_no_http_stack() -> None:
    script = (
        "import sys, context_shrink\n"
        "loaded = [m for m in sys.modules if m.startswith('context_shrink_') or m.split('.')[0]"
        " in ('starlette', 'uvicorn', 'h11')]\n"
        "print(sorted(loaded))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_each_companion_imports_the_core_and_the_companions_form_no_circle() -> None:
    graph: dict[str, set[str]] = {}
    for path in COMPANION_FILES:
        imports = imported_modules(parsed(path))
        assert "context_shrink" in imports, path.name
        graph[path.stem] = {m for m in imports if m.startswith("context_shrink_")}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"a circle: {' -> '.join((*trail, name))}"
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, (*trail, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_the_shells_are_thin() -> None:
    """build_server only binds the config and registers the tools, which the registration functions define;
    each tool's body (signature and docstring aside) is at most 25 lines; the proxy's HTTP front is a class of
    short methods; no function in any module comes near 200 lines."""
    for path in ALL_FILES:
        functions = [n for n in ast.walk(parsed(path)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        assert max(f.end_lineno - f.lineno + 1 for f in functions) <= 120, path.name
    tree = ast.parse(MODULE)
    top = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef | ast.ClassDef)}
    assert top["build_server"].end_lineno - top["build_server"].lineno + 1 <= 30
    tools = [
        f
        for shell in ("measure_tools", "history_tools", "text_tools", "compaction_tools", "session_tools")
        for f in ast.walk(top[shell])
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "tool" for d in f.decorator_list)
    ]
    assert len(tools) == len(cs.TOOL_NAMES)
    for tool in tools:
        body = tool.body[1:] if isinstance(tool.body[0], ast.Expr) else tool.body
        assert body[-1].end_lineno - body[0].lineno + 1 <= 25, tool.name
    proxy = {
        f.name: f
        for f in parsed(REPO / "context_shrink_proxy.py").body
        if isinstance(f, ast.FunctionDef | ast.ClassDef)
    }
    front = [f for f in proxy["ProxyFront"].body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert max(f.end_lineno - f.lineno + 1 for f in front) <= 40
    assert proxy["build_proxy"].end_lineno - proxy["build_proxy"].lineno + 1 <= 5


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_all_is_the_public_api_the_tests_and_bench_use(alias: str) -> None:
    module = ALIASES[alias]
    assert [n for n in module.__all__ if not hasattr(module, n)] == []
    texts = [p.read_text(encoding="utf-8") for d in ("test/py", "bench", "examples") for p in (REPO / d).glob("*.py")]
    used = {name for text in texts for name in re.findall(rf"(?<![\w.]){alias}\.([A-Za-z]\w*)", text)}
    assert sorted(used - set(module.__all__)) == []


def test_a_name_lives_in_one_module() -> None:
    """No companion's ``__all__`` repeats a name of the core's or another companion's."""
    seen: dict[str, str] = {}
    clashes = []
    for alias, module in ALIASES.items():
        for name in module.__all__:
            if name in seen:
                clashes.append((name, seen[name], alias))
            seen.setdefault(name, alias)
    assert clashes == []


def test_no_test_module_imports_another() -> None:
    tests = {p.stem for p in (REPO / "test" / "py").glob("test_*.py")}
    crossed = [
        (path.name, name)
        for path in (REPO / "test" / "py").glob("*.py")
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if name.split(".")[0] in tests
    ]
    assert crossed == []


def test_the_table_of_contents_names_every_section() -> None:
    titles = re.findall(r"^# (\d+)\. ", MODULE, flags=re.MULTILINE)
    toc = cs.__doc__ or ""
    assert all(re.search(rf"(^|\s){n}\. ", toc) for n in titles)
    assert [f"context_shrink_{name}" for name in cs.COMPANIONS if f"context_shrink_{name}" not in toc] == []


NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
           "ten": 10, "eleven": 11, "twelve": 12}  # fmt: skip


def test_the_docstring_counts_and_names_the_tools() -> None:
    doc = cs.__doc__ or ""
    said = re.search(r"with (\w+) tools", doc)
    assert said and NUMBERS[said.group(1)] == len(cs.TOOL_NAMES), said
    assert [t for t in cs.TOOL_NAMES if f"``{t}``" not in doc] == []


def test_contributing_lists_the_sections_the_module_has_and_each_companion() -> None:
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    laid_out = text[text.index("## How the code is laid out") :]
    listed = [int(n) for n in re.findall(r"(?:^|· )(\d+)\. ", laid_out, re.M)]
    heads = [1, *(int(n) for n in re.findall(r"^# (\d+)\. ", MODULE, re.M))]
    assert listed == heads, (listed, heads)
    assert [p.name for p in COMPANION_FILES if f"`{p.name}`" not in laid_out] == []


def test_docs_name_the_registration_functions_build_server_uses() -> None:
    tree = ast.parse(MODULE)
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_server")
    loop = next(n for n in ast.walk(build) if isinstance(n, ast.For))
    names = [e.id for e in loop.iter.elts]
    text = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    said = re.search(r"front door is (\w+) registration functions", text)
    assert said and NUMBERS[said.group(1)] == len(names) and all(f"`{n}`" in text for n in names), (said, names)


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_no_standard_library_import_inside_a_function(path: Path) -> None:
    inside = [
        (f.name, alias.name)
        for f in ast.walk(parsed(path))
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(f)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
        if ((node.module if isinstance(node, ast.ImportFrom) else alias.name) or "").split(".")[0]
        in sys.stdlib_module_names
    ]
    assert inside == []


def test_the_agent_is_a_store_class_not_a_string_switched_on() -> None:
    """Comparisons with an agent's name are inside its store class only, in every module (two may stand
    outside: the core's settings reader and the tool's ``Literal``)."""
    outside = []
    for path in ALL_FILES:
        tree = parsed(path)
        stores = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Store")]
        inside = {id(node) for store in stores for node in ast.walk(store)}
        outside += [
            (path.name, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and id(node) not in inside
            for side in [node.left, *node.comparators]
            if isinstance(side, ast.Constant) and side.value in {"claude", "codex", "opencode"}
        ]
    assert len(outside) <= 2, outside


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_no_function_takes_more_than_twelve_parameters_but_the_tools(path: Path) -> None:
    tools = {"estimate_context", "analyze_context", "trim_context", "prune_context", "compact_context"}
    wide = [
        f.name
        for f in ast.walk(parsed(path))
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name not in tools
        and len(f.args.args) + len(f.args.kwonlyargs) + len(f.args.posonlyargs) > 12
    ]  # fmt: skip
    assert wide == []
