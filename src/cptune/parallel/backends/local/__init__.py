"""``context_parallel_size: 1``: every rank attends over whole rows (whatever ``cp_backend`` says).

Not a ``cp_backend`` value, so it has no recipe keys and no row in the table:
:mod:`.policy` and :mod:`.runtime` are what the table's ``backend_for`` gives at cp=1, and
:mod:`.sharding` gives the model whole rows (with cptune's document-aware attention for
``causal: false``). Imports no torch.
"""
