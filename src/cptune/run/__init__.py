"""What wires the layers together, by role: the run's plan (:mod:`.plan`, :mod:`.memory_plan`), the
training runtime every process runs (:mod:`.training`), the launcher (:mod:`.launch`) and the other
commands (:mod:`.commands`)."""
