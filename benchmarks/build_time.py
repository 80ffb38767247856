#!/usr/bin/env python3
"""Fork wheel build time, cold (empty base-wheel cache) and warm, per base variant.

    python -m benchmarks.build_time [--variants cpu cuda] [--repeat 1]

Each build runs `python -m tools.fork build` in a subprocess into a scratch directory.
Cold builds use a fresh cache directory, so they include pip's download; warm
builds reuse it. Prints one table, fastest of the repeats (benchmarks/measure.py);
the ratio column is warm / cold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.measure import Result, add_json_option, spread, timed

ROOT = Path(__file__).resolve().parent.parent


def timed_build(variant: str, cache: Path, out: Path) -> float:
    env = dict(os.environ, VLLM_FORK_CACHE=str(cache), VLLM_FORK_BASE=variant)
    seconds, _ = timed(lambda: subprocess.run(
        [sys.executable, "-m", "tools.fork", "build", "-o", str(out)], cwd=ROOT, env=env,
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=1)
    add_json_option(parser)
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}

    print(f"{'base':6} {'cold s':>8} {'warm s':>8} {'warm/cold':>10} {'wheel MB':>9}")
    for variant in args.variants:
        colds, warms, size = [], [], 0.0
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="fork-bench-") as tmp:
                cache, out = Path(tmp) / "cache", Path(tmp) / "out"
                colds.append(timed_build(variant, cache, out))
                for wheel in out.glob("*.whl"):
                    wheel.unlink()
                warms.append(timed_build(variant, cache, out))
                size = sum(w.stat().st_size for w in out.glob("*.whl")) / 1e6
        cold, warm = spread(colds).low, spread(warms).low
        figures[variant] = {"cold_s": cold, "warm_s": warm, "wheel_mb": size}
        print(f"{variant:6} {cold:8.1f} {warm:8.1f} {warm / cold:10.2f} {size:9.0f}")
    Result("benchmarks.build_time", vars(args), figures,
           {f"{variant} warm / cold": f["warm_s"] / f["cold_s"]
            for variant, f in figures.items()}).emit(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
