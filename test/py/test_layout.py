"""The module's layout and its prose: each section uses only the ones above, the shells stay thin, the table
of contents, the docstring, CONTRIBUTING.md and docs/README.md say what the code is."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import context_shrink as cs

pytestmark = pytest.mark.core  # the fast loop: ./test/test.sh --fast

MODULE = Path(cs.__file__).read_text(encoding="utf-8")


REPO = Path(__file__).resolve().parents[2]


def test_each_section_uses_only_the_ones_above() -> None:
    lines = MODULE.splitlines()
    heads = [(i + 1, int(m.group(1))) for i, line in enumerate(lines) if (m := re.match(r"# (\d+)\. ", line))]
    assert [n for _, n in heads] == list(range(2, 2 + len(heads)))  # numbered in order, none missing

    def section(line: int) -> int:
        return max([n for start, n in heads if start <= line], default=1)

    tree = ast.parse(MODULE)
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
        for name in ast.walk(node):
            if isinstance(name, ast.Name) and name.id not in local and home.get(name.id, 0) > here:
                upward.append(
                    f"section {here} ({getattr(node, 'name', node.lineno)}) uses {name.id} (section {home[name.id]})"
                )
    assert upward == []


def test_the_shells_are_thin() -> None:
    """build_server only binds the config and registers the tools, which three registration functions
    define; each tool's body (signature and docstring aside) is at most 25 lines; the proxy's HTTP front is
    a class of short methods; no function in the module comes near 200 lines."""
    tree = ast.parse(MODULE)
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert max(f.end_lineno - f.lineno + 1 for f in functions) <= 120
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
    front = [f for f in top["ProxyFront"].body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert max(f.end_lineno - f.lineno + 1 for f in front) <= 40
    assert top["build_proxy"].end_lineno - top["build_proxy"].lineno + 1 <= 5


def test_all_is_the_public_api_the_tests_and_bench_use() -> None:
    assert [n for n in cs.__all__ if not hasattr(cs, n)] == []
    texts = [p.read_text(encoding="utf-8") for d in ("test/py", "bench", "examples") for p in (REPO / d).glob("*.py")]
    used = {name for text in texts for name in re.findall(r"(?<![\w.])cs\.([A-Za-z]\w*)", text)}
    assert sorted(used - set(cs.__all__)) == []


def test_the_table_of_contents_names_every_section() -> None:
    titles = re.findall(r"^# (\d+)\. ", MODULE, flags=re.MULTILINE)
    toc = cs.__doc__ or ""
    assert all(re.search(rf"(^|\s){n}\. ", toc) for n in titles)


NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
           "ten": 10, "eleven": 11, "twelve": 12}  # fmt: skip


def test_the_docstring_counts_and_names_the_tools() -> None:
    doc = cs.__doc__ or ""
    said = re.search(r"with (\w+) tools", doc)
    assert said and NUMBERS[said.group(1)] == len(cs.TOOL_NAMES), said
    assert [t for t in cs.TOOL_NAMES if f"``{t}``" not in doc] == []


def test_contributing_lists_the_sections_the_module_has() -> None:
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    listed = [int(n) for n in re.findall(r"(?:^|· )(\d+)\. ", text[text.index("## How the code is laid out") :], re.M)]
    heads = [1, *(int(n) for n in re.findall(r"^# (\d+)\. ", MODULE, re.M))]
    assert listed == heads, (listed, heads)


def test_docs_name_the_registration_functions_build_server_uses() -> None:
    tree = ast.parse(MODULE)
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_server")
    loop = next(n for n in ast.walk(build) if isinstance(n, ast.For))
    names = [e.id for e in loop.iter.elts]
    text = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    said = re.search(r"front door is (\w+) registration functions", text)
    assert said and NUMBERS[said.group(1)] == len(names) and all(f"`{n}`" in text for n in names), (said, names)


def test_no_standard_library_import_inside_a_function() -> None:
    tree = ast.parse(MODULE)
    inside = [
        (f.name, alias.name)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(f)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
        if ((node.module if isinstance(node, ast.ImportFrom) else alias.name) or "").split(".")[0]
        in sys.stdlib_module_names
    ]
    assert inside == []


def test_the_agent_is_a_store_class_not_a_string_switched_on() -> None:
    """Comparisons with an agent's name are inside its store class only (two may stand outside: the settings
    reader above section 13, and the tool's ``Literal``)."""
    tree = ast.parse(MODULE)
    stores = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Store")]
    inside = {id(node) for store in stores for node in ast.walk(store)}
    agents = {"claude", "codex", "opencode"}
    outside = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and id(node) not in inside
        for side in [node.left, *node.comparators]
        if isinstance(side, ast.Constant) and side.value in agents
    ]
    assert len(outside) <= 2, outside


def test_no_function_takes_more_than_twelve_parameters_but_the_tools() -> None:
    tree = ast.parse(MODULE)
    tools = {"estimate_context", "analyze_context", "trim_context", "prune_context", "compact_context"}
    wide = [
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name not in tools
        and len(f.args.args) + len(f.args.kwonlyargs) + len(f.args.posonlyargs) > 12
    ]  # fmt: skip
    assert wide == []
