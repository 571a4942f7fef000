"""Config composition, validation messages and run identity (in-process, no training)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from loom.compose import compose, group_options
from loom.errors import ConfigError
from loom.freeze import freeze, run_id
from loom.pipeline import resolve
from loom.plan import make_plan
from loom.schema import GROUPS


def test_default_config_lists_every_group():
    cfg = resolve([])
    for group in GROUPS:
        assert group in cfg, group
        assert cfg[group].name, group
    assert cfg.hardware.name != "auto" and cfg.hardware.resolved_from == "auto"
    assert cfg.strategy.name == "ddp" and cfg.dataset.name == "tinycode" and cfg.model.name == "gpt_tiny"
    assert cfg.tracking.name == "offline"


def test_group_options_match_conf_files():
    assert "gpt_tiny" in group_options("model") and "ddp" in group_options("strategy")


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["model=nope"], ["model=nope", "gpt_tiny", "gpt_small"]),
        (["strategy=warp"], ["strategy=warp", "ddp", "single"]),
        (["trainer.nope=1"], ["trainer.nope", "max_steps"]),
        (["nope=1"], ["nope", "trainer"]),
        (["trainer.max_steps=abc"], ["trainer.max_steps", "'abc'", "int"]),
        (["trainer.max_steps=-1"], ["trainer.max_steps", "-1", "positive"]),
        (["+trainer.extra=3"], ["trainer.extra", "max_steps"]),
        (["strategy.comm_hook=zip"], ["strategy.comm_hook", "zip", "fp16_compress"]),
        (["dataset.seq_len=4096"], ["dataset.seq_len", "4096", "block_size"]),
        (["model.n_head=3"], ["model.n_head", "3", "d_model"]),
        (["checkpoint.keep_last=1"], ["checkpoint.keep_last", ">= 2"]),
        (["trainer.max_steps=[1"], ["override"]),
    ],
)
def test_bad_input_names_key_value_and_choices(overrides, needles):
    with pytest.raises(ConfigError) as e:
        resolve(overrides)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert "Traceback" not in msg and len(msg.splitlines()) <= 2


def test_single_forces_one_device_unless_user_sets_more():
    assert resolve(["strategy=single"]).hardware.devices == 1
    with pytest.raises(ConfigError, match="hardware.devices"):
        resolve(["strategy=single", "hardware.devices=2"])


def test_run_id_is_stable_and_ignores_volatile_keys():
    a = resolve(["optim.lr=3e-4"])
    b = resolve(["optim.lr=3e-4", "tracking=csv", "trainer.log_every_n_steps=5"])
    c = resolve(["optim.lr=1e-4"])
    assert run_id(a) == run_id(b)
    assert run_id(a) != run_id(c)
    assert run_id(resolve(["run.id=exp42"])) == "exp42"


def test_freeze_writes_once_and_refuses_a_changed_config(tmp_path):
    cfg = resolve([f"run.root={tmp_path}", "run.id=fixed"])
    first = freeze(cfg, make_plan(cfg))
    assert first.state == "new" and (first.run_dir / "config.yaml").exists()
    frozen_text = (first.run_dir / "config.yaml").read_text()
    again = freeze(cfg, make_plan(cfg))
    assert again.state == "resume" and (first.run_dir / "config.yaml").read_text() == frozen_text
    changed = resolve([f"run.root={tmp_path}", "run.id=fixed", "optim.lr=0.5"])
    with pytest.raises(ConfigError, match="optim") as e:
        freeze(changed, make_plan(changed))
    assert "run.id=" in str(e.value)
    assert (first.run_dir / "config.yaml").read_text() == frozen_text


def test_compose_is_plain_hydra():
    cfg = compose(["model=gpt_small"])
    assert cfg.model.d_model == 256


def test_invalid_config_exits_2_fast_without_torch_or_run_dir(tmp_path):
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "loom.cli", "train", "model=nope", f"run.root={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    elapsed = time.perf_counter() - t0
    assert p.returncode == 2
    err_lines = [line for line in p.stderr.splitlines() if not line.startswith("import time:")]
    assert len(err_lines) == 1 and "model=nope" in err_lines[0] and "gpt_tiny" in err_lines[0]
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "pytorch_lightning" not in imported
    assert not any(tmp_path.iterdir()), "no run dir may be created for an invalid config"
    assert elapsed < 5  # generous bound for CI; the benchmark measures the real figure (< 1 s)


def test_cfg_job_prints_config_and_trains_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--cfg", "job", "optim.lr=0.002"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0
    assert "lr: 0.002" in p.stdout and "strategy:" in p.stdout
    assert not (tmp_path / "runs").exists()
