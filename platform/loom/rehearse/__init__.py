"""`loom plan --rehearse`: build and step ranks of the full-scale layout on this machine, and
hold the plan to what they measure.

The plan's memory figures are formulas; the rehearsal runs the worker's real build path for
one rank at the real world size over torch's fake process group, the model on the meta
device and the step under FakeTensorMode with torch's memory tracker (`rank.py`, `step.py`),
one CPU process per rehearsed rank (a fake process group is process-global). What a launch
would refuse while building (a TP plan that does not divide, an empty pipeline stage, a
shard unit the model lacks, a dtype) fails here with the launch's own message, since the
same code raises it. ZeRO strategies cannot initialize DeepSpeed over a fake group: their
model states come from DeepSpeed's own estimators (`zero.py`).

This package sits beside `probe` and `report` (it uses the worker's build path); the
launcher-side modules here import no torch: the subprocesses do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from loom import strategies
from loom.rehearse.table import compare_rank, failures, render_rehearsal
from loom.rundir.config_file import frozen_yaml
from loom.strategies.deepspeed_config import zero_stage

TIMEOUT_S = 900  # one rank's process; the 70B-shaped layouts take well under a minute


def default_ranks(cfg: DictConfig, plan: dict[str, Any]) -> list[int]:
    """Rank 0 and the first rank of the fullest pipeline stage (rank order (dp, pp, tp):
    pipeline rank r starts at global rank r * tp)."""
    pipe = plan.get("pipeline")
    if not pipe:
        return [0]
    fullest = max(pipe["stages"], key=lambda st: st["memory_bytes"]["total"])["pp_rank"]
    return sorted({0, fullest * strategies.layout_of(cfg).tp})


def rehearse(cfg: DictConfig, plan: dict[str, Any], ranks: list[int] | None = None,
             show: bool = True) -> dict[str, Any]:
    """plan.json's `rehearsal`: per rank what was measured beside the plan's figures."""
    layout = strategies.layout_of(cfg)
    ranks = ranks or default_ranks(cfg, plan)
    bad = [r for r in ranks if not 0 <= r < layout.world]
    if bad:
        from loom.errors import ConfigError

        raise ConfigError(f"Invalid usage: --rank {','.join(map(str, bad))}: the world has ranks 0..{layout.world - 1}")
    if zero_stage(cfg.strategy.name) is not None:
        from loom.rehearse.zero import zero_rehearsal

        out = zero_rehearsal(cfg, plan, layout)
    else:
        measured = run_ranks(cfg, ranks)
        out = {"method": "fake process group + FakeTensorMode + torch memory tracker",
               "world_size": layout.world, "ranks": [compare_rank(plan, m) for m in measured]}
    if show:
        render_rehearsal(out)
    return out


def run_ranks(cfg: DictConfig, ranks: list[int]) -> list[dict[str, Any]]:
    """Each rank in its own `python -m loom.rehearse.rank` process, side by side."""
    with tempfile.TemporaryDirectory(prefix="loom-rehearse-") as tmp:
        config = Path(tmp) / "frozen.yaml"  # a temp file, not a run dir
        config.write_text(frozen_yaml(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [(r, Path(tmp) / f"rank-{r}.json", subprocess.Popen(
            [sys.executable, "-m", "loom.rehearse.rank", str(config), str(r), str(Path(tmp) / f"rank-{r}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)) for r in ranks]
        out = []
        for r, path, proc in procs:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
            if path.is_file():
                out.append(json.loads(path.read_text()))
            else:
                out.append({"rank": r, "error": f"the rehearsal process exited {proc.returncode}: {log[-2000:]}",
                            "error_type": "ProcessError"})
        return out


def parse_ranks(text: str | None) -> list[int] | None:
    """`--rank 0,7` -> [0, 7] (None: the default ranks)."""
    if not text:
        return None
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        from loom.errors import ConfigError

        raise ConfigError(f"Invalid usage: --rank {text}: give rank numbers separated by commas, e.g. --rank 0,7") from None


def rehearse_into(cfg: DictConfig, plan: dict[str, Any], rank_arg: str | None) -> int:
    """`loom plan --rehearse`: plan["rehearsal"] filled and shown; exit 2 when a rank failed
    to build or step (what the launch would have failed with is printed above)."""
    from loom.errors import EXIT_INVALID, EXIT_OK

    plan["rehearsal"] = rehearse(cfg, plan, parse_ranks(rank_arg))
    return EXIT_INVALID if failures(plan["rehearsal"]) else EXIT_OK


def rehearse_in_one_process(jobs: list[tuple[DictConfig, int]]) -> list[dict[str, Any]]:
    """Each (config, rank) in turn in ONE `loom.rehearse.rank` process (the fake group torn
    down between them): what tests and tools use to rehearse many small layouts cheaply."""
    with tempfile.TemporaryDirectory(prefix="loom-rehearse-") as tmp:
        args, outs = [], []
        for i, (cfg, rank) in enumerate(jobs):
            config, out = Path(tmp) / f"config-{i}.yaml", Path(tmp) / f"out-{i}.json"
            config.write_text(frozen_yaml(cfg))
            args += [str(config), str(rank), str(out)]
            outs.append(out)
        proc = subprocess.run([sys.executable, "-m", "loom.rehearse.rank", *args], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            raise RuntimeError(f"the rehearsal process exited {proc.returncode}: {proc.stderr[-2000:]}")
        return [json.loads(o.read_text()) for o in outs]
