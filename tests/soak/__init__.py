"""The chaos soak harness (docs/soak.md): ``python -m tests.soak --help``."""
