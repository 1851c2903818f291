"""What the patch sandbox costs: the wall time to start a patch's worker and load a
small patch (``Worker.load``), in bubblewrap and unsandboxed (docs/overlays.md).

    python bench/patch_start.py               # ~5 s
    python bench/patch_start.py --rounds 30

A worker starts at install, at a patch's first use on a process and after it died; that
time is outside every hook's ``--overlay-timeout``, so this is the cost of those moments,
not of a hook call (a hook call is one frame each way over the worker's pipes, the same
in both). The first start of each mode includes the launcher's one probe of the sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.proxy.overlays.bwrap import Launcher  # noqa: E402
from tracetap.proxy.overlays.workers import Confinement, Limits, Worker  # noqa: E402

SOURCE = "async def before_model(request, state):\n    return None\n"


async def starts(mode: str, rounds: int) -> list[float]:
    launcher = Launcher(mode)
    times = []
    for _ in range(rounds + 1):
        worker = Worker("bench", SOURCE, Confinement(Limits(), launcher))
        started = time.perf_counter()
        await worker.load()
        times.append(time.perf_counter() - started)
        await worker.kill()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"{'sandbox':<12} {'first ms':>9} {'median ms':>10} {'max ms':>7}")
    for mode in ("bwrap", "unsandboxed"):
        first, *rest = asyncio.run(starts(mode, args.rounds))
        print(f"{mode:<12} {first * 1000:>9.0f} {statistics.median(rest) * 1000:>10.0f} "
              f"{max(rest) * 1000:>7.0f}")


if __name__ == "__main__":
    main()
