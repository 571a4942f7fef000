"""Tracking: loggers (CSV, wandb offline), the step recorder, summary.json."""
