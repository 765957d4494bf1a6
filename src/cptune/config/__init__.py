"""The recipe: its keys by domain, the rules across them, and loading it from YAML.

:mod:`.recipe` composes the key groups (:mod:`.model`, :mod:`.data`, :mod:`.adapter`,
:mod:`.training`, :mod:`.parallelism`, each backend's, :mod:`.axolotl`'s) into :class:`~.recipe.Recipe`;
:mod:`.rules` lists the rules across keys; :mod:`.loader` reads, overrides and validates a recipe.
"""
