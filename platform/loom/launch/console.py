"""What the torchrun agent writes to stderr: into `<run>/logs/torchrun-<host>.log`, and only
what a user needs onto the console.

The agent ends a stop by Ctrl-C or SIGTERM with its SignalException traceback (~40 lines),
and a failed worker group with a ChildFailedError box; a rank's uncaught exception arrives as
a `[rankN]:` traceback; restarts and shutdowns add the agent's own log lines. None of it is
the user's business on the console: Loom reports the outcome itself (summary table, one
paragraph per failure, naming the log). The workers share the agent's stderr, so the filter
keeps their other output (library warnings, say) on the console, and drops, from the first
traceback on, everything else (the rest of a failing launch's stderr is tracebacks and boxes),
and C++ log lines and stack frames (torch's TCPStore at a multi-node shutdown). What the user
does need from the agent, a restart after a lost rank, becomes one line of Loom's: the rank,
how it ended (exit code or signal), the restarts left, and the checkpoint the ranks resume
from. Every line, kept or not, goes to the log file.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
from pathlib import Path
from typing import IO

from loom.rundir.paths import RunDir

# torch's own log lines: "W1121 18:17:47.660000 32237 torch/distributed/elastic/...] message"
_AGENT_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/")
_TRACEBACK = re.compile(rb"^(\[rank\d+\]:)?\s*Traceback \(most recent call last\):")
_RANK_PREFIX = re.compile(rb"^\[rank\d+\]:")
# C++ (glog-style) log lines and a C++ exception's stack: "[W1123 22:29:11.2 TCPStore.cpp:125] ...",
# "Exception raised from ... (most recent call first):", "frame #3: ..."
_CPP_LINE = re.compile(rb"^(\[?[IWEF]\d{4} [\d:. ]+.*\.(cpp|cc|h|hpp):\d+\]|frame #\d+: |Exception raised from )")
_RANK_FAILED = re.compile(rb"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_RESTART = re.compile(rb"Worker group FAILED\. (\d+)/(\d+) attempts left; will restart worker group")


def agent_log(run_dir: Path) -> Path:
    """Per host: the nodes of a multi-node run share the run dir (appends over NFS interleave)."""
    return RunDir(run_dir).agent_log(socket.gethostname())


class StderrFilter:
    """Reads the agent's stderr pipe on a thread until every writer has closed it."""

    def __init__(self, pipe: IO[bytes], log_path: Path, console: IO[str] | None = None,
                 run_dir: Path | None = None) -> None:
        self.pipe, self.log_path, self.run_dir = pipe, log_path, run_dir
        self.failed: tuple[int, int, int] | None = None  # (local rank, pid, exit code) of the last failure
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
        return not (self.quiet or _AGENT_LINE.match(line) or _RANK_PREFIX.match(line) or _CPP_LINE.match(line))

    def restart_line(self, line: bytes) -> str | None:
        """Loom's line for the agent's restart after a failed rank (None for any other line)."""
        failed = _RANK_FAILED.search(line)
        if failed:
            code, rank, pid = (int(x) for x in failed.groups())
            self.failed = (rank, pid, code)
            return None
        restart = _RESTART.search(line)
        if not restart or self.failed is None:
            return None
        rank, pid, code = self.failed
        left, most = restart.groups()
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        return (f"loom: local rank {rank} (pid {pid}) {how}: torchrun restarts this node's ranks "
                f"({left.decode()} of {most.decode()} restarts left); they resume from {self._resume_point()}")

    def _resume_point(self) -> str:
        last = RunDir(self.run_dir).last_checkpoint if self.run_dir else None
        if last is None or not (last.is_symlink() or last.exists()):
            return "step 0 (no checkpoint yet)"
        return str(last.resolve() if last.is_symlink() else last)

    def _pump(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            for line in iter(self.pipe.readline, b""):
                log.write(line)
                log.flush()
                said = self.restart_line(line)
                if said:
                    self.console.write(said + "\n")
                    self.console.flush()
                if self.keep(line):
                    self.console.write(line.decode(errors="replace"))
                    self.console.flush()
                else:
                    self.dropped += 1
        self.pipe.close()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the pipe's end (an orphaned worker may hold it open: give up after `timeout`)."""
        self.thread.join(timeout)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
