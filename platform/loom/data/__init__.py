"""Datasets: corpora become packed, memory-mapped token files; samplers are resumable."""
