"""Attention mechanisms: one file per mechanism, each with its config dataclass and ``MECHANISM``."""
