"""`loom report PATH...`: a markdown report of one run, or a comparison of several.

One run dir -> `<run>/report.md`: the summary as a table and the run's plots.
A sweep dir (a dir whose children are run dirs, e.g. runs/<exp>/sweeps/<id>/) or several
run dirs -> a table with one row per run (strategy, hardware, world size, tokens/s,
tokens/s per device, scaling efficiency, MFU, peak memory), printed and written to
`report.md` with `scaling.png` (tokens/s against world size) in the sweep dir, or in
`--out` / the first run's parent dir for loose runs.

Scaling efficiency of a run = its tokens/s per device / the baseline's tokens/s per device,
where the baseline is a run at the smallest world size in the set: the one with the same
strategy if there is one, else the fastest per device at that size. 1.0 is linear scaling.

Reads only files (summary.json, metrics.csv): no torch import, so it is fast and works on
a machine without the training stack's accelerators.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.atomic import atomic_path, atomic_write_text
from loom.errors import ConfigError


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
    return (path / "summary.json").is_file()


def load_run(path: Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"loom report: {path} is not a directory (expected a run dir or a sweep dir).")
    try:
        summary = json.loads((path / "summary.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"loom report: {path} is not a run dir: it has no summary.json (a run dir is "
            "runs/<experiment>/<run id>/, written by `loom train`; a sweep dir holds run dirs)."
        ) from None
    except (json.JSONDecodeError, OSError) as e:
        raise ConfigError(f"loom report: {path / 'summary.json'} cannot be read ({e}).") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"loom report: {path / 'summary.json'} is not a summary (not a JSON object).")
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
        skipped = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "config.yaml").is_file()
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


def summary_rows(run: Run) -> list[tuple[str, str]]:
    s = run.summary
    tp = s.get("throughput") or {}
    mem = s.get("memory") or {}
    util = s.get("utilization") or {}
    rows = [
        ("run id", str(s.get("run_id"))),
        ("status", str(s.get("status"))),
        ("strategy", str(s.get("strategy"))),
        ("hardware", str(s.get("hardware"))),
        ("world size", f"{run.world} ({s.get('num_nodes', 1)} node(s))"),
        ("steps", _num(s.get("global_step"), ",d")),
        ("tokens", _num(s.get("tokens"), ",d")),
        ("samples", _num(s.get("samples"), ",d")),
        ("loss", f"{_num(s.get('first_loss'), '.4f')} -> {_num(s.get('final_loss'), '.4f')}"),
        ("tokens/s", _num(tp.get("tokens_per_sec"), ",.0f")),
        ("tokens/s per device", _num(run.tokens_per_sec_per_device, ",.0f")),
        ("samples/s", _num(tp.get("samples_per_sec"), ",.1f")),
        ("TFLOP/s per device", _num(tp.get("tflops_per_device"), ",.3f")),
        ("MFU", _pct(tp.get("mfu")) if tp.get("mfu") is not None else "n/a (device peak unknown)"),
        ("peak RSS per rank", _gb(mem.get("peak_rss_gb_per_rank"))),
        ("peak GPU memory per rank", _gb(mem.get("peak_gpu_mem_gb_per_rank"))),
        ("parameters per rank", _bytes(mem.get("param_bytes_per_rank"))),
        ("optimizer state per rank", _bytes(mem.get("optim_state_bytes_per_rank"))),
        ("CPU utilization (mean)", _num(util.get("cpu_percent_mean"), ".0f", "%")),
        ("GPU utilization (mean)", _num(util.get("gpu_util_mean"), ".0f", "%")),
        ("training time", _num(s.get("train_time_s"), ",.1f", " s")),
        ("wall time", _num(s.get("wall_time_s"), ",.1f", " s")),
        ("restarts", str(s.get("restarts", 0))),
    ]
    if s.get("resumed_from_step") is not None:
        rows.append(("resumed from step", str(s["resumed_from_step"])))
    if s.get("final_weights"):
        rows.append(("final weights", str(s["final_weights"])))
    return rows


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

    plots_dir = run.path / "plots"
    if (run.path / "metrics.csv").is_file():
        try:
            write_plots(run.path)
        except Exception as e:  # a report without pictures is still a report
            print(f"warning: plots not drawn ({type(e).__name__}: {e})")
    s = run.summary
    parts = [f"# Run {s.get('run_id')} ({s.get('status')})", "",
             _md_table(["", "value"], [[k, v] for k, v in summary_rows(run)]), ""]
    pics = [p for p in PLOTS if (plots_dir / p).is_file()]
    if pics:
        parts += ["## Plots", ""]
        parts += [f"![{p[:-4]}](plots/{p})\n" for p in pics]
    else:
        parts += ["No plots: this run has no metrics.csv (tracking=none)."]
    return _write(run.path / "report.md", "\n".join(parts) + "\n")


# ----------------------------------------------------------------------------- several runs


def scaling(runs: list[Run]) -> None:
    """Set each run's scaling efficiency against a smallest-world-size baseline (see module doc)."""
    measured = [r for r in runs if r.tokens_per_sec_per_device]
    if not measured:
        return
    smallest = min(r.world for r in measured)
    base_runs = [r for r in measured if r.world == smallest]
    fastest = max(base_runs, key=lambda r: r.tokens_per_sec_per_device)
    for r in measured:
        same = [b for b in base_runs if b.summary.get("strategy") == r.summary.get("strategy")]
        base = max(same, key=lambda b: b.tokens_per_sec_per_device) if same else fastest
        r.efficiency = r.tokens_per_sec_per_device / base.tokens_per_sec_per_device
        r.baseline = str(base.summary.get("run_id"))


COLUMNS = ["run", "status", "strategy", "hardware", "world size", "tokens/s", "tokens/s per device",
           "scaling eff.", "MFU", "peak memory / rank"]
SHORT = ["run", "status", "strategy", "hardware", "world", "tokens/s", "tok/s/dev", "eff.", "MFU", "peak mem"]


def comparison_rows(runs: list[Run], base: Path) -> list[list[str]]:
    rows = []
    for r in runs:
        mem, kind = r.peak_memory()
        try:
            name = str(r.path.relative_to(base))
        except ValueError:
            name = r.path.name  # the run id; the full paths are listed under the table
        rows.append([
            name, str(r.summary.get("status")), str(r.summary.get("strategy")), str(r.summary.get("hardware")),
            str(r.world), _num(r.tokens_per_sec, ",.0f"), _num(r.tokens_per_sec_per_device, ",.0f"),
            _num(r.efficiency, ".2f"), _pct(r.mfu), _num(mem, ".2f", f" GB {kind}"),
        ])
    return rows


def scaling_plot(runs: list[Run], path: Path) -> Path | None:
    measured = [r for r in runs if r.tokens_per_sec]
    if not measured:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    by_strategy: dict[str, list[Run]] = {}
    for r in measured:
        by_strategy.setdefault(str(r.summary.get("strategy")), []).append(r)
    for name, group in sorted(by_strategy.items()):
        group.sort(key=lambda r: r.world)
        ax.plot([r.world for r in group], [r.tokens_per_sec for r in group], "o-", label=name)
    worlds = sorted({r.world for r in measured})
    smallest = worlds[0]
    base = max((r for r in measured if r.world == smallest), key=lambda r: r.tokens_per_sec_per_device)
    ax.plot(worlds, [base.tokens_per_sec_per_device * w for w in worlds], "--", color="gray",
            label=f"linear from world size {smallest}")
    ax.set_xlabel("world size (devices)")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(worlds)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("throughput vs world size")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def comparison_report(runs: list[Run], out: Path, skipped: list[Path]) -> Path:
    scaling(runs)
    runs.sort(key=lambda r: (str(r.summary.get("strategy")), r.world, str(r.path)))
    rows = comparison_rows(runs, out)
    plot = scaling_plot(runs, out / "scaling.png")
    parts = [f"# Comparison of {len(runs)} runs", "", _md_table(COLUMNS, rows), "",
             "Scaling efficiency: tokens/s per device / that of the baseline run at the smallest world "
             "size (same strategy if there is one, else the fastest per device); 1.00 is linear scaling. "
             "Peak memory: the most loaded rank (GPU memory on GPUs, process RSS on CPUs). "
             "MFU is n/a where the device's peak FLOP/s is unknown.", ""]
    if plot:
        parts += ["![scaling](scaling.png)", ""]
    parts += ["## Runs", ""]
    for r in runs:
        rel = os.path.relpath(r.path, out)
        has_report = (r.path / "report.md").is_file()
        parts.append(f"- [{rel}]({rel}/report.md)" if has_report else f"- {rel}")
    if skipped:
        parts += ["", "Not included (no summary.json yet: running, or stopped before the end): "
                  + ", ".join(os.path.relpath(p, out) for p in skipped)]
    return _write(out / "report.md", "\n".join(parts) + "\n")


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_header=bool(header[0]))
    for i, h in enumerate(header):
        t.add_column(h, style="bold" if i == 0 and not h else None, no_wrap=True)
    for r in rows:
        t.add_row(*r)
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))
    console.print(t)


def report(paths: list[str | Path], out: str | Path | None = None) -> int:
    """The `loom report` verb; returns the exit code (errors raise ConfigError: exit 2)."""
    paths = [Path(p) for p in paths]
    runs, sweep, skipped = collect(paths)
    if sweep is None and len(runs) == 1 and out is None:
        run = runs[0]
        path = run_report(run)
        _print_table(f"loom run {run.summary.get('run_id')}: {run.summary.get('status')}",
                     ["", ""], [list(r) for r in summary_rows(run)])
        print(f"report: {path}")
        return 0
    out_dir = Path(out) if out is not None else (sweep if sweep is not None else runs[0].path.parent)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"loom report: cannot create the output dir {out_dir} ({e.strerror}).") from None
    out_dir = out_dir.resolve()
    for r in runs:  # each run's own report too, so the comparison can link to it
        try:
            run_report(r)
        except OSError as e:
            print(f"warning: no report.md for {r.path} ({e.strerror})")
    path = comparison_report(runs, out_dir, skipped)
    _print_table(f"{len(runs)} runs (scaling eff.: tokens/s per device vs the smallest world size)",
                 SHORT, comparison_rows(runs, out_dir))
    print(f"report: {path}")
    if (out_dir / "scaling.png").is_file():
        print(f"scaling plot: {out_dir / 'scaling.png'}")
    return 0
