"""`hardware=slurm`: the rendered sbatch script, the submission, and the job end to end.

The end-to-end test runs Loom's real job script on this machine with fake `sbatch`, `srun`
and `scontrol` on PATH (tests/slurm_shims.py): sbatch starts the script, srun runs its
torchrun command once per "node" with SLURM_* set, and scontrol requeue starts the script
again. Training, the SIGUSR1 -> checkpoint -> requeue -> resume cycle and summary.json are real.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, LOOM, alive, count_launch
from slurm_shims import install, install_step_srun

# The SLURM profile on CPU "nodes" (the profile itself is for H100 nodes).
CPU = ["hardware=slurm", "hardware.accelerator=cpu", "hardware.backend=gloo", "hardware.precision=32-true",
       "hardware.dataloader_workers=0", "hardware.pin_memory=false"]


def _env(path_dirs: list[Path] | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **extra}
    bare = [d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "sbatch").exists()]
    env["PATH"] = os.pathsep.join([*(str(d) for d in path_dirs or []), *bare])
    return env


def _loom(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    verb, *rest = args
    return subprocess.run([*LOOM, verb, *rest, f"run.root={tmp_path}"], capture_output=True, text=True,
                          cwd=tmp_path, env=env or _env(), timeout=timeout)


def _sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_rendered_script_follows_the_profile(tmp_path):
    p = _loom(tmp_path, "train", "--dry-run", "hardware=slurm", "strategy=fsdp_tp", "strategy.tensor_parallel=4",
              "hardware.num_nodes=4", "hardware.slurm.partition=gpu-h100", "hardware.slurm.account=proj42",
              "hardware.slurm.qos=high", "hardware.slurm.time_limit=1-12:00:00", "hardware.slurm.mem_gb=512",
              "hardware.slurm.constraint=ib", "hardware.slurm.signal_before_s=300",
              "hardware.slurm.extra_args=[--exclusive]", "hardware.slurm.setup=[module load cuda/12.4]",
              "hardware.max_restarts=2", "run.id=big")
    assert p.returncode == 0, p.stderr
    run_dir = tmp_path / "gpt" / "big"
    script_path = run_dir / "slurm" / "job.sbatch"
    assert f"wrote {script_path}" in p.stdout and f"sbatch {script_path}" in p.stdout
    script = script_path.read_text()
    assert script.startswith("#!/bin/bash\n") and os.access(script_path, os.X_OK)
    assert _sbatch_lines(script) == [
        "--job-name=loom-gpt-big", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=72", "--mem=524288M", "--time=1-12:00:00", "--partition=gpu-h100",
        "--account=proj42", "--qos=high", "--constraint=ib", "--signal=B:USR1@300", "--requeue",
        "--open-mode=append", f"--output={run_dir}/slurm/slurm-%j.out", "--exclusive",
    ]
    # every #SBATCH line precedes the first command (sbatch stops reading them there)
    first_cmd = next(i for i, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH")) < first_cmd
    assert "module load cuda/12.4" in script
    # one torchrun per node through srun, rendezvous on the first node, the frozen run dir
    assert ('srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=72 '
            "--gpus-per-node=8 --kill-on-bad-exit=1") in script
    torchrun = script[script.index('"$PYTHON" \\\n    -m loom.worker.agent'):script.index("srun_pid=$!")]
    for part in ("--nproc-per-node=8", "--nnodes=4", "--max-restarts=2", "--rdzv-backend=c10d",
                 '--rdzv-endpoint="$RDZV_ENDPOINT"', "--rdzv-id=big", '"$RUN_DIR"'):
        assert part in torchrun, part
    assert f"RUN_DIR={run_dir}" in script and f"PYTHON={sys.executable}" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    # SIGUSR1 -> SIGTERM to the step -> ranks checkpoint -> finish says 143 -> requeue
    assert "trap on_usr1 USR1" in script and 'kill -TERM "$srun_pid"' in script
    assert 'loom.finish finish "$RUN_DIR" --rc "$rc"' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    bash = subprocess.run(["bash", "-n", str(script_path)], capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    # frozen like any run: the requeued job resumes this config
    assert (run_dir / "config.yaml").exists() and (run_dir / "plan.json").exists()


def test_sbatch_missing_is_a_clear_error_naming_dry_run(tmp_path):
    p = _loom(tmp_path, "train", "hardware=slurm", "run.id=x", env=_env())
    assert p.returncode == 2
    assert "sbatch" in p.stderr and "--dry-run" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "gpt").exists()  # refused before anything was written


def test_allocation_checks_run_for_plan_too():
    from loom.errors import ConfigError
    from loom.pipeline import resolve

    with pytest.raises(ConfigError, match=r"extra_args.*--nodes.*hardware.num_nodes"):
        resolve(["hardware=slurm", "hardware.slurm.extra_args=['--nodes=8']"])
    with pytest.raises(ConfigError, match=r"signal_before_s"):
        resolve(["hardware=slurm", "hardware.slurm.time_limit=00:01:00", "hardware.slurm.signal_before_s=90"])
    with pytest.raises(ConfigError, match=r"cpus_per_task=4.*hardware.devices=8"):
        resolve(["hardware=slurm", "hardware.slurm.cpus_per_task=4"])
    with pytest.raises(ConfigError, match=r"tensor_parallel"):  # TP groups stay within a node
        resolve(["hardware=slurm", "strategy=fsdp_tp", "strategy.tensor_parallel=16"])


def test_submission_prints_the_job_and_records_it(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    install(bin_dir, state)
    # a submit-only sbatch: the job itself is the next test's business
    (bin_dir / "sbatch").write_text(f"#!{sys.executable}\nprint('777;cluster1')\n")
    p = _loom(tmp_path, "train", *CPU, "hardware.devices=1", "run.id=sub", env=_env([bin_dir]))
    assert p.returncode == 0, p.stderr
    assert "SLURM job 777" in p.stdout
    run_dir = tmp_path / "gpt" / "sub"
    assert (run_dir / "slurm" / "job_id").read_text().strip() == "777"
    assert "777" in (run_dir / "slurm" / "jobs.log").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, what: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s; job log:\n{log.read_text() if log.exists() else ''}")
        time.sleep(0.1)


@pytest.mark.launch
def test_job_script_trains_is_requeued_at_the_time_limit_and_resumes(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    install(bin_dir, state)
    env = _env([bin_dir], LOOM_SHIM_STATE=str(state), LOOM_RDZV_PORT=str(_free_port()))
    steps = 12
    p = _loom(tmp_path, "train", *CPU, "hardware.num_nodes=2", "hardware.devices=1", "run.id=sl",
              *FAST, f"trainer.max_steps={steps}", "checkpoint.every_n_steps=4", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SLURM job 4242" in p.stdout
    count_launch()  # the shimmed job trains: two nodes, then requeued
    run_dir = tmp_path / "gpt" / "sl"
    log = run_dir / "slurm" / "slurm-4242.out"
    pids = state / "pids"
    first = int(pids.read_text().split()[0])

    # the time limit nears: SLURM sends SIGUSR1 to the batch script (--signal=B:USR1@...)
    _wait(lambda: (run_dir / "checkpoints" / "step-0000004.ckpt").exists(), "a first checkpoint", 300, log)
    os.kill(first, signal.SIGUSR1)
    _wait(lambda: len(pids.read_text().split()) == 2, "the job requeued", 300, log)
    _wait(lambda: not any(alive(int(x)) for x in pids.read_text().split()), "the requeued job ended", 400, log)

    calls = (state / "calls.log").read_text()
    assert "scontrol requeue 4242" in calls and calls.count("srun --nodes") == 2
    out = log.read_text()
    assert "SIGUSR1" in out and "requeueing job 4242" in out and "(requeue 1)" in out
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["global_step"] == steps
    assert s["world_size"] == 2 and s["num_nodes"] == 2
    assert s["resumed_from_step"] is not None and 4 <= s["resumed_from_step"] < steps
    assert len(s["memory"]["peak_rss_gb_per_rank"]) == 2
    assert (run_dir / "final" / "model.safetensors").exists()
    assert sorted(x.name for x in (run_dir / "logs").glob("rank-*.log")) == ["rank-0.log", "rank-1.log"]
    assert list((tmp_path / "gpt").iterdir()) == [run_dir]  # one run dir, both attempts


def test_a_sweep_of_slurm_trials_records_submitted_jobs_then_their_outcome(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    install(bin_dir, state)
    (bin_dir / "sbatch").write_text(f"#!{sys.executable}\nimport random\nprint(f'{{random.randrange(10**6)}};c1')\n")
    (bin_dir / "squeue").write_text(f"#!{sys.executable}\nprint('RUNNING')\n")  # the jobs are still running
    for f in ("sbatch", "squeue"):
        (bin_dir / f).chmod(0o755)
    env = _env([bin_dir])
    args = ("train", "-m", *CPU, "hardware.devices=1", "optim.lr=1e-3,2e-3")
    p = _loom(tmp_path, *args, env=env)
    assert p.returncode == 0, p.stderr
    (manifest_path,) = tmp_path.glob("gpt/sweeps/*/manifest.json")
    trials = json.loads(manifest_path.read_text())["trials"]
    assert [t["state"] for t in trials] == ["submitted", "submitted"] and all(t["job_id"] for t in trials)
    assert "submitted to SLURM" in p.stdout

    # again while the jobs run: nothing is submitted twice
    jobs = {t["job_id"] for t in trials}
    p = _loom(tmp_path, *args, env=env)
    assert p.returncode == 0 and p.stdout.count("still queued or running") == 2
    assert {t["job_id"] for t in json.loads(manifest_path.read_text())["trials"]} == jobs

    # a finished job: its summary says completed, and the manifest follows it
    run_dir = Path(trials[0]["run_dir"])
    summary = {"status": "completed", "final_loss": 1.5}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    p = _loom(tmp_path, *args, env=env)
    states = [t["state"] for t in json.loads(manifest_path.read_text())["trials"]]
    assert states == ["completed", "submitted"], p.stdout + p.stderr


def test_optuna_sweeps_are_refused_on_slurm(tmp_path):
    p = _loom(tmp_path, "train", "-m", *CPU, "hydra/sweeper=optuna", "optim.lr=interval(1e-4,1e-2)")
    assert p.returncode == 2 and "optuna" in p.stderr and "SLURM" in p.stderr


# ----------------------------------------------------------------------------- the script's own rules


def test_another_template_from_loom_slurm_template(tmp_path, monkeypatch):
    """LOOM_SLURM_TEMPLATE names a site's own template: its lines and the filled placeholders;
    a placeholder Loom does not know is refused, naming it and the known ones."""
    from loom.errors import ConfigError
    from loom.launch.slurm import render
    from loom.pipeline import resolve

    site = tmp_path / "site.sbatch"
    site.write_text("#!/bin/bash\n{{sbatch_lines}}\n#SBATCH --comment=site-template\nmodule load site-env\n"
                    "srun {{srun_options}} \\\n  {{torchrun}}\n")
    monkeypatch.setenv("LOOM_SLURM_TEMPLATE", str(site))
    script = render(resolve(["hardware=slurm", "run.id=t"]), tmp_path)
    assert "#SBATCH --comment=site-template" in script and "module load site-env" in script
    assert "#SBATCH --nodes=2" in script and "-m loom.worker.agent" in script and "{{" not in script
    assert "trap on_usr1" not in script  # not Loom's own template
    site.write_text("{{sbatch_lines}}\n{{site_only}}\n")
    with pytest.raises(ConfigError, match="site_only.*known: "):
        render(resolve(["hardware=slurm", "run.id=t"]), tmp_path)


def test_an_elastic_run_asks_slurm_for_a_node_range():
    """hardware.min_nodes: `--nodes=min-max`, torchrun's --nnodes=min:max, and no
    --kill-on-bad-exit (a lost node must not end the job step of the others)."""
    from loom.launch.slurm import render
    from loom.pipeline import resolve

    script = render(resolve(["hardware=slurm", "hardware.num_nodes=4", "hardware.min_nodes=2", "run.id=e"]), "/r")
    assert "--nodes=2-4" in _sbatch_lines(script) and "--nnodes=2:4" in script
    assert "--kill-on-bad-exit" not in script
    fixed = render(resolve(["hardware=slurm", "hardware.num_nodes=4", "run.id=e"]), "/r")
    assert "--nodes=4" in _sbatch_lines(fixed) and "--kill-on-bad-exit=1" in fixed


def test_a_run_whose_job_is_still_queued_is_not_submitted_again(tmp_path, monkeypatch):
    """`loom train` asks squeue about the run's last job: queued or running, it refuses (naming
    the job, its state and scancel) and sbatch is not called; a finished job does not hold it."""
    from loom.errors import ConfigError
    from loom.launch.slurm import submit
    from loom.pipeline import resolve

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "squeue-state"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {state}\n")
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'sbatch.log'}\necho 778\n")
    for f in ("squeue", "sbatch"):
        (bin_dir / f).chmod(0o755)
    monkeypatch.setenv("PATH", _env([bin_dir])["PATH"])
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "slurm" / "job_id").write_text("777\n")
    cfg = resolve([*CPU, "hardware.devices=1", "run.id=q"])
    state.write_text("PENDING\n")
    with pytest.raises(ConfigError, match=r"SLURM job 777 \(PENDING\)") as e:
        submit(cfg, run_dir)
    assert "scancel 777" in str(e.value) and not (tmp_path / "sbatch.log").exists()
    state.write_text("")  # squeue no longer lists it: the job ended
    assert submit(cfg, run_dir) == 0
    assert (tmp_path / "sbatch.log").exists() and (run_dir / "slurm" / "job_id").read_text() == "778\n"


def _job_without_training(tmp_path: Path, preempted_at: tuple[int, int]) -> tuple[Path, Path, int]:
    """A frozen run's real job script (`--dry-run`: nothing trains), submitted to the shims with
    an srun that trains nothing (slurm_shims.STEP_SRUN); the summary its ranks "write" when
    stopped says (global_step, resumed_from_step) = `preempted_at`. Returns (run dir, state, pid)."""
    from loom.rundir.config_file import load_frozen
    from loom.rundir.summary import empty_summary
    from loom.strategies import layout_of

    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    install(bin_dir, state)
    install_step_srun(bin_dir)
    p = _loom(tmp_path, "train", "--dry-run", *CPU, "hardware.devices=1", "run.id=j", *FAST)
    assert p.returncode == 0, p.stderr
    run_dir = tmp_path / "gpt" / "j"
    cfg = load_frozen(run_dir / "config.yaml")
    base = empty_summary(cfg, "j", layout_of(cfg))
    step, start = preempted_at
    (state / "preempted.json").write_text(json.dumps({**base, "status": "preempted", "global_step": step,
                                                      "resumed_from_step": start}))
    (state / "completed.json").write_text(json.dumps({**base, "status": "completed", "global_step": 12,
                                                      "resumed_from_step": step}))
    env = _env([bin_dir], LOOM_SHIM_STATE=str(state))
    subprocess.run(["sbatch", str(run_dir / "slurm" / "job.sbatch")], env=env, check=True, capture_output=True)
    log = run_dir / "slurm" / "slurm-4242.out"
    _wait((state / "srun.ready").exists, "the job step started", 180, log)
    return run_dir, state, int((state / "pids").read_text().split()[0])


@pytest.mark.parametrize("case", ["progress", "no progress", "scancel"])
def test_the_job_requeues_only_a_signalled_attempt_that_made_progress(tmp_path, case):
    """SIGUSR1 (the time limit nears) -> the step stops preempted -> requeue, unless that attempt
    made no progress (global_step == resumed_from_step: it would loop); a job you scancel (SIGTERM
    to the job's processes) is never requeued."""
    run_dir, state, pid = _job_without_training(tmp_path, (4, 4) if case == "no progress" else (8, 4))
    log = run_dir / "slurm" / "slurm-4242.out"
    if case == "scancel":
        os.killpg(pid, signal.SIGTERM)
    else:
        os.kill(pid, signal.SIGUSR1)
    pids = state / "pids"
    _wait(lambda: not any(alive(int(x)) for x in pids.read_text().split()), "the job(s) ended", 180, log)
    calls, out = (state / "calls.log").read_text(), log.read_text()
    assert "srun stopped by 15" in calls, calls  # the ranks got their SIGTERM: a checkpointed stop
    summary = json.loads((run_dir / "summary.json").read_text())
    if case == "progress":
        assert "scontrol requeue 4242" in calls and "requeueing job 4242" in out, out
        assert summary["status"] == "completed"  # the requeued attempt ran
        return
    assert "scontrol requeue" not in calls and "requeueing job" not in out, out
    assert summary["status"] == "preempted" and len(pids.read_text().split()) == 1
    if case == "no progress":
        assert "without progress since the last start: not requeueing" in out, out
