"""cptune: fine-tune language models on very long sequences with exact context parallelism."""

__version__ = "0.1.0"
