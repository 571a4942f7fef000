"""`loom eval RUN_DIR`: a run's checkpoint scored on benchmark tasks (lm-evaluation-harness)."""
