"""Fit the content-aware token heuristic against cl100k_base and print its error table.

    pip install -e '.[dev,bench]'
    python bench/fit_heuristic.py            # error table of the weights in context_shrink.py
    python bench/fit_heuristic.py --refit    # also print freshly fitted weights to paste into the module

Data: the samples of test/py/samples.py (prose, code, logs, minified JSON, base64, CJK, other scripts)
and every message of the transcripts in ../shared/data/sessions (or test/data). The fit is a
non-negative least squares on relative error, every content class weighted equally; the module then
multiplies by HEURISTIC_SAFETY so no whole transcript is undercounted by more than a few percent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from samples import samples  # noqa: E402
from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402


def transcripts() -> dict[str, list[str]]:
    out = {}
    for path in transcript_paths():
        texts = []
        for m in load(path):
            content = m.get("content")
            text = content if isinstance(content, str) else cs._plain_content(content)
            if text:
                texts.append(text)
        out[path.stem] = texts
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", action="store_true", help="fit new weights (needs numpy and scipy)")
    args = parser.parse_args()
    tok = cs.resolve_tokenizer("tiktoken:cl100k_base")
    if not tok.name.startswith("tiktoken:cl100k"):
        raise SystemExit(f"cl100k_base is needed as the reference: {tok.note}")
    classes = samples()
    sessions = transcripts()
    weights = list(cs.HEURISTIC_WEIGHTS + cs.HEURISTIC_NON_ASCII_WEIGHTS)
    if args.refit:
        import numpy as np
        from scipy.optimize import nnls

        rows, ys, groups = [], [], []
        for name, texts in [*classes.items(), *(("transcripts", t) for t in sessions.values())]:
            for text in texts:
                rows.append(cs.heuristic_features(text))
                ys.append(tok.count(text))
                groups.append(name)
        sizes = {g: groups.count(g) for g in set(groups)}
        x, y = np.array(rows), np.array(ys, float)
        scale = np.array([1 / sizes[g] for g in groups]) ** 0.5 / np.maximum(y, 1)
        fitted, _ = nnls(x * scale[:, None], y * scale)
        weights = [round(float(w), 4) for w in fitted]
        n = len(cs.HEURISTIC_WEIGHTS)
        print(f"HEURISTIC_WEIGHTS = {tuple(weights[:n])}\nHEURISTIC_NON_ASCII_WEIGHTS = {tuple(weights[n:])}\n")

    def estimate(text: str) -> float:
        return cs.HEURISTIC_SAFETY * sum(w * f for w, f in zip(weights, cs.heuristic_features(text), strict=True))

    def naive(text: str) -> float:
        return len(text) / 4

    print("| content | samples | cl100k tokens | heuristic ÷ cl100k | chars÷4 ÷ cl100k |")
    print("|---|---:|---:|---:|---:|")
    for name, texts in [*classes.items(), *((f"transcript: {k}", v) for k, v in sessions.items())]:
        ref = sum(tok.count(t) for t in texts)
        ours = sum(estimate(t) for t in texts)
        four = sum(naive(t) for t in texts)
        print(f"| {name} | {len(texts)} | {ref:,} | {ours / ref:.3f} | {four / ref:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
