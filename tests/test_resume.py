"""Fault tolerance: killed, preempted or corrupted runs resume exactly; hostile input is refused.

Every run here is the real 2-process DDP job on CPU in fp32 with dropout on (so RNG state
matters). "Exact" is bit-for-bit: same losses at every step and identical final weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    LOOM,
    LoomResult,
    kill_one_worker_after,
    launching_fixture,
    run_loom,
    start_loom,
    wait_for,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS = 24
ARGS = [*FAST, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=4", "model.dropout=0.1", "run.id=r"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def _assert_same_run(a: LoomResult, b: LoomResult) -> None:
    la, lb = a.losses(), b.losses()
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    assert la == lb, "loss curves differ"
    wa, wb = _weights(a.run_dir), _weights(b.run_dir)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@launching_fixture(scope="module")
def reference(tmp_path_factory) -> LoomResult:
    """The uninterrupted run every other one must reproduce."""
    r = run_loom("train", *ARGS, root=tmp_path_factory.mktemp("reference"))
    assert r.rc == 0, r.out + r.err
    return r


def _start(root: Path, *extra: str) -> subprocess.Popen:
    return start_loom("train", *ARGS, *extra, root=root)


@pytest.mark.launch
def test_sigkill_with_no_restart_left_fails_the_run_in_one_paragraph(tmp_path):
    """hardware.max_restarts=0: a SIGKILLed rank is a failure torchrun may not restart. The run
    ends exit 1 after one attempt, summary.json `failed` with the surviving rank's error (its
    collective lost the peer), the summary table and one paragraph naming the rank and its log,
    no traceback (the error text holds "[...]": printed as text, not rich markup). A SIGKILL that
    torchrun restarts and that resumes exactly: test_data's digits run (samples and weights)."""
    run_dir = tmp_path / "gpt" / "r"
    proc = _start(tmp_path, "hardware.max_restarts=0")
    r = kill_one_worker_after(proc, run_dir, 4, ranks=2)
    out = r.out
    assert r.rc == 1, out
    s = r.summary()
    assert s["status"] == "failed" and s["restarts"] == 0 and s["global_step"] < STEPS, s
    # the survivor's collective lost the peer: gloo says "closed" (the peer's FIN) or "reset" (its RST), by timing
    message = s["error"]["message"]
    assert s["error"]["rank"] == 0 and ("Connection closed by peer" in message or "Connection reset" in message), s

    assert not (run_dir / "final").exists()
    assert "loom run r: failed" in out and "Traceback" not in out, out[-3000:]
    paragraph = [line for line in out.splitlines() if line.startswith("Training failed")]
    assert len(paragraph) == 1 and f"Full traceback: {run_dir / 'logs' / 'rank-0.log'}" in paragraph[0], out[-3000:]
    for rank in (0, 1):  # one attempt each: no restart
        assert (run_dir / "logs" / f"rank-{rank}.log").read_text().count("started, attempt") == 1


def _preempt_after(tmp_path: Path, step: int) -> tuple[Path, dict]:
    """Start the run, SIGTERM its launcher once step-<step> is checkpointed; (run dir, summary)."""
    run_dir = tmp_path / "gpt" / "r"
    proc = _start(tmp_path)
    wait_for(run_dir / "checkpoints" / f"step-{step:07d}.ckpt", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 143, out
    return run_dir, LoomResult(143, out, "", run_dir).summary()


@pytest.mark.launch
def test_sigterm_preempts_and_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, reference):
    """SIGTERM to the launcher: a checkpoint at the step the ranks stopped at, `last` pointing to
    it, no final weights. Then that newest checkpoint is truncated (a kill during its write): the
    same command resumes from the one before and ends as the uninterrupted run."""
    run_dir, s = _preempt_after(tmp_path, 8)
    assert s["status"] == "preempted" and 8 <= s["global_step"] < STEPS
    assert (run_dir / "checkpoints" / f"step-{s['global_step']:07d}.ckpt").is_file()
    assert os.readlink(run_dir / "checkpoints" / "last.ckpt") == f"step-{s['global_step']:07d}.ckpt"
    assert not (run_dir / "final").exists()
    ckpts = sorted((run_dir / "checkpoints").glob("step-*.ckpt"))
    newest, previous = ckpts[-1], ckpts[-2]
    # a kill during a write leaves a half-written file: truncate the newest, leave a .partial
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    (run_dir / "checkpoints" / "step-0009999.ckpt.partial").write_bytes(b"half")

    again = run_loom("train", *ARGS, root=tmp_path)
    assert again.rc == 0, again.out + again.err
    assert "falling back" in (run_dir / "logs" / "rank-0.log").read_text() + again.out + again.err
    assert again.summary()["resumed_from_step"] == int(previous.name[5:12])
    _assert_same_run(reference, again)


def test_checkpoint_with_a_pickle_payload_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "MARKER"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan

    cfg = resolve([*ARGS, f"run.root={tmp_path}"])
    frozen = freeze(cfg, make_plan(cfg))
    (frozen.run_dir / "checkpoints").mkdir()
    torch.save({"state_dict": {}, "x": Payload()}, frozen.run_dir / "checkpoints" / "step-0000004.ckpt")
    r = run_loom("train", *ARGS, root=tmp_path)
    assert r.rc == 2
    assert "Refusing checkpoint" in r.err and "system" in r.err
    assert not marker.exists()


@pytest.mark.launch
def test_checkpoint_write_error_fails_the_run_loudly(tmp_path):
    run_dir = tmp_path / "gpt" / "r"
    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan

    cfg = resolve([*ARGS, f"run.root={tmp_path}"])
    freeze(cfg, make_plan(cfg))
    (run_dir / "checkpoints").write_text("not a directory")  # every checkpoint write must fail
    r = run_loom("train", *ARGS, root=tmp_path)
    assert r.rc == 1
    logs = (run_dir / "logs" / "rank-0.log").read_text()
    assert "checkpoints" in logs and ("Not a directory" in logs or "FileExistsError" in logs)
    assert r.summary()["status"] == "failed"


@pytest.mark.parametrize("how", ["override", "config file", "recipe"])
def test_hostile_target_is_refused_before_anything_runs(tmp_path, how):
    marker = tmp_path / "MARKER"
    env = {}
    if how == "override":
        args = ["+model._target_=os.system", f"+model.command=touch {marker}"]
    elif how == "config file":
        import shutil

        conf = tmp_path / "conf"
        shutil.copytree(Path(__file__).resolve().parents[1] / "conf", conf)
        (conf / "model" / "evil.yaml").write_text(f"name: gpt_tiny\n_target_: os.system\ncommand: touch {marker}\n")
        args, env = ["model=evil"], {"LOOM_CONF_DIR": str(conf)}
    if how == "recipe":
        mine = tmp_path / "my-recipes"
        mine.mkdir()
        (mine / "evil.yaml").write_text(
            "# @package _global_\n# evil: runs a shell command\ndefaults:\n  - override /model: custom\n"
            f"model:\n  module:\n    _target_: os.system\n    command: touch {marker}\n"
        )
        args = ["recipe=evil", f"hydra.searchpath=[file://{mine}]"]
    p = subprocess.run([*LOOM, "train", *args, f"run.root={tmp_path}"], capture_output=True, text=True,
                       env={**os.environ, **env}, cwd=tmp_path, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "os.system" in p.stderr and "not allowed" in p.stderr
    assert not marker.exists() and not (tmp_path / "gpt").exists()



@pytest.mark.launch
def test_a_secret_in_env_and_config_reaches_the_model_but_no_file(tmp_path):
    """The config names the secret by `${oc.env:...}`; the worker resolves it (the module checks
    it got the real value), and no byte under the run dir holds it (wandb files included)."""
    from tests_helpers import helpers_env

    secret = "sentinel-api-token-5f3a9c"
    env = {**helpers_env(tmp_path), "LOOM_TEST_API_TOKEN": secret, "WANDB_API_KEY": "sentinel-wandb-key-7e21b4"}
    args = ["model=custom", "model.module._target_=tests_helpers.TinyTokenNet", "security.allow_targets=[tests_helpers.]",
            "+model.module.api_token=${oc.env:LOOM_TEST_API_TOKEN}", "dataset=synthetic", "tracking=offline",
            "trainer.max_steps=2", "checkpoint.every_n_steps=1", "trainer.log_every_n_steps=1"]
    r = run_loom("train", *args, root=tmp_path, env=env)
    assert r.rc == 0, r.out + r.err
    files = [p for p in r.run_dir.rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files) and any(p.suffix == ".ckpt" for p in files)
    for p in files:
        data = p.read_bytes()
        assert secret.encode() not in data and b"sentinel-wandb-key-7e21b4" not in data, p
    assert "${oc.env:LOOM_TEST_API_TOKEN}" in (r.run_dir / "config.yaml").read_text()

    literal = run_loom("train", *args[:3], f"+model.module.api_token={secret}", root=tmp_path, env=env)
    assert literal.rc == 2 and "model.module.api_token" in literal.err and "oc.env" in literal.err
    assert secret not in literal.err


def test_rng_state_round_trip_and_a_resume_with_fewer_gpus():
    """Every RNG comes back; the CUDA state is this rank's device's, and an old checkpoint's list
    of every visible device's states no longer raises IndexError on a machine with fewer GPUs."""
    import random

    import numpy as np
    import torch

    from loom.worker.checkpoint_saver import own_cuda_state, rng_state, set_rng_state

    saved = rng_state()
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    set_rng_state(saved)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])
    states = [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]  # written on 8 GPUs
    assert torch.equal(own_cuda_state(states, 3), states[3])
    assert own_cuda_state(states[:2], 3) is None  # resumed where only 2 are visible
    assert own_cuda_state(states[5], 0) is states[5]  # the per-device tensor written now
