"""The training runtime that runs in every process: :mod:`.train` wires data, model, backend, patches and
cptune's Trainer (:mod:`.trainer`, built by :mod:`.builder`), with its evaluation loop, checkpoints,
FSDP2 settings, optimizers, trackers and the loss watchdog."""
