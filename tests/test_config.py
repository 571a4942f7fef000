"""Config composition, validation messages and run identity (in-process, no training)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    """Every group's choices are exactly its conf/<group>/*.yaml files, each composes as itself,
    and a wrong choice is refused naming all of them."""
    conf = Path(__file__).resolve().parents[1] / "conf"
    for group in GROUPS:
        on_disk = sorted(p.stem for p in (conf / group).iterdir() if p.suffix == ".yaml")
        assert on_disk and group_options(group) == on_disk, group
        for option in on_disk:
            node = compose([f"{group}={option}"])[group]  # hardware=auto names what it detected
            assert option in (node.name, node.get("resolved_from")), (group, option)
        with pytest.raises(ConfigError) as e:
            resolve([f"{group}=nope"])
        assert all(option in str(e.value) for option in on_disk), (group, str(e.value))


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


HEAVY = ("torch", "pytorch_lightning", "lightning", "deepspeed")


def _importtime_cli(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, set[str], list[str]]:
    """`python -X importtime -m loom.cli <args>` in tmp_path: (process, modules it imported,
    stderr less the import-time lines)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "loom.cli", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = p.stderr.splitlines()
    imported = {ln.split("|")[-1].strip() for ln in lines if ln.startswith("import time:")}
    return p, imported, [ln for ln in lines if not ln.startswith("import time:")]


# One real `loom train` per kind of refusal: what the in-process `refused` (conftest) cannot see
# is the process itself: its exit status, the whole stderr, and what it imported on the way.
@pytest.mark.parametrize(("args", "needles"), [
    (["model=nope"], ["model=nope", "gpt_tiny"]),                                     # bad group option
    (["trainer.max_steps=abc"], ["trainer.max_steps='abc'", "int"]),                  # bad value
    (["dataset=text_files", "dataset.paths=[/nonexistent/*.txt]"], ["matches no files"]),  # missing file
    (["strategy=zero2", "strategy.deepspeed_config=/nonexistent.json"], ["no such file"]),  # missing file
    (["hydra.launcher.n_jobs=2"], ["hydra.launcher.n_jobs=2", "hardware.launcher=slurm"]),  # hydra.*
], ids=["group-option", "value", "data-file", "deepspeed-json", "hydra"])
def test_cli_refusal_exits_2_in_one_paragraph_without_torch(tmp_path, args, needles):
    p, imported, err = _importtime_cli(tmp_path, "train", *args, f"run.root={tmp_path / 'runs'}")
    assert p.returncode == 2, p.stdout + "\n".join(err)
    assert len(err) == 1 and err[0].startswith("Invalid config: "), err  # one paragraph, no traceback
    for needle in needles:
        assert needle in err[0], (needle, err)
    assert not imported & set(HEAVY), imported & set(HEAVY)
    assert not any(tmp_path.iterdir()), "no run dir (nor run root) may be created for a refused config"


def test_train_on_an_infeasible_plan_exits_3_before_any_launch(tmp_path):
    """README: "A run that cannot fit exits 3 and names the cheapest fix" (`loom train`, not only plan)."""
    p, imported, err = _importtime_cli(tmp_path, "train", "model=gpt_7b", "strategy=ddp", "hardware=cpu",
                                       f"run.root={tmp_path / 'runs'}")
    assert p.returncode == 3, p.stdout + "\n".join(err)
    (why,) = [ln for ln in err if ln.startswith("Plan infeasible: ")]
    assert "strategy=ddp on hardware=cpu" in why and "hardware.host_memory_gb" in why
    assert "does not fit" in p.stdout and "Traceback" not in p.stderr
    assert not imported & set(HEAVY) and not any(tmp_path.iterdir())


@pytest.mark.parametrize("args", [
    ["train", "--help"],
    ["plan", "model=gpt_7b", "strategy=zero3", "hardware=h100x8"],
    ["plan", "--compare", "model=gpt_7b", "hardware=h100x8"],
], ids=["help", "plan", "plan-compare"])
def test_help_and_plan_answer_without_torch(tmp_path, args):
    """The fast answers (speed goals: scripts/bench/cli_latency.py) never import the training stack."""
    p, imported, err = _importtime_cli(tmp_path, *args)
    assert p.returncode == 0, "\n".join(err)
    assert p.stdout.strip() and not imported & set(HEAVY), imported & set(HEAVY)
    assert not any(tmp_path.iterdir())


def test_cfg_job_prints_config_and_trains_nothing(tmp_path):
    p = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--cfg", "job", "optim.lr=0.002"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0
    assert "lr: 0.002" in p.stdout and "strategy:" in p.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("edit", ["tokenizer", "model_config"])
def test_an_edited_tokenizer_or_model_config_dir_is_refused_on_resume(tmp_path, edit):
    """README: the run id covers the tokenizer and model config dirs a config names; a file
    edited there since the run was frozen is refused on resume, naming the key (no training)."""
    import json
    import os

    from tests_helpers import make_hf_config, make_tokenizer, write_json_corpus

    tok, cfg_dir = make_tokenizer(tmp_path / "tok"), make_hf_config(tmp_path / "cfg", vocab_size=300)
    args = ["model=hf_causal_lm", f"model.config={cfg_dir}", "dataset=hf", f"dataset.path={write_json_corpus(tmp_path / 'd.jsonl')}",
            f"dataset.tokenizer={tok}", "dataset.text_column=content", "dataset.seq_len=32", "strategy=single", "hardware=cpu",
            f"run.root={tmp_path}"]
    cfg = resolve([*args, "run.id=fixed"])
    first = freeze(cfg, make_plan(cfg))
    assert freeze(cfg, make_plan(cfg)).state == "resume"  # untouched: the same command resumes
    auto_id = run_id(resolve(args))
    target = tok / "tokenizer_config.json" if edit == "tokenizer" else cfg_dir / "config.json"
    content = json.loads(target.read_text())
    target.write_text(json.dumps({**content, "loom_test_edit": 1}))
    os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 10**9))
    key, named = ("dataset", "tokenizer") if edit == "tokenizer" else ("model.config", str(target))
    with pytest.raises(ConfigError, match="content changed since the run was frozen") as e:
        freeze(cfg, make_plan(cfg))
    assert f"{key}: " in str(e.value) and named in str(e.value), str(e.value)
    assert run_id(resolve(args)) != auto_id  # without run.id: a new run, not a resume
    assert (first.run_dir / "config.yaml").is_file()


@pytest.mark.parametrize("option", ["text_files", "hf"])
def test_editing_a_corpus_file_changes_the_run_id(tmp_path, option):
    """The run id covers the files each dataset option declares it reads (its registry entry's
    `inputs`): appending to a corpus file is a new run, not a resume of the old one. Every option
    of the registry declares its inputs (a file-based option with none would fail this test)."""
    import os

    from tests_helpers import write_json_corpus

    from loom.data.registry import DATASETS

    corpus = write_json_corpus(tmp_path / ("d.jsonl" if option == "hf" else "d.txt"))
    data = ["dataset=hf", f"dataset.path={corpus}", "dataset.text_column=content"] if option == "hf" else \
        ["dataset=text_files", f"dataset.paths=[{corpus}]", "dataset.val_every=0", "dataset.val_fraction=0.1"]
    args = [*data, "strategy=single", "hardware=cpu", f"run.root={tmp_path}"]
    cfg = resolve(args)
    assert [str(f) for f in DATASETS[option].inputs(cfg.dataset).files] == [str(corpus.resolve())]
    before = run_id(cfg)
    with open(corpus, "a") as f:
        f.write("one more document\n")
    os.utime(corpus, ns=(corpus.stat().st_atime_ns, corpus.stat().st_mtime_ns + 10**9))
    assert run_id(resolve(args)) != before


def test_version_names_loom_python_torch_cuda_and_nccl():
    import torch
    from conftest import LOOM

    p = subprocess.run([*LOOM, "--version"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["loom", "python", "torch", "cuda", "nccl"], p.stdout
    assert f"torch {torch.__version__}" in lines
    assert lines[3] == f"cuda {torch.version.cuda or 'none (a CPU build)'}"


def test_a_tracker_whose_package_is_missing_is_refused_at_validation(tmp_path, monkeypatch):
    """tracking=offline without wandb (a core install): exit 2 before compose/plan/freeze are
    spent, naming the package, its extra and tracking=csv; tracking=csv needs no wandb."""
    import importlib.abc

    class NoWandb(importlib.abc.MetaPathFinder):  # this interpreter as if wandb were not installed
        def find_spec(self, name, path=None, target=None):
            if name == "wandb" or name.startswith("wandb."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    monkeypatch.setattr(sys, "meta_path", [NoWandb(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    from conftest import refused

    err = refused(tmp_path, "tracking=offline", "trainer.max_steps=2")
    assert "tracking=offline needs the Python package wandb" in err
    assert "loom[tracking]" in err and "tracking=csv" in err
    assert resolve(["tracking=csv"]).tracking.name == "csv"  # validates without it


def test_the_docs_config_group_table_is_conf_s():
    """Every option of every group (chat, tokens, moe*, the sft recipe included) and the defaults, as
    conf/ has them: generated by loom.compose.recipes.groups_table()."""
    from conftest import ROOT

    from loom.compose.recipes import groups_table

    readme = (ROOT / "docs" / "reference.md").read_text()
    table = readme.split("<!-- config-groups:begin -->\n")[1].split("\n<!-- config-groups:end -->")[0]
    assert table == groups_table(), "regenerate it: python -c 'from loom.compose.recipes import groups_table as t; print(t())'"
    assert all(o in table for o in ("chat", "tokens", "moe_tiny", "sft", "qwen3_moe_30b_a3b"))
