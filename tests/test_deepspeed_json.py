"""A Hugging Face DeepSpeed JSON drops in, and what a run reads is part of what it is.

- A typical HF ZeRO-2 JSON full of "auto" trains on 2 CPU processes through Loom's zero2
  strategy, with Loom's optimizer and schedule (same curve as the shared `single` run), the resolved JSON in
  plan.json; editing the file afterwards is refused on resume (explicit run.id), naming it.
- Every conflict with the run config, and every unknown or ill-typed key (DeepSpeed's own key
  set, from a torch-free table), is reported at once: exit 2 in validation.
- The table cannot drift from DeepSpeed's pydantic models, and the shipped examples
  (conf/deepspeed/*.json) are accepted by DeepSpeed's own DeepSpeedConfig once resolved.
- A changed dataset file changes the auto run id, and is refused on resume under run.id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, B, launching_fixture, refused, run_loom, strategy_args

from loom.errors import ConfigError

EXAMPLES = ROOT / "conf" / "deepspeed"
# Each shipped example and the overrides it is written for.
EXAMPLE_ARGS = {
    "zero1.json": ["strategy=zero1"],
    "zero2.json": ["strategy=zero2"],
    "zero2_bf16.json": ["strategy=zero2", "hardware.precision=bf16-mixed"],
    "zero3.json": ["strategy=zero3"],
    "zero3_offload.json": ["strategy=zero3_offload", "strategy.offload_params=true"],
}

# As the Hugging Face DeepSpeed integration documents its ZeRO-2 config.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def _write_tmp(data: dict) -> Path:
    import tempfile

    return _write(Path(tempfile.mkdtemp()) / "ds.json", data)


def _autos(d) -> list:
    if isinstance(d, dict):
        return [k for k, v in d.items() if v == "auto"] + [a for v in d.values() for a in _autos(v)]
    return []


@launching_fixture(scope="module")
def hf_run(tmp_path_factory, single_run) -> dict:
    """The HF JSON under zero2's parity run (2 ranks, batch 4 each, run.id fixed), and the shared
    `single` reference. Loom's default schedule runs (cosine; the JSON's WarmupLR is a warning)."""
    root = tmp_path_factory.mktemp("dsjson")
    ds = _write(root / "ds_zero2.json", HF_ZERO2)
    zero2 = ["train", *strategy_args("zero2", f"strategy.deepspeed_config={ds}", "run.id=hf-zero2")]
    return {"root": root, "json": ds, "args": zero2, "run": run_loom(*zero2, root=root), "single": single_run}


@pytest.mark.slow
def test_hf_zero2_json_trains_with_loom_optimizer(hf_run):
    r, ref = hf_run["run"], hf_run["single"]
    assert r.rc == 0 and ref.rc == 0, r.out + r.err + ref.err
    assert r.summary()["status"] == "completed"
    ds = json.loads((r.run_dir / "plan.json").read_text())["deepspeed_config"]
    assert _autos(ds) == []
    assert ds["train_batch_size"] == 2 * B and ds["train_micro_batch_size_per_gpu"] == B
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 1.0
    assert ds["fp16"]["enabled"] is False and ds["bf16"] == {"enabled": False}
    assert ds["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert ds["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # gpt_tiny: d_model 128
    # Lightning would let DeepSpeed build the JSON's optimizer; Loom's torch AdamW ran instead,
    # with Loom's schedule: the curve is `single`'s.
    log = (r.run_dir / "logs" / "rank-0.log").read_text()
    assert "specified an optimizer and/or scheduler within the DeepSpeed config" not in log
    for step, loss in ref.losses().items():
        assert abs(r.losses()[step] - loss) < 1e-3, (step, r.losses()[step], loss)


@pytest.mark.slow
def test_edited_json_is_refused_on_resume(hf_run):
    root, path = hf_run["root"], hf_run["json"]
    again = run_loom(*hf_run["args"], root=root)
    assert again.rc == 0 and "already completed" in again.out, again.out + again.err
    _write(path, {**HF_ZERO2, "zero_optimization": {**HF_ZERO2["zero_optimization"], "overlap_comm": False}})
    r = run_loom(*hf_run["args"], root=root)
    assert r.rc == 2, r.out + r.err
    assert "strategy.deepspeed_config" in r.err and str(path) in r.err and "content changed" in r.err
    assert "Traceback" not in r.err


def test_all_conflicts_in_one_message(loom, tmp_path):
    bad = {**HF_ZERO2, "train_batch_size": 999, "gradient_clipping": 0.5, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "betas": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    path = _write(tmp_path / "ds.json", bad)
    err = refused(tmp_path, "strategy=zero2", f"strategy.deepspeed_config={path}",
                       "dataset.batch_size=4", "optim.warmup_steps=10")
    assert "7 problems" in err, err
    for text in ("train_batch_size=999", "Loom sets train_batch_size=8 from dataset.batch_size=4 x trainer.accumulate_grad_batches=1 "
                 "x 2 data-parallel ranks", "gradient_clipping=0.5", "bf16.enabled=True",
                 "hardware.precision=32-true", "optimizer.params.lr=0.5", "optim.lr=0.001",
                 "scheduler.params.warmup_num_steps=7", "optim.warmup_steps=10",
                 "zero_optimization.stage=3", "strategy=zero2",
                 "zero_optimization.offload_optimizer.device='cpu'", "strategy.offload_optimizer=false"):
        assert text in err, (text, err)


def test_unknown_and_ill_typed_keys_fail_fast(loom, tmp_path):
    bad = {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8, "overlap_comm": "yes",
                                 "allgather_bucket_size": -1, "offload_optimizer": {"device": "disk"}},
           "trian_batch_size": 8, "gradient_clipping": "high", "amp": {"enabled": True},
           "fp16": {"enabled": "auto", "loss_scale_windw": 100}, "optimizer": {"type": "Lamb"}}
    path = _write(tmp_path / "ds.json", bad)
    err = refused(tmp_path, "strategy=zero2", f"strategy.deepspeed_config={path}")
    for text in ("zero_optimization.reduce_bucket_sise: unknown key", "did you mean reduce_bucket_size",
                 "zero_optimization.overlap_comm='yes': must be true or false or null",
                 "zero_optimization.allgather_bucket_size=-1: must be an integer >= 0",
                 "zero_optimization.offload_optimizer.device='disk': must be one of none, cpu, nvme",
                 "trian_batch_size: unknown key", "did you mean train_batch_size",
                 "gradient_clipping='high': must be a number >= 0", "amp: removed from DeepSpeed",
                 "fp16.loss_scale_windw: unknown key", "optimizer.type='Lamb'"):
        assert text in err, (text, err)


def test_optimizer_block_must_describe_optim():
    """The JSON's optimizer/scheduler blocks describe `optim` (Loom builds the optimizer)."""
    from loom import strategies
    from loom.pipeline import resolve
    from loom.strategies.deepspeed_config import resolve_deepspeed

    with pytest.raises(ConfigError, match=r"1 problem .*\n  - optimizer.type='AdamW'.*optim=sgd.*set optim=adamw"):
        resolve(["strategy=zero2", "optim=sgd", f"strategy.deepspeed_config={EXAMPLES / 'zero2.json'}"])
    cfg = resolve(["strategy=zero2", f"strategy.deepspeed_config={EXAMPLES / 'zero2.json'}"])
    res = resolve_deepspeed(cfg, strategies.layout_of(cfg))
    assert res.problems == [] and res.warnings == []  # WarmupCosineLR is Loom's schedule's shape
    assert res.config["scheduler"]["params"] == {"warmup_num_steps": 10, "total_num_steps": cfg.trainer.max_steps,
                                                 "cos_min_ratio": 0.1}
    hf = resolve(["strategy=zero2", f"strategy.deepspeed_config={_write_tmp(HF_ZERO2)}"])
    warnings = resolve_deepspeed(hf, strategies.layout_of(hf)).warnings
    assert len(warnings) == 1 and "scheduler WarmupLR is not what runs" in warnings[0]


@pytest.mark.parametrize("name", sorted(EXAMPLE_ARGS))
def test_shipped_example_resolves(name):
    from loom import strategies
    from loom.pipeline import resolve
    from loom.strategies.deepspeed_config import resolved_deepspeed_config, zero_stage

    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(EXAMPLE_ARGS)
    cfg = resolve([*EXAMPLE_ARGS[name], f"strategy.deepspeed_config={EXAMPLES / name}"])
    ds = resolved_deepspeed_config(cfg, strategies.layout_of(cfg))
    assert _autos(ds) == [] and ds["zero_optimization"]["stage"] == zero_stage(cfg.strategy.name)


def test_key_table_matches_deepspeed_and_examples_pass_deepspeed_config():
    """The torch-free table is what DeepSpeed's models say; resolved examples pass DeepSpeed."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from loom import strategies
    from loom.pipeline import resolve
    from loom.strategies import deepspeed_keys
    from loom.strategies.deepspeed_check import SCALARS
    from loom.strategies.deepspeed_config import resolved_deepspeed_config
    from loom.strategies.deepspeed_keys_gen import table_from_deepspeed

    table = table_from_deepspeed()
    for key, value in table.items():
        assert getattr(deepspeed_keys, key) == value, (
            f"{key} differs from the installed DeepSpeed: regenerate with "
            "`python -m loom.strategies.deepspeed_keys_gen > platform/loom/strategies/deepspeed_keys.py`")
    assert set(SCALARS) <= set(table["TOP_LEVEL"])
    for name, args in EXAMPLE_ARGS.items():
        cfg = resolve([*args, "hardware=cpu", "hardware.devices=1", f"strategy.deepspeed_config={EXAMPLES / name}"])
        resolved = resolved_deepspeed_config(cfg, strategies.layout_of(cfg))
        ds = DeepSpeedConfig(resolved)  # world size 1 without a process group; raises on a bad config
        assert ds.zero_optimization_stage == resolved["zero_optimization"]["stage"], name
        assert ds.train_batch_size == cfg.dataset.batch_size


def test_dataset_change_changes_run_id_or_is_refused(tmp_path):
    from loom.freeze import freeze, input_fingerprints, run_id
    from loom.pipeline import resolve
    from loom.plan import make_plan

    files = [tmp_path / f"doc{i}.txt" for i in range(3)]
    for f in files:
        f.write_text("hello world. " * 400)
    args = ["strategy=single", "hardware.devices=1", "dataset=text_files", f"dataset.paths=[{tmp_path}/*.txt]",
            "dataset.val_every=0", "dataset.seq_len=32", "dataset.batch_size=2", f"run.root={tmp_path / 'runs'}"]
    cfg = resolve(args)
    before = run_id(cfg)
    assert "3 files" in input_fingerprints(cfg)["dataset"]
    frozen = freeze(resolve([*args, "run.id=fixed"]), make_plan(cfg))
    assert json.loads((frozen.run_dir / "plan.json").read_text())["inputs"]["dataset"].startswith("3 files")
    files[1].write_text("hello world, edited. " * 300)
    assert run_id(resolve(args)) != before  # auto run id: a new run
    with pytest.raises(ConfigError, match="dataset: the content changed since the run was frozen"):
        freeze(resolve([*args, "run.id=fixed"]), make_plan(cfg))
