"""Loom: declarative, config-driven distributed training."""

__version__ = "0.1.0"
