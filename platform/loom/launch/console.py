"""What the torchrun agent writes to stderr: into `<run>/logs/torchrun-<host>.log`, and only
what a user needs onto the console.

The agent ends a stop by Ctrl-C or SIGTERM with its SignalException traceback (~40 lines),
and a failed worker group with a ChildFailedError box; a rank's uncaught exception arrives as
a `[rankN]:` traceback; restarts and shutdowns add the agent's own log lines. None of it is
the user's business on the console: Loom reports the outcome itself (summary table, one
paragraph per failure, naming the log). The workers share the agent's stderr, so the filter
keeps their other output (library warnings, say) on the console, and drops, from the first
traceback on, everything else (the rest of a failing launch's stderr is tracebacks and boxes).
Every line, kept or not, goes to the log file.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
from pathlib import Path
from typing import IO

# torch's own log lines: "W1121 18:17:47.660000 32237 torch/distributed/elastic/...] message"
_AGENT_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/")
_TRACEBACK = re.compile(rb"^(\[rank\d+\]:)?\s*Traceback \(most recent call last\):")
_RANK_PREFIX = re.compile(rb"^\[rank\d+\]:")


def agent_log(run_dir: Path) -> Path:
    """Per host: the nodes of a multi-node run share the run dir (appends over NFS interleave)."""
    return Path(run_dir) / "logs" / f"torchrun-{socket.gethostname()}.log"


class StderrFilter:
    """Reads the agent's stderr pipe on a thread until every writer has closed it."""

    def __init__(self, pipe: IO[bytes], log_path: Path, console: IO[str] | None = None) -> None:
        self.pipe, self.log_path = pipe, log_path
        self.console = console or sys.stderr
        self.quiet = False  # set at the first traceback: from then on, the log file only
        self.dropped = 0
        self.thread = threading.Thread(target=self._pump, name="loom-torchrun-stderr", daemon=True)

    def start(self) -> StderrFilter:
        self.thread.start()
        return self

    def keep(self, line: bytes) -> bool:
        if _TRACEBACK.match(line):
            self.quiet = True
        return not (self.quiet or _AGENT_LINE.match(line) or _RANK_PREFIX.match(line))

    def _pump(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            for line in iter(self.pipe.readline, b""):
                log.write(line)
                log.flush()
                if self.keep(line):
                    self.console.write(line.decode(errors="replace"))
                    self.console.flush()
                else:
                    self.dropped += 1
        self.pipe.close()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the pipe's end (an orphaned worker may hold it open: give up after `timeout`)."""
        self.thread.join(timeout)
