"""A rank's exception: classified, recorded, logged in full to its own log, never printed.

Deterministic failures are not restarted, at any step. A config-like exception (TypeError,
ValueError, LookupError (IndexError, KeyError), ImportError, AttributeError,
NotImplementedError, ConfigError; the root cause when Hydra wraps it), or a RuntimeError that
says a shape, size, index or dtype does not fit (a user's module: "mat1 and mat2 shapes cannot be
multiplied"), is a configuration, code or data error: the same inputs raise it again, and a
restart resumes from the last checkpoint onto the same steps and batches (exact resume), so it
would only repeat it, at step 0 or at step 5000. A communication error (torch's DistError
family, NCCL/Gloo, a store or socket) or an out-of-memory error is not, whatever its message
says. torchrun restarts a worker group whenever a worker
exits non-zero (`--max-restarts`) and has no "do not restart" exit code, so such a rank writes
its record and exits 0; the group then ends without a restart, and the launcher, seeing the
record (loom.rundir.failures), reports the failure and exits 1. A rank whose own error is not
config-like but comes right after a peer's deterministic failure (its collective lost the
peer) is collateral and exits 0 too. Anything else (a NaN, an NCCL error, a killed peer)
exits 1, and torchrun restarts the group from the last checkpoint.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.errors import EXIT_FAILED, EXIT_OK, ConfigError
from loom.rundir.failures import read_failures, write_failure
from loom.rundir.paths import RunDir

CONFIG_LIKE = (TypeError, ValueError, LookupError, ImportError, AttributeError, NotImplementedError, ConfigError)
# torch's RuntimeError messages for tensors that do not fit together (shapes, sizes, dtypes).
_MISFIT = re.compile(r"shape|size mismatch|mismatched.sizes|sizes? of tensors|must match the size|dimension|dtype|scalar type|"
                     r"expected .* but (got|found)|view size is not compatible|index .* out of (range|bounds)", re.I)
_TRANSIENT = re.compile(r"nccl|gloo|c10d|socket|connection|timed? ?out|store|out of memory|cuda error|"
                        r"peer|broken pipe", re.I)
PEER_WAIT_S = 2.0  # how long a non-config failure waits for a peer's deterministic record
_LOOM = str(Path(__file__).resolve().parents[1])
_LIBRARY = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


@dataclass
class Progress:
    """How far this rank's attempt got; fit() keeps it current, the failure record reads it."""

    phase: str = "starting the rank"
    start_step: int = 0
    trainer: Any = None
    started: float = field(default_factory=time.time)

    def step(self) -> int:
        return max(int(self.trainer.global_step) if self.trainer is not None else 0, self.start_step)

    def before_first_step(self) -> bool:
        return self.step() <= self.start_step


def is_code_error(exc: BaseException) -> bool:
    """A configuration or code error: the same inputs raise it again (see the module docstring)."""
    if isinstance(exc, CONFIG_LIKE):
        return True
    if not isinstance(exc, RuntimeError) or type(exc).__name__.startswith(("Dist", "OutOfMemory")):
        return False
    text = str(exc)
    return bool(_MISFIT.search(text)) and not _TRANSIENT.search(text)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a wrapper was raised `from` (Hydra's InstantiationException, ...)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def where(exc: BaseException) -> str | None:
    """file:line of the innermost frame in user or Loom code (not the stdlib or a library)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        name = frame.filename
        if name.startswith(_LOOM) or not (name.startswith("<") or name.startswith(_LIBRARY)):
            return f"{name}:{frame.lineno}, in {frame.name}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _log_traceback(log_path: Path, rank: int, exc: BaseException) -> None:
    """The full traceback, into the rank's log only (never the console)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(log_path, "a") as f:
        f.write(f"{stamp} [rank {rank}] loom ERROR: rank {rank} failed\n{text}")


def _peer_failed_deterministically(run_dir: Path, progress: Progress) -> bool:
    """Another rank of this attempt recorded a deterministic failure (waits briefly for it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    deadline = time.monotonic() + PEER_WAIT_S
    while True:
        if any(r.get("deterministic") and not r.get("collateral")
               for r in read_failures(run_dir, progress.started)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def record_failure(run_dir: Path, rank: int, exc: BaseException, progress: Progress) -> int:
    """Log and record this rank's exception; the process's exit code (see the module docstring)."""
    log_path = RunDir(run_dir).log(rank)
    _log_traceback(log_path, rank, exc)
    cause = root_cause(exc)
    deterministic = is_code_error(cause)
    collateral = not deterministic and _peer_failed_deterministically(run_dir, progress)
    message = " ".join(str(cause).split()) or repr(cause)
    record = {
        "type": type(cause).__name__, "message": message[:600], "rank": rank, "step": progress.step(),
        "log": str(log_path), "where": where(cause), "phase": progress.phase,
        "before_first_step": progress.before_first_step(), "deterministic": deterministic or collateral,
        "collateral": collateral, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "host": os.uname().nodename, "pid": os.getpid(), "time": time.time(),
    }
    try:
        write_failure(run_dir, record)
    except OSError as e:  # the run dir is gone or full: the log holds what can be said
        print(f"loom: rank {rank}: could not record the failure ({e})", file=sys.stderr)
    if not (deterministic or collateral):
        return EXIT_FAILED
    _leave_process_group()
    # Under torchrun exit 0, which does not restart the group (the launcher reports the record).
    return EXIT_OK if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_FAILED


def _leave_process_group() -> None:
    """Tear the group down without a barrier (a peer may be gone), so the exit is clean."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "torch" not in sys.modules:
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the record is written
        pass
