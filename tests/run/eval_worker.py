"""One rank of ``cptune evaluate``'s parity check: evaluate() for several recipes in one launch.

Usage: eval_worker.py OUT_DIR RECIPE[::CHECKPOINT] ...; writes ``OUT_DIR/rank{r}.json``
mapping each recipe file's stem to the metrics evaluate() returned on this rank (of the
base model, or of ``CHECKPOINT`` as ``cptune evaluate --checkpoint`` gives it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cptune.config.loader import load_recipe
from cptune.run.commands.evaluate import evaluate
from cptune.run.training.distributed import close_process_groups, read_dist_env


def main() -> None:
    out_dir, results = Path(sys.argv[1]), {}
    for argument in sys.argv[2:]:
        recipe, _, checkpoint = argument.partition("::")
        started = time.perf_counter()
        metrics = evaluate(load_recipe(recipe), checkpoint or None)
        # What the recipe costs the launch (loading, preparing, evaluating), for the test's report.
        results[Path(recipe).stem] = {**metrics, "worker_seconds": time.perf_counter() - started}
    (out_dir / f"rank{read_dist_env().rank}.json").write_text(json.dumps(results))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
