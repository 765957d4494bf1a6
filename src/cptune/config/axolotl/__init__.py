"""Axolotl compatibility: the keys Axolotl recipes carry and what cptune makes of them.

:mod:`.schema` lists every key Axolotl's schema defines (to tell an Axolotl key from a typo),
:mod:`.keys` the ones cptune refuses with what to do instead, :mod:`.mapped` the keys cptune
accepts and maps (a key group of the recipe), :mod:`.fsdp1` Axolotl's FSDP1 form, :mod:`.rules`
the rules over them and :mod:`.notes` what ``cptune validate`` says where a key means something
else in cptune.
"""
