"""Hydra's own options through the real `loom` CLI: each does what Hydra does or exits 2 naming the
Loom key; `~key` follows the schema; --help / --info; --dry-run outside SLURM; a GPU profile on
`hardware.accelerator=cpu` re-derived; `loom plan` on CPU counts each rank's host memory and warns
beyond the cores. One tiny 1-process run (hydra.run.dir + hydra.verbose); the rest never trains."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import FAST, launching_fixture, refused, run_loom
from omegaconf import OmegaConf

TINY = [*FAST, "strategy=single", "model=gpt_tiny", "trainer.max_steps=2", "dataset.batch_size=2",
        "dataset.seq_len=32", "trainer.limit_val_batches=1"]


def _cfg_job(loom, *overrides: str) -> OmegaConf:
    r = loom("train", "--cfg", "job", *overrides)
    assert r.rc == 0, r.err
    return OmegaConf.create(r.out)


@launching_fixture(scope="module")
def exact_dir_run(tmp_path_factory):
    """One tiny run whose run dir is given by hydra.run.dir, with debug logs for `loom` and
    tracking=none; run again with the `run.dir` alias (the same run: already completed)."""
    root = tmp_path_factory.mktemp("hydra_run")
    target = root / "somewhere" / "my-run"
    args = ("train", *TINY, "tracking=none", "hydra.verbose=loom", "trainer.gc_every_n_steps=1",
            "checkpoint.every_n_steps=2")
    first = run_loom(*args, f"hydra.run.dir={target}", root=root)
    again = run_loom(*args, f"run.dir={target}", root=root)
    return root, target, first, again


def test_hydra_run_dir_is_the_run_dir(exact_dir_run):
    root, target, first, again = exact_dir_run
    assert first.rc == 0, first.out + first.err
    assert first.run_dir == target.resolve()
    assert (target / "config.yaml").exists() and first.summary()["status"] == "completed"
    assert OmegaConf.load(target / "config.yaml").run.dir == str(target)
    assert not (root / "gpt").exists(), "nothing under run.root/<experiment>/"
    # run.dir=DIR is the same option (README: "same as run.dir=DIR"): it finds the same run again
    assert again.rc == 0 and "already completed" in again.out and str(target.resolve()) in again.out


def test_tracking_none_logs_no_step_but_writes_the_summary(exact_dir_run):
    """README: `tracking=none`: no metrics.csv, no wandb run; summary.json and the console still
    have the run's losses."""
    _, target, first, _ = exact_dir_run
    assert not (target / "metrics.csv").exists() and not (target / "wandb").exists()
    s = first.summary()
    assert s["status"] == "completed" and s["global_step"] == 2 and s["final_loss"] > 0
    assert f"step 2/2  loss {s['final_loss']:.4f}" in first.out


def test_hydra_verbose_turns_on_debug_logs(exact_dir_run):
    _, target, first, _ = exact_dir_run
    log = (target / "logs" / "rank-0.log").read_text()
    assert re.search(r" loom DEBUG: gc.collect\(1\) every \d+ steps: \d+ collections", log), log[-2000:]
    # the rank's placement of every module and its checkpoint paths; the launcher's composition,
    # plan inputs and launch, on stderr
    assert re.search(r" loom DEBUG: module \S*blocks\.0\.attn\S*: .* whole on cpu", log), log[-3000:]
    assert " loom DEBUG: resume point: none (step 0)" in log
    assert re.search(r" loom DEBUG: checkpoint complete: \S+/checkpoints/step-0000002\.ckpt", log), log[-3000:]
    err = first.err
    assert "DEBUG loom: composed config (before freeze):" in err and "DEBUG loom: plan inputs: {" in err
    assert "DEBUG loom: launch: in-process (1 rank)" in err
    assert "DEBUG" not in (target / "config.yaml").read_text()  # not frozen: a resume logs at INFO


def test_hydra_run_dir_in_a_sweep_is_refused(loom, tmp_path):
    err = refused(tmp_path, "-m", "optim.lr=0.1,0.01", f"hydra.run.dir={tmp_path / 'x'}")
    assert "run.dir" in err and "sweep" in err and "run.root" in err


@pytest.mark.parametrize(("override", "needles"), [
    ("hydra.job.chdir=true", ["never changes the working directory", "hydra.job.chdir=false"]),
    ("hydra.foo=1", ["hydra.foo=1", "hydra.run.dir", "hydra.verbose"]),
    ("hydra/launcher=submitit_slurm", ["hardware.launcher=slurm", "hardware.slurm"]),
    ("hydra.sweep.dir=/tmp/s", ["run.root", "experiment"]),
    ("hydra.job.env_set.X=1", ["environment"]),
    ("hydra.run.dir=out/${now:%H-%M}", ["fixed directory", "resume"]),
    ("~model", ["model group is required", "gpt_tiny"]),
    ("~trainer.max_steps", ["trainer.max_steps is required", "cannot be removed"]),
    ("~experiment", ["experiment", "cannot be removed"]),
    ("--dry-run", ["--dry-run", "hardware.launcher=slurm", "loom plan"]),
])
def test_refused_fast_naming_the_key(loom, tmp_path, override, needles):
    err = refused(tmp_path, *([override] if override != "--dry-run" else [override, "strategy=single"]))
    for needle in needles:
        assert needle in err, (needle, err)


def test_removing_an_optional_key_nulls_it(loom):
    default = _cfg_job(loom)
    assert default.trainer.gradient_clip_val == 1.0 and default.tracking.name != "none"
    cfg = _cfg_job(loom, "~trainer.gradient_clip_val", "~tracking", "~hardware.rdzv_endpoint",
                   "hydra.job.chdir=false")
    assert cfg.trainer.gradient_clip_val is None  # no clipping (Lightning and DeepSpeed read null/0 as off)
    assert cfg.tracking.name == "none"
    swept = _cfg_job(loom, "recipe=lr-search", "~sweep.params.optim.lr")
    assert dict(swept.sweep.params) == {}


def test_help_lists_groups_and_options(loom, tmp_path):
    r = loom("train", "--help")  # torch-free: tests/test_config.py; its speed: scripts/bench/cli_latency.py
    assert r.rc == 0, r.err
    assert "== Configuration groups ==" in r.out and "--dry-run" in r.out and "--cfg" in r.out
    conf = Path(__file__).resolve().parents[1] / "conf"
    lines = {ln.split(":")[0]: ln for ln in r.out.splitlines() if ":" in ln}
    for group in ("strategy", "model", "dataset", "hardware", "optim", "tracking"):
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        assert group in lines, (group, r.out)
        for option in options:
            assert option in lines[group], (group, option, lines[group])
    assert "ddp*" in lines["strategy"] and "lr-search" in lines["recipe"]


def test_info_prints_search_path_and_sources(loom, tmp_path):
    mine = tmp_path / "my-recipes"
    mine.mkdir()
    (mine / "mine.yaml").write_text("# @package _global_\n# mine: a test recipe\nseed: 7\n")
    r = loom("train", "--info", f"hydra.searchpath=[file://{mine}]")
    assert r.rc == 0, r.err
    conf = Path(__file__).resolve().parents[1] / "conf"
    assert "Config search path" in r.out and f"file://{conf}" in r.out and f"file://{mine}" in r.out
    assert str(mine / "mine.yaml") in r.out and str(conf / "strategy") in r.out


def _plan(loom, tmp_path, *overrides: str):
    out = tmp_path / "plan.json"
    r = loom("plan", "--json", str(out), *overrides)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_multinode_on_cpu_derives_gloo(loom, tmp_path):
    r, plan = _plan(loom, tmp_path, "hardware=multinode", "hardware.accelerator=cpu",
                    "hardware.rdzv_endpoint=node0:29400")
    assert r.rc == 0, r.err
    assert plan["backend"] == "gloo" and plan["accelerator"] == "cpu" and plan["num_nodes"] == 2


def test_gpu_profile_on_cpu_is_rederived_not_shown_as_both(loom, tmp_path):
    r, plan = _plan(loom, tmp_path, "hardware=h100x8", "hardware.accelerator=cpu", "hardware.devices=2")
    assert r.rc == 0, r.err
    assert (plan["backend"], plan["device_name"], plan["precision"]) == ("gloo", "cpu", "32-true")
    assert plan["peak_flops_per_device"] is None and "H100" not in r.out
    cpu = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "hardware" / "cpu.yaml")
    assert plan["host_capacity_bytes"] == pytest.approx(0.8 * cpu.host_memory_gb * 1e9)  # not the DGX's 2 TB
    # what the user sets explicitly wins: a contradiction is refused, a value is kept
    err = refused(tmp_path, "hardware=h100x8", "hardware.accelerator=cpu", "hardware.backend=nccl")
    assert "hardware.backend" in err and "gloo" in err
    r, plan = _plan(loom, tmp_path, "hardware=h100x8", "hardware.accelerator=cpu", "hardware.devices=2",
                    "hardware.peak_tflops.fp32=1.5")
    assert r.rc == 0 and plan["peak_flops_per_device"] == pytest.approx(1.5e12)


def test_plan_on_cpu_warns_beyond_cores_and_counts_host_memory(loom, tmp_path):
    cores = len(os.sched_getaffinity(0))
    n = max(64, cores + 1)
    r, _ = _plan(loom, tmp_path, "hardware=cpu", f"hardware.devices={n}")
    warned = [ln for ln in r.err.splitlines() if ln.startswith("warning:") and "usable core" in ln]
    assert len(warned) == 1 and f"hardware.devices={n}" in warned[0], r.err
    # 64 ranks x (0.5 GB runtime + states + activations) > 80% of the profile's 24 GB host
    assert r.rc == 3, r.out + r.err
    assert f"{n} processes x" in r.out and "runtime" in r.err and "hardware.host_memory_gb" in r.err
    ok, plan = _plan(loom, tmp_path, "hardware=cpu", "hardware.devices=2")
    assert ok.rc == 0 and not [ln for ln in ok.err.splitlines() if "usable core" in ln]
    assert plan["memory_per_device_bytes"]["runtime"] == pytest.approx(0.5e9)


def test_plan_warning_once_per_command_across_sweep_trials(loom, tmp_path):
    """A SLURM sweep with --dry-run plans (and writes the sbatch of) every trial, trains nothing."""
    r = loom("train", "-m", "--dry-run", "hardware=slurm", "hardware.accelerator=cpu", "optim.lr=0.1,0.01")
    assert r.rc == 0, r.out + r.err
    assert len(list(tmp_path.rglob("job.sbatch"))) == 2
    (manifest,) = tmp_path.rglob("manifest.json")  # nothing submitted: a real run submits them later
    assert [t["state"] for t in json.loads(manifest.read_text())["trials"]] == ["pending", "pending"]
    assert sum("MFU will be null" in ln for ln in r.err.splitlines()) == 1, r.err
