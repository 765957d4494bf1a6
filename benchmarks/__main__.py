"""``python -m benchmarks [all | memory balance overhead data backends] [--smoke] [--out DIR]``.

Runs the chosen benchmarks in order, printing progress to stderr, then merges
their results into ``OUT/benchmarks/results.json`` (sections not run keep their
last results) and regenerates ``OUT/benchmarks.md`` from it. A benchmark that
fails is recorded as failed and the others still run; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import backends, balance, data_bench, features, memory, overhead, sharding
from benchmarks.common import REPO, Progress, Settings, machine_info
from benchmarks.gpu.docs import gpu_section, load_gpu_results
from benchmarks.report import render_page, write_chart

MODULES = {m.NAME: m for m in (memory, balance, overhead, data_bench, backends, sharding, features)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Run cptune's benchmarks and write the results page."
    )
    parser.add_argument(
        "benchmarks",
        nargs="*",
        default=["all"],
        metavar="BENCHMARK",
        help=f"all, or any of: {', '.join(MODULES)}",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, one repeat: checks that everything runs"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for benchmarks.md and benchmarks/ (default: docs, or outputs/ with --smoke)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="scratch folder to use and keep (default: a temporary one)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the page from the existing results; run nothing"
    )
    args = parser.parse_args(argv)
    names = list(MODULES) if "all" in args.benchmarks else args.benchmarks
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from all, {', '.join(MODULES)}")
    args.names = names
    if args.out is None:
        args.out = REPO / ("outputs/benchmarks-smoke" if args.smoke else "docs")
    return args


def _preload() -> None:
    """Import the heavy libraries once, in this thread, before benchmarks run in threads.

    Also gives tqdm its class lock for good. datasets loads files through tqdm's
    ``thread_map``, whose ``ensure_lock`` deletes the lock on exit when it created it.
    Two benchmarks preparing data in threads at once then raced: one deleted the lock
    the other was using ("'tqdm' object has no attribute '_lock'", seen in the smoke run).
    A lock that exists beforehand is kept.
    """
    import datasets  # noqa: F401
    import transformers  # noqa: F401
    from tqdm.std import tqdm

    import cptune.data.prepare
    import cptune.models.loading  # noqa: F401

    tqdm.get_lock()


def render_results_page(results: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The page ``benchmarks.md`` rendered from ``results``, and its charts (file name → SVG text).

    Runs nothing; ``python -m devtools.docgen`` calls it with the committed results.
    """
    charts: dict[str, str] = {}

    def save_chart(name: str, svg: str) -> str:
        charts[name] = svg
        return f"benchmarks/{name}"

    return render_page(results, MODULES, save_chart, gpu_section(load_gpu_results())), charts


def write_page(results: dict[str, Any], out: Path, assets: Path) -> None:
    """``out/benchmarks.md`` and its charts (in ``assets``) from ``results``."""
    page, charts = render_results_page(results)
    save_chart = write_chart(assets, "benchmarks")
    for name, svg in charts.items():
        save_chart(name, svg)
    (out / "benchmarks.md").write_text(page)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = "python -m benchmarks " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="cptune-bench-"))
    progress = Progress(quiet=args.quiet)
    settings = Settings(smoke=args.smoke, work_dir=work, progress=progress)
    assets = args.out / "benchmarks"
    results_path = assets / "results.json"
    results: dict[str, Any] = {"sections": {}}
    if results_path.exists():
        results = json.loads(results_path.read_text())
    if args.render_only:
        if not results_path.exists():
            raise SystemExit(f"no results to render: {results_path} does not exist")
        write_page(results, args.out, assets)
        return 0
    load_before = os.getloadavg()
    started, started_at = time.perf_counter(), now()

    def run_one(name: str) -> dict[str, Any]:
        progress(name, "starting")
        t0, meta = time.perf_counter(), {"command": command, "started": now()}
        try:
            section: dict[str, Any] = {"result": MODULES[name].run(settings)}
        except Exception as err:  # record it, run the rest, fail at the end
            section = {"error": f"{type(err).__name__}: {err}"[-4000:]}
            progress(name, f"FAILED: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        section["meta"] = {**meta, "seconds": time.perf_counter() - t0}
        progress(name, f"done in {section['meta']['seconds']:.0f} s")
        return section

    try:
        if args.smoke:
            # Smoke numbers mean nothing, so the benchmarks may share the cores: run them together.
            _preload()
            with ThreadPoolExecutor(max_workers=len(args.names)) as pool:
                sections = dict(zip(args.names, pool.map(run_one, args.names), strict=True))
        else:
            sections = {name: run_one(name) for name in args.names}
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["sections"].update(sections)
    failed = [name for name, section in sections.items() if "error" in section]
    results["run"] = {
        "command": command,
        "started": started_at,
        "seconds": time.perf_counter() - started,
        "smoke": args.smoke,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "machine": machine_info(),
    }
    assets.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    write_page(results, args.out, assets)
    progress(
        "suite", f"wrote {args.out / 'benchmarks.md'} and {results_path} in {results['run']['seconds']:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
