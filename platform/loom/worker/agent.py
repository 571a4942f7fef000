"""The torchrun agent of a multi-process run: `python -m loom.worker.agent <torchrun options> <run_dir>`.

torch.distributed.run's own elastic agent (the same options, rendezvous, restarts, signals and
exit codes), with one difference in how it starts ranks. torchrun runs `python -m loom.worker`
once per rank, and every rank imports torch, Lightning and Loom again, all at once on the same
cores. Here the agent starts a forkserver first (`multiprocessing`'s, with `loom.worker.preload`
as its preload) and forks each rank from it, imports done; the forkserver imports while this
process imports torch and meets the rendezvous. It is torchrun's documented function-entrypoint
path (`elastic_launch` with `start_method="forkserver"`): a restart forks fresh ranks from the
same forkserver, the agent's SIGTERM reaches each rank, and a rank's exit code is torchrun's.

A rank's parent is the forkserver, which exits with the agent (once the ranks let go of the
agent's liveness pipe: `loom.worker.preload.leave_agents_pipe`), so a rank's parent-death signal
(loom.worker.main.die_with_parent) still follows the agent. A forked rank's command line would
be the forkserver's: each process titles itself instead (loom.process.set_title), `loom[<run id>]
agent`, `... forkserver` and `... rank R/W` (comm names loom-agent, loom-forkserver, loom-rank-R);
a rank's pid is also in its log (`logs/rank-N.log`, "rank N (pid P) started").
"""

from __future__ import annotations

import sys
from pathlib import Path

PRELOAD = ["loom.worker.preload"]


def name_agent(run_dir: str) -> None:
    """Title this agent `loom[<run id>] agent` and hand the run id to the forkserver."""
    import os

    from loom import process
    from loom.rundir.config_file import load_frozen
    from loom.rundir.paths import RunDir

    try:
        run_id = str(load_frozen(RunDir(run_dir).config).run.id)
    except Exception:  # a title must not stop a run: torchrun reports a missing run dir itself
        run_id = Path(run_dir).name
    os.environ[process.RUN_ID_ENV] = run_id
    process.set_title(process.title(run_id, "agent"), "loom-agent")


def start_forkserver() -> None:
    """Start the forkserver now, so its imports run beside this process's own."""
    import multiprocessing
    import os
    from multiprocessing import forkserver

    os.environ["LOOM_AGENT_PID"] = str(os.getpid())  # loom.worker.preload: the forkserver dies with us
    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def launch(options: list[str], run_dir: str) -> None:
    """torch.distributed.run.run() for `options`, with ranks running loom.worker.main.forked_rank."""
    import logging
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from loom.worker.main import forked_rank

    # The agent's "Worker group FAILED. N/M attempts left; will restart worker group" is an INFO
    # line: into its log (loom.launch.console turns it into one console line of Loom's).
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.INFO)
    args = parse_args([*options, "-m", "loom.worker", run_dir])
    if args.standalone:  # as torchrun: a private c10d store on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    elastic_launch(config=config, entrypoint=forked_rank)(run_dir)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[-1].startswith("-"):
        sys.exit("usage: python -m loom.worker.agent <torchrun options> <run_dir>")
    name_agent(argv[-1])
    start_forkserver()
    from torch.distributed.elastic.multiprocessing.errors import record

    record(launch)(argv[:-1], argv[-1])
    _exit_at_once()


def _exit_at_once() -> None:
    """After a successful run, skip the interpreter's shutdown: tearing down torch's modules
    took 0.3 s that the launcher waited for, and nothing is left to finalize (the rendezvous
    is shut down, the ranks are gone, the forkserver dies with us). A failed run raises out of
    `record` instead and exits the ordinary way, with torchrun's error file written."""
    import logging
    import os

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
