"""``cp_backend: toy``: a fifth backend that exists only in a test, to show what adding one takes.

``tests/parallel/backends/test_new_backend.py`` copies ``src/cptune`` into a temporary folder, puts
this package there as ``cptune/parallel/backends/toy/`` and adds its row to the backend table; nothing
else changes. The package follows the layout every backend has (``__init__`` names it and its keys,
``keys``, ``policy``, ``runtime``); ``upstream`` stands in for a library its patch changes.
"""

NAME = "toy"

__all__ = ["NAME"]
