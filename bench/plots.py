"""Figures for the benchmark scripts: matplotlib (the ``bench`` extra) drawing PNGs into ``docs/img/``.

Each script calls these after printing its tables; without matplotlib the figure is skipped, saying so, and
the tables are printed as before. ``progress`` draws the bar long runs show on stderr.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

FIGURES = Path(os.environ.get("CONTEXT_SHRINK_BENCH_FIGURES") or Path(__file__).resolve().parents[1] / "docs" / "img")
# (the docs test runs every benchmark's quick form with figures drawn elsewhere: docs/img holds the measured ones)
Item = TypeVar("Item")


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no figure: matplotlib is missing (pip install matplotlib, or the bench extra)", file=sys.stderr)
        return None
    plt.rcParams.update({"figure.dpi": 110, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "font.size": 10})  # fmt: skip
    return plt


def lines(name: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
          *, log: bool = False, hline: tuple[float, str] | None = None) -> Path | None:  # fmt: skip
    """A line per series (``label -> (xs, ys)``), log-log when ``log``; saved as ``docs/img/<name>.png``."""
    plt = _pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=4, label=label)
    if hline is not None:
        axes.axhline(hline[0], color="#c2410c", linestyle="--", linewidth=1.2, label=hline[1])
    if log:
        axes.set_xscale("log")
        axes.set_yscale("log")
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.legend(frameon=False, fontsize=9, loc="upper left")
    return _save(plt, figure, name)


def bars(name: str, title: str, ylabel: str, groups: Sequence[str], series: dict[str, Sequence[float]],
         *, hline: tuple[float, str] | None = None) -> Path | None:  # fmt: skip
    """Grouped bars: one group per ``groups`` entry, one bar per series; saved as ``docs/img/<name>.png``."""
    plt = _pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(9.5, 4.2))
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        axes.bar([g + k * width for g in range(len(groups))], values, width, label=label)
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    if hline is not None:
        axes.axhline(hline[0], color="#c2410c", linestyle="--", linewidth=1.2, label=hline[1])
    axes.set(title=title, ylabel=ylabel)
    axes.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(plt, figure, name)


def _save(plt, figure, name: str) -> Path:  # type: ignore[no-untyped-def]
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    print(f"figure: {path}", file=sys.stderr)
    return path


def progress(items: Iterable[Item], total: int, what: str = "cases") -> Iterator[Item]:
    """``items``, with a bar on stderr: how many of ``total`` are done and the time left at the pace so far."""
    started = time.monotonic()
    for done, item in enumerate(items):
        _bar(done, total, what, started)
        yield item
    _bar(total, total, what, started)
    print(file=sys.stderr)


def _bar(done: int, total: int, what: str, started: float) -> None:
    elapsed = time.monotonic() - started
    left = elapsed / done * (total - done) if done else None
    filled = round(30 * done / max(1, total))
    eta = f"{left / 60:.1f} min left" if left is not None else "time left unknown yet"
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what}, {elapsed / 60:.1f} min, {eta}   ",
          end="", file=sys.stderr, flush=True)  # fmt: skip
