"""A tiny random-weight llama GGUF and a real llama.cpp server (PyPI ``xllamacpp``) for the tests.

Recipe from ``shared/docs/llama-server.md``: byte-level GPT-2 tokenizer with a few hundred merges learned
from a built-in text, ChatML template, weights N(0, 0.02), logits pushed toward printable ASCII so replies
stay valid UTF-8. Deterministic for a given seed; writes ~1 MB in well under a second.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The user asked the assistant to read the file, "
    "run the tests and fix the failing function. def main(): return 0. import os, sys, json. "
    "error: expected value at line 1 column 2. assert result == expected. summary of the conversation: "
    "the goal, the decisions, the files touched, the commands run and the next steps. "
) * 4


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            codes.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in codes], strict=True))


def _learn_merges(text: str, count: int) -> list[tuple[str, str]]:
    b2u = _bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in (w if i == 0 else " " + w).encode()) for i, w in enumerate(text.split(" ")) if w
    )
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, freq in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += freq
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        new_words: collections.Counter[tuple[str, ...]] = collections.Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += freq
        words = new_words
    return merges


def write_tiny_gguf(path: Path, n_ctx_train: int = 2048, seed: int = 0) -> Path:
    """Write the tiny model to ``path`` and return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    printable = [32 <= b < 127 for b in range(256)]
    merges = _learn_merges(CORPUS, 300)
    for a, b in merges:
        tokens.append(a + b)
        printable.append(True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bos = len(tokens)
    tokens += specials
    printable += [False, False, False]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    n_vocab, n_embd, n_layer, n_head, n_ff = len(tokens), 64, 2, 2, 256

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("context-shrink-tiny")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(bos + 2)
    w.add_eot_token_id(bos + 2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def rand(*shape: int) -> Any:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    embd = rand(n_vocab, n_embd)
    embd[:, 0] = 1.0
    w.add_tensor("token_embd.weight", embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    out = rand(n_vocab, n_embd)
    out[:, 0] = np.where(np.array(printable), 1.0, -1.0).astype(np.float32)
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(
    model: Path, n_ctx: int = 2048, alias: str = "tiny", threads: int = 1, grammar: str | None = None
) -> Iterator[str]:
    """Serve ``model`` with llama.cpp's own server on 127.0.0.1; yields the base URL (ending in ``/v1``).
    A server-wide ``grammar`` (GBNF) makes every reply short and deterministic."""
    import httpx2
    import xllamacpp

    port = free_port()
    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = n_ctx
    params.n_parallel = 1
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.model_alias = {alias}
    params.endpoint_slots = True
    params.ui = False
    if grammar is not None:
        rule = xllamacpp.CommonGrammar()
        rule.grammar = grammar
        rule.type = xllamacpp.common_grammar_type.COMMON_GRAMMAR_TYPE_USER
        params.sampling.grammar = rule
    server = xllamacpp.Server(params)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("llama.cpp server did not become healthy within 60 s")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        del server
