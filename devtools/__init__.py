"""Tools for cptune's developers, not shipped in the ``cptune`` package.

- :mod:`devtools.tiny`: tiny Llama models and tokenizers built locally, for the tests, the
  benchmarks and ``scripts/make_tiny_model.py`` (which builds ``examples/tiny-llama``).
- :mod:`devtools.docgen`: the generators of every generated documentation page;
  ``python -m devtools.docgen`` (from the repository root) rewrites them all.

Run from the repository root (the tests, ``python -m benchmarks`` and the scripts put it on
``sys.path``); nothing in ``src/cptune`` imports this package.
"""
