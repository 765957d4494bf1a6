"""The launcher: checks before any process starts or any weight loads (:mod:`.preflight`), then the
processes of a launch (:mod:`.processes`)."""
