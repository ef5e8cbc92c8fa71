"""Shared output of the benchmarks: a printed table and a JSON file with the same figures."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path


def summary(samples: list[float]) -> dict:
    """Median, mean, p90, min and max of timings given in seconds, reported in ms."""
    s = sorted(samples)
    return {
        "n": len(s),
        "median_ms": round(statistics.median(s) * 1e3, 3),
        "mean_ms": round(statistics.fmean(s) * 1e3, 3),
        "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 3),
        "min_ms": round(s[0] * 1e3, 3),
        "max_ms": round(s[-1] * 1e3, 3),
    }


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def write(name: str, results: dict, json_path: str | None) -> dict:
    doc = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": {"kernel": platform.release(), "cpus": __import__("os").cpu_count()},
        **results,
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1))
        print(f"\nwritten: {json_path}")
    return doc


def write_text_beside(json_path: str, text: str) -> str:
    """Write a benchmark's table to the ``.txt`` beside its JSON; returns the shared path
    prefix (``bench/results/NAME``), which its figures are named after."""
    prefix = json_path.rsplit(".", 1)[0]
    Path(prefix + ".txt").parent.mkdir(parents=True, exist_ok=True)
    Path(prefix + ".txt").write_text(text + "\n")
    return prefix
