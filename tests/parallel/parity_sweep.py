"""The fp32 parity cases over other data seeds: how close each comes to its limit, and what the fp32 twins cost.

The parity tests run each case with one seed (``seed`` 11). This script runs a launch's fp32 cases
(tests/parallel/test_parity.py's ``SPAWNS``, or test_ulysses_parity.py's two launches) once per seed and
prints, per case, the worst quantity's distance over its limit under the fp32 check
(``fp32_excesses`` and, for preference cases, ``preference_metric_excesses``: the farthest of the fp32
reference and its twins, tests/numerics.py's ``FP32_TWINS_FACTOR``) beside the rule before (the fp32
reference's distance alone, 16x: :func:`rule_before`), and the CPU seconds of the case's twins. Planted
cases must land above 1, the others below. From the repository root::

    python -m tests.parallel.parity_sweep cp2 11 12 13          # test_parity.py's cp=2 launch, 3 seeds
    python -m tests.parallel.parity_sweep ulysses-cp2 11        # test_ulysses_parity.py's 2-process launch

Nothing in ``src/`` or the tests imports this.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.dist_utils import run_ranks
from tests.numerics import ULP_FLOOR, loss_sum_floor
from tests.parallel import test_parity

#: The rule before the twins (issue 26): a path under test at most this many times as far from float64 as the fp32
#: reference's one draw lands, plus a floor; for comparison only (tests/numerics.py's ``FP32_TWINS_FACTOR``).
SINGLE_DRAW_FACTOR = 16.0


def launch(name: str) -> tuple[Path, list[str], int, list[dict]]:
    """The worker, its leading arguments, the world size and the fp32 cases of a launch."""
    if name.startswith("ulysses-"):
        from tests.parallel import test_ulysses_parity as ulysses

        world = {"ulysses-cp2": 2, "ulysses-cp4": 4}[name]
        cases = (
            ulysses.CP2_CASES
            + ulysses.PREFERENCE_CP2_CASES
            + ulysses.WINDOW_CP2_CASES
            + ulysses.MOE_CP2_CASES
            + ulysses.SINK_CP2_CASES
            if world == 2
            else ulysses.CP4_CASES
            + ulysses.DP2_CP2_CASES
            + ulysses.PREFERENCE_CP4_CASES
            + ulysses.PREFERENCE_DP2_CP2_CASES
        )
        return ulysses.WORKER, [], world, [c for c in cases if not c.get("bf16")]
    world, cp, cases = test_parity.SPAWNS[name]
    return test_parity.WORKER, [str(cp)], world, [c for c in cases if not c.get("bf16")]


def rule_before(r: dict) -> float:
    """The worst distance over its limit under the rule before: the fp32 reference's distance alone, 16x."""
    floors = r.get("loss_floors") or [loss_sum_floor(t) for t in r["targets"]]
    rel = test_parity.rel

    def excess(error: float, reference_error: float, floor: float = ULP_FLOOR) -> float:
        return error / (SINGLE_DRAW_FACTOR * reference_error + floor)

    losses = zip(r["cp_losses"], r["ref_losses"], r["ref64_losses"], floors, strict=True)
    excesses = [excess(rel(cp, ref64), rel(ref, ref64), floor) for cp, ref, ref64, floor in losses]
    return max(excesses + [excess(r["grad_errors"][n], e) for n, e in r["ref_grad_errors"].items()])


def worst(r: dict) -> float:
    """The worst distance over its limit under the fp32 check (losses, gradients, preference metrics)."""
    excesses = list(test_parity.fp32_excesses(r).values())
    if "ref64_metrics" in r:
        excesses += list(test_parity.preference_metric_excesses(r).values())
    return max(excesses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("launch", help="cp2, cp4, dp2xcp2 (test_parity.py) or ulysses-cp2, ulysses-cp4")
    parser.add_argument("seeds", nargs="+", type=int)
    args = parser.parse_args()
    worker, leading, world, cases = launch(args.launch)
    for seed in args.seeds:
        seeded = [{**c, "seed": seed} for c in cases]
        with tempfile.TemporaryDirectory() as out:
            results = run_ranks(worker, world, Path(out), *leading, json.dumps(seeded), timeout=3600)
        for case in seeded:
            per_rank = [r[case["name"]] for r in results]
            seconds = [t["seconds"] for t in per_rank[0]["fp32_twins"]]
            print(
                f"seed {seed} {case['name']:48s} {max(worst(r) for r in per_rank):9.3g} "
                f"before {max(rule_before(r) for r in per_rank):9.3g} "
                f"twins {len(seconds)} cpu {sum(seconds):.2f}s (largest {max(seconds, default=0):.2f}s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
