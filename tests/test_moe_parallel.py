"""Expert parallelism (strategy.ep): one launch for its parity with one process, and in-process
what validation refuses, what the plan counts, and a rehearsal of a rank over the fake process
group. (Routing, grouped matmul and the balance loss: tests/test_moe.py; the all-to-all on gloo
ranks: tests/test_moe_dispatch.py; Hugging Face checkpoints: tests/test_moe_hf.py.)"""

from __future__ import annotations

import csv

import pytest
from conftest import FAST, refused, run_loom

from loom.pipeline import resolve
from loom.plan import make_plan

# SGD (no Adam scale invariance) with clipping: a wrong expert-gradient scale changes the losses
# (without the 1/ep, step 4 is 1.5e-4 off; with it 5e-7, float32 summation order)
PARITY = ["model=moe_tiny", "hardware=cpu", *FAST, "trainer.max_steps=4", "optim=sgd", "trainer.gradient_clip_val=0.5",
          "trainer.limit_val_batches=0", "checkpoint.every_n_steps=2"]
QWEN = ["model=qwen3_moe_30b_a3b", "strategy=nd", "hardware=h100x8", "dataset.batch_size=8", *FAST]


def _losses(run_dir) -> list[float]:
    return [float(r["train/loss"]) for r in csv.DictReader(open(run_dir / "metrics.csv")) if r.get("train/loss")]


@pytest.mark.launch
def test_ep_2_over_4_ranks_trains_as_one_process_and_resumes_at_ep_1(tmp_path):
    """ep 2 x 2 ranks sharding each expert set (all-to-all + FSDP2 reduce-scatter of the experts)
    for 2 steps, then the same run resumed in this process at ep 1 on one rank (a world and
    expert-parallel change: the checkpoint's experts resharded) and raised to 4 steps: every
    step's loss is that of the same global batch trained by one process (no second launch)."""
    from conftest import resume_in_process

    from loom.freeze import freeze
    from loom.rundir.config_file import load_frozen
    from loom.worker.fit import fit

    both = [*PARITY, "strategy=fsdp", "dataset.batch_size=8", "trainer.global_batch_size=32", "run.id=ep"]
    run = run_loom("train", *both, "strategy.ep=2", "hardware.devices=4", "trainer.max_steps=2", root=tmp_path)
    assert run.rc == 0, run.out + run.err
    log = (run.run_dir / "logs" / "rank-0.log").read_text()
    assert "expert parallelism: 2 expert set(s) split over ep=2, sharded over 2 rank(s) each" in log
    summary = run.summary()
    assert summary["parallel"]["ep"] == 2
    # the load is the whole step's: 4 ranks x 8 x 128 tokens x top-2 over the 2 layers
    assert sum(summary["moe"]["tokens_per_expert_last_step"]) == 2 * 4 * 8 * 128 * 2
    from loom.report import load_run, summary_rows

    rows = dict(summary_rows(load_run(run.run_dir)))  # `loom report`'s table
    assert rows["expert load (last step)"].endswith("0 tokens dropped"), rows
    rows = list(csv.DictReader(open(run.run_dir / "metrics.csv")))
    assert any(r.get("moe/expert_load_max") for r in rows) and any(r.get("moe/expert_load_min") for r in rows)

    cfg = resolve([*both, "hardware.devices=1", f"run.root={tmp_path}"])
    resume_in_process(cfg, run.run_dir, "strategy.ep 2 -> 1")

    cfg = resolve([*PARITY, "strategy=single", "dataset.batch_size=32", f"run.root={tmp_path}", "run.id=one"])
    one = freeze(cfg, make_plan(cfg)).run_dir
    assert fit(load_frozen(one / "config.yaml"), one, 0) == 0
    ep, single = _losses(run.run_dir), _losses(one)
    assert len(ep) == len(single) == 4, (ep, single)
    for a, b in zip(ep, single, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ep, single)


@pytest.mark.parametrize("args, says", [
    (["strategy.ep=3", "hardware.devices=2"], "strategy.ep=3: must divide model.num_experts=8"),
    (["strategy.ep=2", "hardware.devices=1"], "must divide the data-parallel shard size dp_shard=1"),
    (["strategy.ep=4", "hardware.devices=2"], "must divide the data-parallel shard size dp_shard=2"),
    (["model=gpt_tiny", "strategy.ep=2", "hardware.devices=2"], "model=gpt_tiny has no routed experts"),
    (["model.experts_per_token=9", "hardware.devices=2"], "model.experts_per_token=9"),
])
def test_bad_expert_parallel_configs_are_refused(tmp_path, args, says):
    err = refused(tmp_path, "model=moe_tiny", "strategy=fsdp", "hardware=cpu", *FAST, *args)
    assert says in err, err


def test_ep_beside_tensor_parallelism_is_refused(tmp_path):
    err = refused(tmp_path, "model=moe_tiny", "strategy=nd", "strategy.tp=2", "strategy.ep=2", "hardware=cpu",
                  "hardware.devices=4", *FAST)
    assert "no tensor parallel plan yet" in err or "built beside FSDP2 alone" in err, err


def test_the_plan_counts_the_experts_on_the_wire():
    """Qwen3-30B-A3B on 8 H100s: ep 8 leaves the experts' weights off the data-parallel wire
    (one rank per expert set) and adds the all-to-alls, by the formula plan.experts states."""
    one, eight = (make_plan(resolve([*QWEN, f"strategy.ep={ep}"])) for ep in (1, 8))
    assert one.fits and eight.fits
    assert one.memory_per_device_bytes["states"] == eight.memory_per_device_bytes["states"]
    e = eight.experts
    assert (e["experts"], e["experts_per_token"], e["experts_per_rank"], e["expert_shard_ranks"]) == (128, 8, 16, 1)
    assert 3.3e9 <= e["active_params"] < 3.4e9 and e["expert_params"] == 48 * 128 * 3 * 2048 * 768
    cfg = resolve([*QWEN, "strategy.ep=8"])
    tokens = cfg.dataset.batch_size * cfg.dataset.seq_len
    assert e["all_to_all_bytes"] == pytest.approx(48 * 4 * tokens * 8 * 2048 * 2 * 7 / 8)
    assert eight.comm_bytes_by_dimension["expert_parallel"] == e["all_to_all_bytes"]
    dense = one.params - e["expert_params"]
    ratio = eight.comm_bytes_by_dimension["data_parallel"] / one.comm_bytes_by_dimension["data_parallel"]
    assert ratio == pytest.approx(dense / one.params)  # only the non-expert weights are gathered and reduced
    assert one.experts["ep"] == 1 and one.comm_bytes_by_collective.get("all_to_all", 0.0) == 0.0


def test_a_rank_of_an_expert_parallel_layout_rehearses_to_the_plans_states():
    from loom.rehearse import rehearse_in_one_process
    from loom.rehearse.table import compare_rank

    cfg = resolve(["model=moe_tiny", "strategy=fsdp", "strategy.ep=4", "hardware=cpu", "hardware.devices=8",
                   "dataset.seq_len=64", "dataset.batch_size=4", *FAST])
    (r,) = rehearse_in_one_process([(cfg, 0)])
    assert "error" not in r, r
    row = compare_rank(make_plan(cfg).to_dict(), r)
    assert row["difference"]["params"] == 0 and row["difference"]["optimizer"] == 0, row
    # the plan's peak (gradients freed before forward: the larger of them and the activations)
    assert abs(row["difference"]["peak"]) < 0.25, row


def test_qwen3_30b_a3b_at_ep_8_fits_8_h100s_and_the_plan_says_why(capsys):
    """The issue's command at the dataset's batch (16): 45.8 GB of fp32 weights and Adam states
    per H100 plus the larger of the gradient shards (15.3 GB) and the activations (21.6 GB), since
    the gradients are freed after each step; summed it would be 82.6 GB, over the 72 usable."""
    from loom.plan.render import render

    plan = make_plan(resolve(["model=qwen3_moe_30b_a3b", "strategy=nd", "strategy.ep=8", "hardware=h100x8", *FAST]))
    mem = plan.memory_per_device_bytes
    assert plan.micro_batch == 16 and plan.fits and mem["grads_in_forward"] is False
    assert mem["activations"] > mem["grads"]
    assert mem["total"] == pytest.approx(mem["params"] + mem["optimizer"] + mem["activations"])
    assert mem["states"] + mem["activations"] > plan.capacity_per_device_bytes > mem["total"]
    render(plan.to_dict())
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "the larger of grads and activations" in out and "fits" in out, out
    # accumulating, the earlier micro batches' gradients are there in forward: the sum, refused
    accum = make_plan(resolve(["model=qwen3_moe_30b_a3b", "strategy=nd", "strategy.ep=8", "hardware=h100x8",
                               "trainer.accumulate_grad_batches=2", *FAST]))
    assert accum.memory_per_device_bytes["grads_in_forward"] is True and not accum.fits


def test_plan_compare_weighs_the_expert_parallel_degrees(capsys):
    """`loom plan --compare` offers fsdp at each ep dividing the experts and the shard dim; on 8
    H100s the ep=8 layout moves the least and ranks first (experts off the data-parallel wire)."""
    from loom.plan.compare import compare

    result = compare(resolve(["model=qwen3_moe_30b_a3b", "hardware=h100x8", "dataset.batch_size=8", *FAST]))
    offered = [c.overrides for c in result.candidates if c.overrides[0] == "strategy=fsdp"]
    want = {("strategy=fsdp",), *(("strategy=fsdp", f"strategy.ep={e}") for e in (2, 4, 8))}
    assert {tuple(o) for o in offered} >= want
    assert result.candidates[0].overrides == ["strategy=fsdp", "strategy.ep=8"], [c.overrides for c in result.candidates[:3]]
    # the layout column shows every mesh dimension, ep too (it omitted ep: ep=2 and ep=8 read alike)
    assert (result.candidates[0].degrees, result.candidates[0].ep) == ({"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1}, 8)
    from loom.plan.compare import render_comparison

    render_comparison(result, "h100x8", "qwen3_moe_30b_a3b")
    table = capsys.readouterr().out
    assert "repl x shard x tp x pp x ep" in table and "1 x 8 x 1 x 1 x 8" in table, table
