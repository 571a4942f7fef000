"""Errors and exit codes: the one definition every stage and config group shares.

Exit codes are the CLI contract (docs/reference.md, "Exit codes"): 0 ok, 1 training failed, 2 invalid config or
usage, 3 plan infeasible, 143 preempted (a checkpoint was saved; run again to resume).
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_INFEASIBLE = 3
EXIT_PREEMPTED = 143
EXIT_INTERRUPTED = 130  # a command stopped by Ctrl-C that keeps its work (`loom data prepare`)


class ConfigError(Exception):
    """An invalid config or usage: the CLI prints the message and exits 2."""


class Unavailable(OSError):
    """A service the run reads from (object storage) did not answer within its retry budget: not
    a configuration error (the same command may succeed later, and a rank's restart may), so the
    CLI says it and exits 1, and a rank's failure is not classified config-like."""


class PlanInfeasible(Exception):
    """No layout fits (strategy=auto): the CLI prints the message and exits 3."""


def fail(key: str, value: Any, rule: str) -> None:
    """Refuse `key=value` with one paragraph saying the rule it breaks."""
    raise ConfigError(f"Invalid config: {key}={value!r}: {rule}.")


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        fail(key, value, rule)
