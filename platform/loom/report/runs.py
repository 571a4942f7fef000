"""One run's files (summary.json, config.yaml, plan.json) as a `Run`, and its `report.md`:
the summary as a table (model, dataset, losses, validation, throughput in the task's unit,
data wait, memory, why it failed), a mixture's sources (loom.report.sources), its evaluations
(loom.report.evals) and the run's plots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from loom.atomic import atomic_write_text
from loom.errors import ConfigError
from loom.report.evals import eval_section, latest_text
from loom.report.sources import data_wait_text, sources_section
from loom.rundir.eval_results import eval_results
from loom.rundir.paths import RunDir
from loom.rundir.summary import validation_text


@dataclass
class Run:
    path: Path
    summary: dict[str, Any]
    efficiency: float | None = None
    baseline: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return int(self.summary.get("world_size") or 1)

    @property
    def tokens_per_sec(self) -> float | None:
        return (self.summary.get("throughput") or {}).get("tokens_per_sec")

    @property
    def tokens_per_sec_per_device(self) -> float | None:
        t = self.tokens_per_sec
        return t / self.world if t is not None else None

    @property
    def samples_per_sec(self) -> float | None:
        return (self.summary.get("throughput") or {}).get("samples_per_sec")

    @property
    def classifier(self) -> bool:
        """Its items are samples, not tokens (summary.json has no tokens/s for a classifier)."""
        tp = self.summary.get("throughput") or {}
        return tp.get("tokens_per_sec") is None and tp.get("samples_per_sec") is not None

    @property
    def rate(self) -> float | None:
        """Throughput in the task's unit: tokens/s, or samples/s for a classifier."""
        return self.samples_per_sec if self.classifier else self.tokens_per_sec

    @property
    def val_loss(self) -> float | None:
        return (self.summary.get("validation") or {}).get("loss")

    @cached_property
    def config(self) -> dict[str, Any]:
        """The frozen config.yaml ({} when it cannot be read)."""
        try:
            import yaml

            return yaml.safe_load(RunDir(self.path).config.read_text()) or {}
        except (OSError, ValueError, ImportError):
            return {}

    @cached_property
    def params(self) -> int | None:
        """The model's parameter count, from plan.json."""
        try:
            return int(json.loads(RunDir(self.path).plan.read_text())["params"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def mfu(self) -> float | None:
        return (self.summary.get("throughput") or {}).get("mfu")

    def peak_memory(self) -> tuple[float | None, str]:
        """Peak memory of the most loaded rank: GPU memory on GPUs, else the process RSS."""
        mem = self.summary.get("memory") or {}
        gpu = mem.get("peak_gpu_mem_gb_per_rank")
        if gpu:
            return max(gpu), "GPU"
        rss = mem.get("peak_rss_gb_per_rank")
        return (max(rss), "RSS") if rss else (None, "")


# ----------------------------------------------------------------------------- finding runs


def is_run_dir(path: Path) -> bool:
    return RunDir(path).summary.is_file()


def load_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"loom report: {path} is not a directory (expected a run dir or a sweep dir).")
    try:
        summary = json.loads(RunDir(path).summary.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"loom report: {path} is not a run dir: it has no summary.json (a run dir is "
            "runs/<experiment>/<run id>/, written by `loom train`; a sweep dir holds run dirs)."
        ) from None
    except (json.JSONDecodeError, OSError) as e:
        raise ConfigError(f"loom report: {RunDir(path).summary} cannot be read ({e}).") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"loom report: {RunDir(path).summary} is not a summary (not a JSON object).")
    return Run(path.resolve(), summary)


def child_runs(path: Path) -> list[Path]:
    """Run dirs directly inside `path` (a sweep dir, or runs/<experiment>/)."""
    return sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))


def collect(paths: list[Path]) -> tuple[list[Run], Path | None, list[Path]]:
    """-> (runs, the sweep dir or None, child dirs skipped for lack of a summary)."""
    if not paths:
        raise ConfigError("loom report: give at least one PATH (a run dir or a sweep dir).")
    if len(paths) == 1 and paths[0].is_dir() and not is_run_dir(paths[0]):
        sweep = paths[0]
        found = child_runs(sweep)
        if not found:
            raise ConfigError(
                f"loom report: {sweep} is not a run dir (no summary.json) and holds no run dirs. "
                "Give a run dir (runs/<experiment>/<run id>/) or a sweep dir (runs/<experiment>/sweeps/<id>/)."
            )
        skipped = sorted(p for p in sweep.iterdir() if p.is_dir() and RunDir(p).config.is_file()
                         and not is_run_dir(p))
        return [load_run(p) for p in found], sweep.resolve(), skipped
    return [load_run(p) for p in paths], None, []


# ----------------------------------------------------------------------------- formatting


def _num(v: Any, spec: str = ",.1f", suffix: str = "") -> str:
    if v is None:
        return "n/a"
    try:
        return f"{v:{spec}}{suffix}"
    except (TypeError, ValueError):
        return str(v)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _gb(v: Any) -> str:
    if not v:
        return "n/a"
    return ", ".join(f"{x:.2f}" for x in v) + " GB"


def _bytes(v: Any) -> str:
    if not v:
        return "n/a"
    return ", ".join(f"{x / 2**20:,.1f}" for x in v) + " MiB"


def error_text(error: Any) -> str | None:
    """summary.json's `error` {type, message, rank, step, log} as one line (None: no error)."""
    if not error:
        return None
    if not isinstance(error, dict):
        return str(error)
    where = ", ".join(f"{k} {error[k]}" for k in ("rank", "step") if error.get(k) is not None)
    text = f"{error.get('type') or 'error'}: {error.get('message') or ''}".strip()
    text += f" ({where})" if where else ""
    return text + (f"; full traceback: {error['log']}" if error.get("log") else "")


def model_text(run: Run) -> str:
    model = run.config.get("model") or {}
    name = model.get("name") or "n/a"
    if model.get("_target_"):
        name += f" ({model['_target_']})"
    return name + (f", {run.params:,} parameters" if run.params is not None else "")


def dataset_text(run: Run) -> str:
    from omegaconf import OmegaConf

    from loom.data import data_where

    ds = run.config.get("dataset") or {}
    try:  # the option says where its data lives; an older config lacking its keys says nothing
        where = data_where(OmegaConf.create(ds)) if isinstance(ds, dict) else None
    except (AttributeError, KeyError):
        where = None
    return (ds.get("name") or "n/a") + (f" ({where})" if where else "")


def summary_rows(run: Run) -> list[tuple[str, str]]:
    s = run.summary
    tp = s.get("throughput") or {}
    mem = s.get("memory") or {}
    util = s.get("utilization") or {}
    why = error_text(s.get("error"))
    # A classifier's items are samples: no token count, no tokens/s.
    tokens = [] if run.classifier else [("tokens", _num(s.get("tokens"), ",d"))]
    overall = tp.get("overall") or {}
    # steady state (summary.json `throughput`), and the whole run's average beside it
    rates = [] if run.classifier else [("tokens/s", _num(tp.get("tokens_per_sec"), ",.0f")),
                                       ("tokens/s overall", _num(overall.get("tokens_per_sec"), ",.0f")),
                                       ("tokens/s per device", _num(run.tokens_per_sec_per_device, ",.0f"))]
    t = s.get("time") or {}
    rows = [
        ("run id", str(s.get("run_id"))),
        ("status", str(s.get("status"))),
        *([("why it failed", why)] if why else []),
        ("model", model_text(run)),
        ("dataset", dataset_text(run)),
        ("strategy", str(s.get("strategy"))),
        ("hardware", str(s.get("hardware"))),
        ("world size", f"{run.world} ({s.get('num_nodes', 1)} node(s))"),
        ("steps", _num(s.get("global_step"), ",d")),
        *tokens,
        ("samples", _num(s.get("samples"), ",d")),
        ("loss", f"{_num(s.get('first_loss'), '.4f')} -> {_num(s.get('final_loss'), '.4f')}"),
        ("validation", validation_text(s.get("validation"))),
        *rates,
        ("samples/s", _num(tp.get("samples_per_sec"), ",.1f")),
        ("samples/s overall", _num(overall.get("samples_per_sec"), ",.1f")),
        ("steady from step", "n/a (no steady window)" if not tp.get("steady") else str(tp.get("steady_from_step"))),
        ("data wait", data_wait_text(s.get("data_wait"))),
        ("TFLOP/s per device", _num(tp.get("tflops_per_device"), ",.3f")),
        ("MFU", _pct(tp.get("mfu")) if tp.get("mfu") is not None else "n/a (device peak unknown)"),
        ("peak RSS per rank", _gb(mem.get("peak_rss_gb_per_rank"))),
        ("peak GPU memory per rank (allocated)", _gb(mem.get("peak_gpu_mem_gb_per_rank"))),
        ("peak GPU memory per rank (reserved)", _gb(mem.get("peak_gpu_reserved_gb_per_rank"))),
        ("parameters per rank", _bytes(mem.get("param_bytes_per_rank"))),
        ("optimizer state per rank", _bytes(mem.get("optim_state_bytes_per_rank"))),
        ("CPU utilization (mean)", _num(util.get("cpu_percent_mean"), ".0f", "%")),
        ("GPU utilization (mean)", _num(util.get("gpu_util_mean"), ".0f", "%")),
        ("training time", _num(s.get("train_time_s"), ",.1f", " s")),
        ("compile / first step", f"{_num(t.get('compile_s'), ',.1f', ' s')} / {_num(t.get('first_step_s'), ',.1f', ' s')}"),
        ("validation / checkpoints",
         f"{_num(t.get('validation_s'), ',.1f', ' s')} / {_num(t.get('checkpoint_s'), ',.1f', ' s')}"),
        *([("evaluation time", _num(t.get("eval_s"), ",.1f", " s"))] if t.get("eval_s") else []),
        ("wall time", _num(s.get("wall_time_s"), ",.1f", " s")),
        ("steps trained (all attempts)", _num(s.get("steps_trained"), ",d")),
        ("restarts", str(s.get("restarts", 0))),
    ]
    moe = s.get("moe")
    if moe:
        rows.append(("expert load (last step)", f"max {moe['expert_load_max']:.2f}x, min {moe['expert_load_min']:.2f}x "
                     f"the mean (worst max {moe['worst_expert_load_max']:.2f}x); {moe['dropped_tokens']} tokens dropped"))
    if s.get("objective"):
        rows.append(("objective", objective_text(s["objective"])))
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from step", str(s["resumed_from_step"])))
    history = s.get("world_history") or []
    if len({h.get("world_size") for h in history}) > 1:  # the run changed its world
        rows.append(("world history", ", ".join(f"{h.get('world_size')} rank(s) from step {h.get('start_step')} "
                                                f"({h.get('reason')})" for h in history)))
    evaluated = latest_text(eval_results(run.path, s))
    if evaluated:
        rows.append(("evaluation", evaluated))
    if s.get("final_weights"):
        rows.append(("final weights", str(s["final_weights"])))
    return rows


def objective_text(o: dict[str, Any]) -> str:
    """A preference objective (summary.json `objective`): its settings, reference and last step's figures."""
    keys = ", ".join(f"{k} {v}" for k, v in o.items() if k not in ("name", "reference", "reference_log_probs",
                                                                   "last_step") and v is not None)
    ref = o.get("reference")
    how = ", ".join(f"{split} {done}" for split, done in (o.get("reference_log_probs") or {}).items())
    said = f"{o['name']} ({keys})" + (f", reference {ref}" + (f" ({how})" if how else "") if ref else "")
    last = o.get("last_step") or {}
    return said + ("; last step: " + ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in last.items()) if last else "")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def esc(x: str) -> str:
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def _write(path: Path, text: str) -> Path:
    return atomic_write_text(path, text)


# ----------------------------------------------------------------------------- one run


def run_report(run: Run) -> Path:
    from loom.tracking.plots import PLOTS, write_plots

    plots_dir = RunDir(run.path).plots
    if RunDir(run.path).metrics.is_file() or eval_results(run.path, run.summary):
        try:
            write_plots(run.path)
        except Exception as e:  # a report without pictures is still a report
            print(f"warning: plots not drawn ({type(e).__name__}: {e})")
    s = run.summary
    parts = [f"# Run {s.get('run_id')} ({s.get('status')})", "",
             _md_table(["", "value"], [[k, v] for k, v in summary_rows(run)]), "", *sources_section(s),
             *eval_section(run.path, s, _md_table)]
    pics = [p for p in PLOTS if (plots_dir / p).is_file()]
    if pics:
        parts += ["## Plots", ""]
        parts += [f"![{p[:-4]}](plots/{p})\n" for p in pics]
    else:
        parts += ["No plots: this run has no metrics.csv (tracking=none)."]
    from loom.report.slow import profile_section, ranks_section

    parts += ["", *ranks_section(run.path, s), *profile_section(run.path)]
    return _write(run.path / "report.md", "\n".join(parts) + "\n")
