"""Continue and fine-tune: a completed run extended by a raised trainer.max_steps, and a new run
started from another run's weights (model.init_from), with real launches."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FAST, LoomResult, launching_fixture, refused, run_loom

N = 6
# checkpoint every 4 steps: N=6 is no multiple, so the run's last-step checkpoint is the one
# a continuation needs; the final weights in bf16 (a fine-tune casts them to fp32 parameters)
SOURCE = [*FAST, "strategy=single", "dataset.batch_size=4", "dataset.seq_len=64", "checkpoint.every_n_steps=4",
          "checkpoint.export_dtype=bf16", "tracking=offline", "run.id=src"]


@launching_fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, LoomResult]:
    """The source run to N steps, the same command to 2N, then to fewer steps, then to 2N again."""
    root = tmp_path_factory.mktemp("continue")
    out = {"first": run_loom("train", *SOURCE, f"trainer.max_steps={N}", root=root)}
    assert out["first"].rc == 0, out["first"].out + out["first"].err
    out["first_summary"] = out["first"].summary()  # type: ignore[assignment]
    out["second"] = run_loom("train", *SOURCE, f"trainer.max_steps={2 * N}", root=root)
    out["lower"] = run_loom("train", *SOURCE, f"trainer.max_steps={N - 2}", root=root)
    out["again"] = run_loom("train", *SOURCE, f"trainer.max_steps={2 * N}", root=root)
    return out


def printed_losses(out: str) -> dict[int, float]:
    """The `step k/M  loss x` progress lines a launch printed: a record of the losses trained
    that does not come from metrics.csv."""
    return {int(k): float(v) for k, v in re.findall(r"^step (\d+)/\d+  loss ([0-9.]+)", out, re.M)}


def test_raised_max_steps_continues_the_completed_run_in_place(runs):
    first, second = runs["first"], runs["second"]
    assert second.rc == 0, second.out + second.err
    assert f"Continuing completed run src from step {N} to {2 * N}" in second.out
    assert second.run_dir == first.run_dir
    s = second.summary()
    assert s["status"] == "completed" and s["global_step"] == 2 * N
    assert s["resumed_from_step"] == N and s["extended_from_steps"] == [N]
    steps = [int(r["step"]) for r in second.metrics() if r.get("train/loss")]
    assert steps == list(range(1, 2 * N + 1)), steps  # N+1..2N appended, nothing repeated
    # metrics.csv against what each launch printed while it trained: the first launch's steps
    # 1..N kept as they were, the extension's N+1..2N appended, no step trained twice
    before, after = printed_losses(first.out), printed_losses(second.out)
    assert sorted(before) == list(range(1, N + 1)) and sorted(after) == list(range(N + 1, 2 * N + 1)), (before, after)
    assert {k: round(v, 4) for k, v in second.losses().items()} == before | after
    # the extension trains on from the step-N weights: its first loss is near step N's, far from step 1's
    assert abs(after[N + 1] - before[N]) < 0.5 * (before[1] - before[N]), (before, after)
    # summary.json keeps the run's first loss across the extension; its final loss is the extension's
    assert round(runs["first_summary"]["final_loss"], 4) == before[N]
    assert round(s["first_loss"], 4) == before[1] and round(s["final_loss"], 4) == after[2 * N]
    plan = json.loads((second.run_dir / "plan.json").read_text())
    assert plan["extended_from_steps"] == [N] and plan["extended_at_steps"] == [N]
    assert yaml.safe_load((second.run_dir / "config.yaml").read_text())["trainer"]["max_steps"] == 2 * N
    assert (second.run_dir / "checkpoints" / f"step-{2 * N:07d}.ckpt").is_file()
    # one tracker run: both launches wrote the offline wandb run with the run id
    wandb_runs = sorted(p.name for p in (second.run_dir / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(p.endswith("-src") for p in wandb_runs), wandb_runs


def test_lowered_max_steps_is_refused_and_the_run_untouched(runs):
    lower, again = runs["lower"], runs["again"]
    assert lower.rc == 2, lower.out + lower.err
    assert "can only be raised" in lower.err and "Traceback" not in lower.err
    assert again.rc == 0 and "already completed" in again.out
    assert runs["second"].summary()["global_step"] == 2 * N


@pytest.mark.launch
def test_init_from_a_run_dir_starts_a_new_sharded_run_from_its_weights(runs, tmp_path):
    src = runs["second"]
    r = run_loom("train", *FAST, "strategy=fsdp", "dataset.batch_size=4", "dataset.seq_len=64",
                 "trainer.max_steps=2", f"model.init_from={src.run_dir}", "run.id=ft", root=tmp_path)
    assert r.rc == 0, r.out + r.err
    source_losses, first = src.losses(), r.losses()[1]
    fresh, trained = source_losses[1], source_losses[2 * N]
    assert abs(first - trained) < 0.3 * (fresh - trained), (first, trained, fresh)
    s = r.summary()
    assert s["init_from"] == str(src.run_dir / "final" / "model.safetensors") and s["resumed_from_step"] is None
    model = yaml.safe_load((r.run_dir / "config.yaml").read_text())["model"]
    assert model["init_from_fingerprint"].startswith("size=")
    assert "weights from model.init_from" in (r.run_dir / "logs" / "rank-1.log").read_text()


@pytest.mark.parametrize("override, named", [
    ("model.n_layer=1", "blocks.1.attn.qkv.weight"),
    ("model.d_model=64", "wte.weight [256, 128] in the file, [256, 64] in the model"),
])
def test_init_from_a_mismatched_model_is_refused_before_launch(runs, loom, tmp_path, override, named):
    err = refused(tmp_path, *FAST, f"model.init_from={runs['second'].run_dir}", override)
    assert "model.init_from" in err and named in err


def test_init_from_a_missing_source_is_refused(loom, tmp_path):
    err = refused(tmp_path, *FAST, f"model.init_from={tmp_path / 'nowhere'}")
    assert "does not exist" in err


# ---------------------------------------------------------------- in process: no launch


def test_the_schedule_after_an_extension_follows_the_new_total():
    from omegaconf import OmegaConf

    from loom.optim.build import build_optimizer, sync_schedule

    optim = OmegaConf.create({"name": "adamw", "lr": 1.0, "weight_decay": 0.0, "betas": [0.9, 0.95], "eps": 1e-8,
                              "warmup_steps": 0, "min_lr_ratio": 0.1, "fused": False})
    p = [("w", torch.nn.Parameter(torch.zeros(2, 2)))]
    old = build_optimizer(p, optim, max_steps=N)
    for _ in range(N):
        old["optimizer"].step()
        old["lr_scheduler"]["scheduler"].step()
    assert old["optimizer"].param_groups[0]["lr"] == pytest.approx(0.1)  # the old schedule's end
    new = build_optimizer(p, optim, max_steps=2 * N)
    new["optimizer"].load_state_dict(old["optimizer"].state_dict())
    sched = new["lr_scheduler"]["scheduler"]
    sched.load_state_dict(old["lr_scheduler"]["scheduler"].state_dict())
    sync_schedule(sched)
    assert new["optimizer"].param_groups[0]["lr"] == pytest.approx(0.55)  # half way down the new cosine


def test_older_separate_qkv_weights_load_as_the_fused_layout(tmp_path):
    from safetensors.torch import save_file

    from loom.models.gpt import separate_qkv
    from loom.models.gpt.network import GPT, read_fused_qkv, split_qkv
    from loom.models.init import FileInit
    from loom.models.init_from import file_shapes

    model, head_dim = GPT(1, 4, 32, 50, 16), 8
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    old = {k: v for k, v in state.items() if ".qkv." not in k}
    for kind in ("weight", "bias"):
        q, k, v = split_qkv(state[f"blocks.0.attn.qkv.{kind}"], head_dim)
        old |= {f"blocks.0.attn.q.{kind}": q, f"blocks.0.attn.k.{kind}": k, f"blocks.0.attn.v.{kind}": v}
    path = tmp_path / "old.safetensors"
    save_file({k: v.contiguous() for k, v in old.items()}, str(path))
    found = file_shapes(path)
    assert separate_qkv(None, path, found) == [] and found == {k: tuple(v.shape) for k, v in state.items()}
    init = FileInit(str(path), partial(read_fused_qkv, head_dim=head_dim))
    got = init.full_value("blocks.0.attn.qkv.weight", (96, 32), torch.device("cpu"))
    assert torch.equal(got, state["blocks.0.attn.qkv.weight"])


def test_a_raised_max_steps_without_run_id_names_the_run_to_continue(tmp_path):
    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan

    args = [*FAST, "strategy=single", f"run.root={tmp_path}"]
    cfg = resolve([*args, f"trainer.max_steps={N}"])
    first = freeze(cfg, make_plan(cfg))
    cfg = resolve([*args, f"trainer.max_steps={2 * N}"])
    second = freeze(cfg, make_plan(cfg))
    assert second.state == "new" and second.run_id != first.run_id
    assert f"run.id={first.run_id}" in second.message


def test_a_completed_run_without_a_checkpoint_points_to_init_from(tmp_path):
    from loom.errors import ConfigError
    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan

    args = [*FAST, "strategy=single", "run.id=x", f"run.root={tmp_path}"]
    cfg = resolve([*args, f"trainer.max_steps={N}"])
    frozen = freeze(cfg, make_plan(cfg))
    (frozen.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "global_step": N}))
    cfg = resolve([*args, f"trainer.max_steps={2 * N}"])
    with pytest.raises(ConfigError, match=f"model.init_from={frozen.run_dir}"):
        freeze(cfg, make_plan(cfg))
    assert Path(frozen.run_dir / "config.yaml").read_text().count(f"max_steps: {N}\n") == 1


def test_expected_shapes_are_the_modules_state_dicts():
    from omegaconf import OmegaConf

    from loom.models.gpt import shapes as gpt_shapes
    from loom.models.gpt.network import GPT
    from loom.models.init_from import mlp_shapes
    from loom.models.mlp import MLPClassifier

    def shapes(module: torch.nn.Module) -> dict:
        return {k: tuple(v.shape) for k, v in module.state_dict().items()}

    gpt = {"n_layer": 2, "n_head": 4, "d_model": 32, "vocab_size": 50, "block_size": 16}
    assert gpt_shapes(OmegaConf.create(gpt)) == shapes(GPT(**gpt))
    mlp = {"in_features": 64, "hidden": [16, 8], "num_classes": 10}
    assert mlp_shapes(OmegaConf.create(mlp)) == shapes(MLPClassifier(**mlp))


def test_a_custom_module_is_checked_against_its_meta_build(tmp_path):
    from safetensors.torch import save_file
    from tests_helpers import TinyTokenNet

    from loom.errors import ConfigError
    from loom.pipeline import resolve

    path = tmp_path / "net.safetensors"
    save_file(TinyTokenNet(width=32).state_dict(), str(path))
    args = ["model=custom", "model.module._target_=tests_helpers.TinyTokenNet", "security.allow_targets=[tests_helpers.]",
            "dataset=synthetic", f"model.init_from={path}"]
    assert resolve([*args, "+model.module.width=32"]).model.init_from == str(path)
    with pytest.raises(ConfigError, match=r"out.weight \[256, 32\] in the file, \[256, 16\] in the model"):
        resolve([*args, "+model.module.width=16"])
