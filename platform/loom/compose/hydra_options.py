"""Hydra's own options (`hydra.*`, `hydra/<group>=`): each does what Hydra does, or is refused.

Loom composes its config with Hydra's compose API but runs the job itself (freeze, torchrun,
SLURM), so Hydra's job-running options would be silently ignored. Instead:

  hydra.run.dir=DIR          -> `run.dir=DIR`: the run dir is exactly DIR (a fixed path: the same
                                command finds it again to resume; no `${now:...}`)
  hydra.verbose=true|NAME|[A,B] -> debug logs: `LOOM_VERBOSE` in this process's environment, which
                                the ranks inherit (not frozen: a resume without it logs at INFO)
  hydra.job.chdir=false      -> accepted (Loom never changes directory); `true` is refused
  hydra.searchpath=[...]     -> recipe directories (`loom.compose.recipes`)
  hydra/sweeper=..., hydra.sweeper.{n_trials,direction,sampler.seed}
                             -> `sweep.*` (`loom.sweep.translate`, before composition)
Every other `hydra.*` override exits 2 naming the Loom key that does the job.
"""

from __future__ import annotations

import logging
import os

from loom.errors import ConfigError

VERBOSE_ENV = "LOOM_VERBOSE"  # "all", or comma-separated logger names (hydra.verbose)
# Loggers that write to the rank logs (loom.worker.main.setup_logging): `hydra.verbose=true` turns
# all of them to DEBUG.
LOGGERS = ("loom", "pytorch_lightning", "lightning", "lightning_fabric", "deepspeed", "DeepSpeed")

SUPPORTED = ("hydra.run.dir=DIR (= run.dir), hydra.verbose=true|<logger>, hydra.job.chdir=false, "
             "hydra.searchpath='[file://DIR]', hydra/sweeper=optuna|basic, "
             "hydra.sweeper.n_trials|direction|sampler.seed")
_LOGS = ("each rank logs to <run>/logs/rank-N.log (rank 0 also to the console): "
         "hydra.verbose=true (or hydra.verbose=loom) turns on debug logs")
_LAUNCH = ("Loom launches the ranks itself (torchrun, or sbatch + srun): use hardware.launcher=slurm "
           "(hardware=slurm) with hardware.slurm.* (partition, account, time_limit, ...), "
           "hardware.devices and hardware.num_nodes")
_SWEEP = ("a sweep is configured by sweep.*: `loom train -m key=a,b` (grid), sweep.sampler=grid|optuna, "
          "sweep.n_trials, sweep.direction, sweep.objective, sweep.seed, sweep.params.<key>")
# Refused options, by prefix (the longest prefix that matches wins): what Loom uses instead.
REFUSED = {
    "hydra.sweep": "a sweep's dir is <run.root>/<experiment>/sweeps/<id>/ (one run dir per trial and "
                   "manifest.json): set run.root=DIR and experiment=NAME",
    "hydra.job.chdir": "Loom never changes the working directory: every rank runs where `loom train` "
                       "was started, relative paths in the config resolve from there, and a run writes "
                       "only into its run dir (run.dir / hydra.run.dir). Drop it, or pass "
                       "hydra.job.chdir=false",
    "hydra.job.name": "a run is named by experiment=NAME (runs/<experiment>/) and run.id=ID",
    "hydra.job.env_set": "set environment variables in the shell that runs `loom train` "
                         "(NAME=value loom train ...): the ranks inherit them",
    "hydra.job_logging": _LOGS, "hydra.hydra_logging": _LOGS,
    "hydra/job_logging": _LOGS, "hydra/hydra_logging": _LOGS,
    "hydra.output_subdir": "Loom writes the resolved config once, to <run>/config.yaml (no .hydra/ dir); "
                           "`loom train --cfg job` prints it",
    "hydra.mode": "use `loom train -m ...` for a sweep",
    "hydra.launcher": _LAUNCH, "hydra/launcher": _LAUNCH,
    "hydra.sweeper": _SWEEP, "hydra/sweeper": _SWEEP,
    "hydra.help": "`loom train --help` lists the config groups, `--info` the search path",
    "hydra/help": "`loom train --help` lists the config groups, `--info` the search path",
    "hydra.callbacks": "Loom runs no Hydra callbacks; a run's outcome is <run>/summary.json",
}


def is_hydra(override: str) -> bool:
    key = override.lstrip("+~").partition("=")[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def translate(overrides: list[str]) -> list[str]:
    """The overrides with Hydra's own options done or refused (`hydra.searchpath` is kept for
    the recipes). Sets `LOOM_VERBOSE` when `hydra.verbose` asks for debug logs."""
    out = []
    for o in overrides:
        if not is_hydra(o):
            out.append(o)
            continue
        key, _, value = o.lstrip("+~").partition("=")
        if key == "hydra.searchpath":
            out.append(o)
        elif key == "hydra.run.dir":
            out.append(f"run.dir={_run_dir(value)}")
        elif key == "hydra.verbose":
            set_verbose(value)
        elif key == "hydra.job.chdir" and value.strip().lower() == "false":
            continue  # what Loom does anyway
        else:
            raise ConfigError(refusal(o))
    return out


def refusal(override: str) -> str:
    key = override.lstrip("+~").partition("=")[0]
    matches = [p for p in REFUSED if key == p or key.startswith((p + ".", p + "="))]
    if matches:
        return f"Invalid config: {override} is not supported by Loom: {REFUSED[max(matches, key=len)]}."
    return (f"Invalid config: {override} is not supported by Loom: Loom composes the config with Hydra but "
            f"runs the job itself, so Hydra's job options do not apply. Supported: {SUPPORTED}; "
            "see `loom train --help`.")


def _run_dir(value: str) -> str:
    path = value.strip().strip("'\"")
    if not path or "${" in path:
        raise ConfigError(
            f"Invalid config: hydra.run.dir={value}: give a fixed directory, e.g. hydra.run.dir=runs/exp1. "
            "The same command must find the same run dir again to resume it; a dir from the clock "
            "(${now:...}) would start over on every restart.")
    return path


def set_verbose(value: str) -> None:
    """Hydra's semantics: true -> every logger Loom configures at DEBUG, NAME or [A,B] -> those."""
    text = value.strip().strip("'\"")
    if text.lower() in ("false", "", "null"):
        os.environ.pop(VERBOSE_ENV, None)
        return
    if text.lower() == "true":
        os.environ[VERBOSE_ENV] = "all"
        return
    names = [n.strip().strip("'\"") for n in text.strip("[]").split(",") if n.strip()]
    os.environ[VERBOSE_ENV] = ",".join(names)


def debug_loggers() -> list[str]:
    """The loggers `hydra.verbose` turned to DEBUG (from the environment the ranks inherit)."""
    value = os.environ.get(VERBOSE_ENV, "")
    if not value:
        return []
    return list(LOGGERS) if value == "all" else [n for n in value.split(",") if n]


def launcher_debug(message) -> None:
    """A `hydra.verbose` DEBUG line of the launcher (composition, plan inputs, the launch
    command): on stderr, as Hydra's own debug output goes to the console. Ranks log theirs to
    their rank logs (`apply_verbose`). `message` may be a callable, built only when on."""
    if "loom" in debug_loggers():
        import sys

        message = message() if callable(message) else message
        for line in message.splitlines() or [""]:
            print(f"DEBUG loom: {line}", file=sys.stderr, flush=True)


def apply_verbose(handlers: list[logging.Handler]) -> None:
    """Set the `hydra.verbose` loggers to DEBUG, writing to `handlers` (the rank's log file)."""
    for name in debug_loggers():
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        for h in handlers:
            if h not in lg.handlers:
                lg.addHandler(h)
