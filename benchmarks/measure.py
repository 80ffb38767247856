# SPDX-License-Identifier: Apache-2.0
"""The measuring core every benchmark uses: rounds and their order, the spread of
per-round values, timed spans (wall clock, this process's CPU, the CPU meter's process
trees) and the result record. A library, not a script.

The contract, for every benchmark under benchmarks/:

- **Side by side.** A ratio divides two variants measured in the same run (the fork
  vs stock, routed experts on vs off, with vs without the rows), never a figure of
  this run by one of another run or of another host.
- **Rounds alternate.** In round i the variants run in `order(variants, i)`: as given
  in even rounds, reversed in odd ones (A B C, C B A, A B C, ...). Over each pair of
  rounds every variant's mean position is the same, so a drift of the host's speed
  over the run weighs on every variant alike. Warm-up rounds run first, in the same
  order, and are not kept.
- **Spread.** Per-round values are summarised by `spread`: their median, their
  lowest and highest, and the relative spread (highest - lowest) / median. The
  lowest of times is the estimate least moved by contention (other processes only
  add time), the median what a typical round saw; each benchmark says which one is
  its headline.
- **Ratios.** `ratios` pairs round i of one variant with round i of the other (the
  two ran next to each other) and summarises the per-round ratios the same way.
- **Result.** Each benchmark fills one `Result` (its name, what it ran with, its
  figures, its headline ratios) and writes it with `--json FILE` (`--json -`: to
  stdout) through `Result.emit`, so every benchmark's record reads the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.cpu_meter import CpuMeter, CpuUse

V = TypeVar("V", bound=Hashable)
R = TypeVar("R")


def order(variants: Sequence[V], round_index: int) -> list[V]:
    """The order the variants run in round `round_index`: as given in even rounds,
    reversed in odd ones (warm-up rounds have negative indices: -1 is odd)."""
    return list(variants) if round_index % 2 == 0 else list(variants)[::-1]


def run_rounds(variants: Sequence[V], rounds: int, run: Callable[[V, int], R],
               warmup: int = 0) -> dict[V, list[R]]:
    """`run(variant, round_index)` for every variant in `order` of each round:
    `warmup` rounds first (indices -warmup..-1, results dropped), then `rounds`
    kept rounds (0..rounds-1). Returns each variant's results in round order."""
    kept: dict[V, list[R]] = {variant: [] for variant in variants}
    for round_index in range(-warmup, rounds):
        for variant in order(variants, round_index):
            result = run(variant, round_index)
            if round_index >= 0:
                kept[variant].append(result)
    return kept


@dataclass(frozen=True)
class Spread:
    """Per-round values summarised: median, lowest, highest, how many."""

    median: float
    low: float
    high: float
    count: int

    @property
    def relative(self) -> float:
        """(high - low) / median; 0 when the median is 0."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def format(self, fmt: str) -> str:
        """``median (relative spread)``, e.g. ``1.038 (4.1%)``."""
        return f"{self.median:{fmt}} ({self.relative:.1%})"


def spread(values: Iterable[float]) -> Spread:
    """The spread of per-round values (at least one)."""
    values = list(values)
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def ratios(top: Sequence[float], bottom: Sequence[float]) -> Spread:
    """The spread of the per-round ratios top[i] / bottom[i] (paired by round)."""
    if len(top) != len(bottom):
        raise ValueError(f"{len(top)} rounds against {len(bottom)}: not paired")
    return spread(t / b for t, b in zip(top, bottom, strict=True))


def timed(work: Callable[[], R], clock: Callable[[], float] = time.perf_counter
          ) -> tuple[float, R]:
    """Seconds `work()` took on `clock` (the wall clock unless told), and its result."""
    start = clock()
    result = work()
    return clock() - start, result


@dataclass(frozen=True)
class Spent:
    """What one measured span cost: the metered process trees' CPU (none without a
    meter), this process's own CPU (the client's) and the wall clock, in seconds."""

    cpu: CpuUse | None
    own_cpu: float
    wall: float

    def __add__(self, other: Spent) -> Spent:
        cpu = (None if self.cpu is None or other.cpu is None else self.cpu + other.cpu)
        return Spent(cpu, self.own_cpu + other.own_cpu, self.wall + other.wall)


def spend(work: Callable[[], R], meter: CpuMeter | None = None) -> tuple[Spent, R]:
    """Run `work()` and measure it: the meter's trees, this process, the wall clock."""
    before = meter.snapshot() if meter is not None else None
    own, start = time.process_time(), time.perf_counter()
    result = work()
    wall, own = time.perf_counter() - start, time.process_time() - own
    cpu = meter.snapshot() - before if meter is not None and before is not None else None
    return Spent(cpu, own, wall), result


@dataclass
class Result:
    """One run of one benchmark: its name (`benchmarks.<module>`), what it ran with,
    every figure it printed and its headline ratios (name -> value; each divides two
    variants measured side by side in this run)."""

    benchmark: str
    setup: dict[str, Any]
    figures: Any = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        """The record as JSON; paths and other values JSON lacks as strings."""
        return json.dumps(asdict(self), indent=1, default=str, ensure_ascii=False)

    def emit(self, path: str | None) -> None:
        """Write the record to `path` (`-`: print it); nothing without a path."""
        if path is None:
            return
        if path == "-":
            print(self.to_json())
        else:
            Path(path).write_text(self.to_json() + "\n")


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Every benchmark's `--json FILE` (`-` for stdout): its `Result`."""
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the run's result record (benchmarks/measure.py) "
                        "as JSON to FILE ('-': stdout)")
