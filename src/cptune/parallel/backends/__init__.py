"""One module per context-parallel backend, behind the small interface in ``base``."""
