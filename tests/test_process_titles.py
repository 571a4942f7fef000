"""Process titles: an operator finds rank 3 of run X with ps, top, nvidia-smi or `pgrep -f`
(loom.process.set_title). A forked rank's command line would otherwise be its forkserver's.
The live ranks, forkserver, agent and launcher of a real run are checked in
tests/test_checkpoints.py (test_sigkill_under_async_checkpoints_resumes_bit_identical)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

# In a child: title itself, report, wait; then title itself for a while and report again.
CHILD = """
import sys
from loom import process
process.set_title(process.title(sys.argv[1], "rank 1/2"), "loom-rank-1")
print("titled", flush=True)
sys.stdin.readline()
with process.titled(process.title(sys.argv[1], "launcher"), "loom-launcher"):
    print("launcher", flush=True)
    sys.stdin.readline()
print("restored", flush=True)
sys.stdin.readline()
"""


def _cmdline(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _step(child: subprocess.Popen, expect: str) -> None:
    assert child.stdout.readline().strip() == expect
    assert child.poll() is None


def test_a_title_is_what_ps_and_pgrep_see_and_titled_gives_the_old_one_back():
    """Catches: a title set only as comm (15 bytes: `loom[8ffef07017`, no rank), argv left as the
    interpreter's, the comm name lost to setproctitle's, and an in-process launcher (a sweep runs
    several runs in turn) left with the last run's title."""
    run_id = uuid.uuid4().hex[:10]  # nothing else on the machine has this title
    child = subprocess.Popen([sys.executable, "-c", CHILD, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        _step(child, "titled")
        assert _cmdline(child.pid) == [f"loom[{run_id}] rank 1/2"]
        assert _comm(child.pid) == "loom-rank-1"
        assert _pgrep(rf"^loom\[{run_id}\] rank 1/2$") == [child.pid]
        ps = subprocess.run(["ps", "-o", "args=", "-p", str(child.pid)], capture_output=True, text=True).stdout
        assert ps.strip() == f"loom[{run_id}] rank 1/2"
        child.stdin.write("\n")
        child.stdin.flush()
        _step(child, "launcher")
        assert _cmdline(child.pid) == [f"loom[{run_id}] launcher"] and _comm(child.pid) == "loom-launcher"
        child.stdin.write("\n")
        child.stdin.flush()
        _step(child, "restored")
        assert _cmdline(child.pid) == [f"loom[{run_id}] rank 1/2"] and _comm(child.pid) == "loom-rank-1"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
