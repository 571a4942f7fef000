"""Stage 6, worker: the per-rank entry point, `python -m loom.worker <run_dir>`.

The agent (loom.worker.agent, torchrun's) forks one per rank from a forkserver that has the
imports done (`forked_rank`); a 1-process run calls `run` in-process. A worker reads the
frozen config.yaml and never re-runs Hydra, so every rank, and every restart, trains the
same run in the same directory.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from loom.compose.hydra_options import apply_verbose
from loom.hardware.machine import usable_cores
from loom.rundir.config_file import load_frozen
from loom.rundir.lock import rank_lock
from loom.rundir.paths import RunDir
from loom.worker.failure import Progress, record_failure
from loom.worker.host_memory import keep_heap

log = logging.getLogger("loom")

# Lightning advice that does not apply to Loom's setup (it chooses workers per profile and
# its own sampler on purpose).
_QUIET = (
    r".*does not have many workers.*",
    r".*The number of training batches.*",
    r".*`use_distributed_sampler`.*",
    r".*Checkpoint directory .* exists and is not empty.*",
    r".*Experiment logs directory .* exists.*",
    r".*on_epoch=True.*",
    r".*your dataloader is not resumable.*",  # loom.data.position resumes it
    r".*It is recommended to use `self.log\(.*sync_dist=True`.*",
)


def setup_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to logs/rank-N.log; only rank 0 also talks to the console."""
    path = RunDir(run_dir).log(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rank != 0:
        # Quiet on other ranks: their stdout/stderr (C-level too) go to their log file.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s")
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    for name in ("loom", "pytorch_lightning", "lightning", "lightning_fabric", "deepspeed", "DeepSpeed"):
        lg = logging.getLogger(name)
        for h in [h for h in lg.handlers if isinstance(h, logging.FileHandler)]:
            lg.removeHandler(h)
            h.close()  # the previous in-process run's log file
        lg.addHandler(file_handler)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    apply_verbose([file_handler])  # hydra.verbose: those loggers at DEBUG
    # A sweep runs its 1-process trials in this process: drop the previous trial's console
    # handler, or every line is printed once per trial so far.
    log.handlers = [h for h in log.handlers if not getattr(h, "loom_console", False)]
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        console.loom_console = True
        log.addHandler(console)
    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    logging.captureWarnings(True)
    warn_log = logging.getLogger("py.warnings")
    warn_log.handlers = [h for h in warn_log.handlers if not isinstance(h, logging.FileHandler)]
    warn_log.addHandler(file_handler)


def quiet_progress_bars() -> None:
    """Third-party progress bars (tqdm: Hugging Face datasets' map, hub downloads, ...) stay off
    the console, where Loom logs its own progress line; Lightning's bar and model summary are off
    in the Trainer. Set before those libraries are imported (they read it then); a user's own
    setting wins."""
    for key in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")


def die_with_parent() -> None:
    """Under torchrun: SIGKILL if the agent (so the forkserver, this rank's parent) dies, instead of
    training on as an orphan (torchrun starts workers in their own sessions). The agent dies only
    when its launcher does (loom.launch kills it then) or crashes: the run's ranks go at once, as a
    lost machine's would, and a relaunch resumes from the last checkpoint (the ranks of a launcher
    killed with -9 used to checkpoint for up to 30 s while the same command, run again, trained
    beside them). A checkpointed stop is SIGTERM or Ctrl-C to the launcher, which the agent passes on."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    from loom import process

    process.die_with_parent(signal.SIGKILL)


def name_rank(run_id: str) -> None:
    """Under torchrun, this rank's title `loom[<run id>] rank R/W` (ps, top, nvidia-smi, `pgrep -f`)
    and comm name `loom-rank-R`: a forked rank's command line is otherwise its forkserver's. An
    in-process rank is the launcher, which titles itself (loom.launch)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    from loom import process

    rank = os.environ.get("RANK", "?")
    process.set_title(process.title(run_id, f"rank {rank}/{os.environ.get('WORLD_SIZE', '?')}"), f"loom-rank-{rank}")


def run(run_dir: Path) -> int:
    """Train the frozen run in `run_dir` on this rank; returns the process exit code. An
    exception is logged in full to logs/rank-N.log and recorded (loom.worker.failure), not
    printed: the launcher prints one paragraph from the record."""
    run_dir = Path(run_dir).resolve()
    cfg = load_frozen(RunDir(run_dir).config)
    die_with_parent()
    name_rank(str(cfg.run.id))
    rank = int(os.environ.get("RANK", 0))
    with rank_lock(run_dir, rank):  # while this process lives: no launcher takes the run (loom.rundir.lock)
        return _run(cfg, run_dir, rank)


def _run(cfg: Any, run_dir: Path, rank: int) -> int:
    """`run`'s body, inside the rank's hold of the run (its logging, threads, process group, fit)."""
    setup_logging(run_dir, rank)
    quiet_progress_bars()
    progress = Progress()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # The user's OMP_NUM_THREADS wins (the launcher sets cores // processes when it is unset).
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, usable_cores() // local_world))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    keep_heap(cfg.hardware.accelerator)  # no page faults per step on CPU (loom.worker.host_memory)
    try:
        import torch

        torch.set_num_threads(threads)
        from loom.worker.distributed import init_from_torchrun, shutdown
        from loom.worker.fit import fit

        _file_log(f"rank {rank} (pid {os.getpid()}) started, attempt "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}")
        init_from_torchrun(cfg.hardware.backend, cfg.hardware.get("timeout_init_s") or 600)
        rc = fit(cfg, run_dir, rank, progress)
        shutdown()
        return rc
    except Exception as e:
        return record_failure(run_dir, rank, e, progress)


def _file_log(message: str) -> None:
    """An INFO line for the rank's log file only (not rank 0's console)."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def forked_rank(run_dir: str) -> int:
    """A rank forked by loom.worker.agent: torchrun reads a failed rank from its exit code and
    a finished one from its return value, as for `python -m loom.worker`."""
    from loom.worker.preload import adopt_rank, cuda_untouched, leave_agents_pipe, resume_collection

    leave_agents_pipe()
    resume_collection()
    adopt_rank()
    if not cuda_untouched():  # a preloaded module initialized CUDA: no forked rank could use it
        raise RuntimeError("CUDA was initialized in the ranks' forkserver (loom.worker.preload imports a "
                           "module that touches the GPU at import); forked ranks cannot use it")
    rc = run(Path(run_dir))
    if rc:
        sys.exit(rc)
    _exit_soon_after_return()
    return rc


RETURN_GRACE_S = 2.0


def _exit_soon_after_return() -> None:
    """torchrun's wrapper puts a forked rank's return value into a pipe (written at once) and
    then waits for the agent to have read every rank's: forever when the agent is shutting down
    instead (a SIGTERMed launcher's checkpointed stop: the agent waits for its ranks to exit,
    120 s, then kills them) or gone. A finished rank exits RETURN_GRACE_S after returning, when
    nothing else has ended it; its value is in the pipe either way."""
    import threading
    import time

    def exit_later() -> None:
        time.sleep(RETURN_GRACE_S)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=exit_later, name="loom-exit-after-return", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m loom.worker <run_dir>", file=sys.stderr)
        return 2
    return run(Path(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
