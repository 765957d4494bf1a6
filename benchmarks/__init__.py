"""cptune's benchmark suite: what context parallelism buys and what it costs, measured side by side.

Run ``python -m benchmarks all`` (about ten minutes on 2 CPU cores) or one
benchmark (``python -m benchmarks memory``); ``--smoke`` runs every code path at
toy sizes in well under a minute. Results go to ``docs/benchmarks/results.json``
and the page ``docs/benchmarks.md`` is generated from them. ``benchmarks/gpu``
holds the GPU script, which is documented on that page and never run in CI.
"""
