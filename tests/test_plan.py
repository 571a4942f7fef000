"""`loom plan`: the ZeRO memory arithmetic, batch math, FLOPs, MFU, the CLI verdict and exit
codes, and the estimate against the bytes a real 2-process run holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import LOOM, ROOT, refused
from omegaconf import OmegaConf

from loom.compose import group_options
from loom.hardware.peaks import mfu, peak_flops
from loom.models import model_spec
from loom.pipeline import resolve
from loom.plan import Plan, make_plan
from loom.plan.memory import (
    RUNTIME_HOST_BYTES,
    activation_bytes,
    comm_bytes,
    layer_activation_bytes,
    per_param_bytes,
    state_bytes,
    tp_replicated_params,
)
from loom.plan.render import infeasible_message
from loom.strategies import layout_of
from loom.strategies.registry import cheapest_first

GB = 1e9
STRATEGIES = group_options("strategy")


# ------------------------------------------------------------------ ZeRO arithmetic


def test_zero_paper_example_7_5b_on_64_devices():
    """ZeRO paper, fig. 1: Psi = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    psi, n = 7.5e9, 64
    totals = {s: state_bytes(s, psi, n, mixed=True).states / GB for s in ("ddp", "zero1", "zero2", "zero3")}
    assert totals["ddp"] == pytest.approx(120.0)
    assert totals["zero1"] == pytest.approx(31.4, abs=0.05)   # 4 Psi + 12 Psi / N
    assert totals["zero2"] == pytest.approx(16.6, abs=0.05)   # 2 Psi + 14 Psi / N
    assert totals["zero3"] == pytest.approx(1.9, abs=0.05)    # 16 Psi / N
    z2 = state_bytes("zero2", psi, n, mixed=True)
    assert (z2.params, z2.grads, z2.optimizer) == pytest.approx((2 * psi, 2 * psi / n, 12 * psi / n))


def test_fp32_split_and_fsdp_like_stage3():
    psi, n = 1e9, 8
    ddp = state_bytes("ddp", psi, n, mixed=False)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4e9, 4e9, 8e9)
    z1 = state_bytes("zero1", psi, n, mixed=False)
    assert (z1.params, z1.grads, z1.optimizer) == (4e9, 4e9, 1e9)
    assert state_bytes("fsdp", psi, n, mixed=True).states == state_bytes("zero3", psi, n, mixed=True).states == 2e9
    assert state_bytes("single", psi, n, mixed=False).states == 16e9  # n ignored: nothing sharded


def test_offload_moves_optimizer_states_to_host():
    psi, n = 1e9, 8
    off = state_bytes("zero3_offload", psi, n, mixed=True)
    assert off.optimizer == 0 and off.host_offload == pytest.approx(12 * psi / n)
    assert off.params == pytest.approx(2 * psi / n)
    both = state_bytes("zero3", psi, n, mixed=True, offload_optimizer=True, offload_params=True)
    assert both.params == 0 and both.host_offload == pytest.approx(14 * psi / n)


def test_bytes_per_param_by_implementation():
    assert per_param_bytes("zero2", "bf16-mixed") == (2, 2, 12)   # DeepSpeed: fp32 master copy
    assert per_param_bytes("ddp", "bf16-mixed") == (4, 4, 8)      # Lightning autocast: fp32 weights
    assert per_param_bytes("fsdp", "32-true") == (4, 4, 8)
    assert per_param_bytes("ddp", "bf16-true") == (2, 2, 4)
    assert per_param_bytes("zero2", "32-true") == (4, 4, 12)      # DeepSpeed clones the fp32 partition
    for s in ("ddp", "zero1", "zero3", "fsdp"):
        assert sum(per_param_bytes(s, "bf16-mixed")) == 16


# ------------------------------------------------------------------ make_plan


def _cfg(*overrides: str):
    return resolve(list(overrides))


def test_batch_math_and_cpu_ddp_memory():
    cfg = _cfg("hardware=cpu", "strategy=ddp", "trainer.accumulate_grad_batches=3", "dataset.batch_size=4",
               "dataset.seq_len=64")
    plan = make_plan(cfg)
    psi = model_spec(cfg).params
    assert plan.world_size == 2 and plan.data_parallel == 2
    assert plan.global_batch == 4 * 3 * 2
    assert plan.tokens_per_step == 4 * 3 * 2 * 64
    mem = plan.memory_per_device_bytes
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    # ring all-reduce of fp32 grads once per step (no sync on accumulation steps)
    assert plan.comm_bytes_per_step_per_device == pytest.approx(2 * 0.5 * 4 * psi)
    assert plan.peak_flops_per_device is None
    assert plan.fits and plan.suggestion is None
    assert json.loads(json.dumps(plan.to_dict())) == plan.to_dict()  # plan.json-ready


def test_flops_per_token_is_6n_plus_attention():
    cfg = _cfg("hardware=h100x8", "model=gpt_7b", "strategy=zero3", "dataset.seq_len=2048")
    spec = model_spec(cfg)
    L, H, T = 32, 4096, 2048
    assert spec.flops_per_token == 6 * spec.non_embedding_params + 12 * L * H * T
    plan = make_plan(cfg)
    assert plan.flops_per_step == spec.flops_per_token * plan.tokens_per_step
    assert 6.3e9 < plan.params < 6.6e9


def test_zero3_on_h100x8_memory_and_comm():
    cfg = _cfg("hardware=h100x8", "model=gpt_7b", "strategy=zero3", "trainer.accumulate_grad_batches=2")
    plan = make_plan(cfg)
    psi = plan.params
    mem = plan.memory_per_device_bytes
    assert mem["states"] == pytest.approx(16 * psi / 8)
    # per micro batch: 2 all-gathers of bf16 params + 1 reduce-scatter of fp32 grads (Loom's
    # DeepSpeed default communication_data_type), each 7/8
    assert plan.comm_bytes_per_step_per_device == pytest.approx(2 * (2 * 2 + 4) * 7 / 8 * psi)
    assert plan.capacity_per_device_bytes == pytest.approx(0.9 * 80 * GB)
    assert plan.peak_flops_per_device == pytest.approx(989.4e12)
    assert plan.fits


@pytest.mark.skipif("fsdp_tp" not in STRATEGIES, reason="conf/strategy/fsdp_tp.yaml not there yet")
def test_fsdp_tp_world_split():
    cfg = _cfg("hardware=h100x8", "strategy=fsdp_tp", "strategy.tensor_parallel=2", "dataset.batch_size=2")
    plan = make_plan(cfg)
    assert (plan.data_parallel, plan.tensor_parallel) == (4, 2)
    assert plan.global_batch == 2 * 4
    assert comm_bytes(cfg, "fsdp_tp", plan.params, layout_of(cfg))["all_reduce"] > 0  # TP activations
    # Block linears over tp x dp = 8 ranks; what TP replicates (embeddings, head, norms,
    # row-parallel biases) over dp = 4 only. fp32 params under autocast: 4 bytes each.
    rep = tp_replicated_params(cfg)
    assert plan.memory_per_device_bytes["params"] == pytest.approx(4 * ((plan.params - rep) / 8 + rep / 4))


# Device bytes per parameter of (params, grads, optimizer) each data-parallel strategy keeps,
# as fractions of the unsharded bytes over n = the data-parallel degree (ZeRO paper, sec. 5);
# zero3_offload keeps its optimizer states on the host.
SHARDED = {"single": (1, 1, 1), "ddp": (1, 1, 1), "auto": (1, 1, 1), "zero1": (1, 1, "n"),
           "zero2": (1, "n", "n"), "zero3": ("n", "n", "n"), "fsdp": ("n", "n", "n"), "nd": ("n", "n", "n"),
           "zero3_offload": ("n", "n", 0)}
HARDWARE = {"cpu": [], "h100x8": [], "multinode": ["hardware.rdzv_endpoint=node0:29500"]}


def _plan(strategy: str, hardware: str) -> tuple:
    extra = ["model.n_layer=16"] if strategy == "pp" else []  # every rank a pipeline stage
    cfg = _cfg(f"hardware={hardware}", f"strategy={strategy}", *HARDWARE[hardware], *extra)
    return cfg, make_plan(cfg)


@pytest.mark.parametrize("strategy, hardware", [(s, h) for h in HARDWARE for s in STRATEGIES
                                                 if not (s == "single" and h == "multinode")])  # one process
def test_every_strategy_plans_the_hand_computed_bytes(strategy, hardware):
    cfg, plan = _plan(strategy, hardware)
    mem, psi, n = plan.memory_per_device_bytes, plan.params, plan.data_parallel
    assert plan.world_size == cfg.hardware.devices * cfg.hardware.num_nodes
    assert mem["states"] == pytest.approx(mem["params"] + mem["grads"] + mem["optimizer"])
    # gradients beside the activations where a strategy keeps gradient buffers (DDP's buckets,
    # DeepSpeed's) or a pipeline holds microbatches; else freed after each step: the larger of the two
    summed = plan.strategy in ("ddp", "zero1", "zero2", "zero3", "zero3_offload") or plan.parallel["pp"] > 1
    step = mem["grads"] + mem["activations"] if summed else max(mem["grads"], mem["activations"])
    assert mem["grads_in_forward"] is summed
    assert mem["total"] == pytest.approx(mem["params"] + mem["optimizer"] + step + mem["runtime"])
    if strategy not in SHARDED:  # pp, fsdp_tp: their own layouts (tests above and test_plan_compare)
        assert mem["total"] > mem["states"] > 0 and plan.comm_bytes_per_step_per_device > 0
        return
    full = [b * psi for b in per_param_bytes(strategy, cfg.hardware.precision)]
    layout = layout_of(cfg)
    shards = layout.dp_shard if layout.hybrid else n  # HSDP (fsdp over nodes): shard within a node
    want = [f * (1 / shards if share == "n" else share) for f, share in zip(full, SHARDED[strategy], strict=True)]
    assert [mem["params"], mem["grads"], mem["optimizer"]] == pytest.approx(want)
    assert mem["host_offload"] == pytest.approx(full[2] / shards if strategy == "zero3_offload" else 0)
    if strategy in ("ddp", "auto") and n > 1:  # ring all-reduce of the gradients
        assert plan.comm_bytes_per_step_per_device == pytest.approx(2 * (n - 1) / n * full[1])


@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_sharding_orders_the_device_memory(hardware):
    """More sharding, strictly fewer state bytes on a device (n > 1 everywhere here)."""
    states = {s: _plan(s, hardware)[1].memory_per_device_bytes["states"]
              for s in ("ddp", "zero1", "zero2", "zero3", "zero3_offload")}
    assert states["ddp"] > states["zero1"] > states["zero2"] > states["zero3"] > states["zero3_offload"] > 0


def test_suggestion_is_the_cheapest_existing_strategy_that_fits():
    cfg = _cfg("hardware=h100x8", "model=gpt_7b", "strategy=ddp")
    plan = make_plan(cfg)
    assert not plan.fits
    ordered = [s for s in cheapest_first() if s != "ddp"]
    fitting = [s for s in ordered if make_plan(_cfg("hardware=h100x8", "model=gpt_7b", f"strategy={s}")).fits]
    assert fitting and plan.suggestion == fitting[0]
    assert fitting[0] == "zero1"  # 6.5B x (2 + 2 + 12/8) bytes = 36 GB per device: fits in 72 GB


# ------------------------------------------------------------------ peak and MFU


def test_peak_flops_from_profile_only():
    h100 = OmegaConf.create({"precision": "bf16-mixed", "peak_tflops": {"bf16": 989.4, "fp32": 66.9}})
    assert peak_flops(h100) == pytest.approx(989.4e12)
    h100.precision = "32-true"
    assert peak_flops(h100) == pytest.approx(66.9e12)
    h100.precision = "16-mixed"
    assert peak_flops(h100) is None  # no fp16 key: unknown, never borrowed from bf16
    assert peak_flops(OmegaConf.create({"precision": "32-true", "peak_tflops": {}})) is None


def test_mfu_null_unknown_correct_known_over_one_an_error():
    from loom.hardware.peaks import mfu_error

    # 8 devices at 989.4 TFLOP/s; 1e5 tokens/s at 40 GFLOP/token = 4 PFLOP/s -> 0.505
    assert mfu(1e5, 40e9, 989.4e12, 8) == pytest.approx(4e15 / (989.4e12 * 8))
    assert mfu_error(mfu(1e5, 40e9, 989.4e12, 8), 989.4e12) is None
    assert mfu(1e5, 40e9, None, 8) is None
    # 5054x the peak: the peak is wrong; kept, and turned into an error naming the peak
    assert mfu(1e9, 40e9, 989.4e12, 8) == pytest.approx(4e19 / (989.4e12 * 8))
    assert "989.4 TFLOP/s" in mfu_error(mfu(1e9, 40e9, 989.4e12, 8), 989.4e12)


def test_recorder_mfu_math_matches():
    """Lightning's Throughput (used by the Recorder) computes the same MFU from the peak."""
    pytest.importorskip("lightning_fabric")
    from lightning_fabric.utilities.throughput import Throughput

    peak, world, fpt, tokens_per_step, step_s = 989.4e12, 8, 40e9, 16384, 0.5
    t = Throughput(available_flops=peak, world_size=world, window_size=2)
    for i in range(3):  # flops: per device, since the previous update (as the Recorder passes them)
        t.update(time=i * step_s, batches=i, samples=i * 8, lengths=i * tokens_per_step,
                 flops=(tokens_per_step * fpt / world) if i else 0)
    got = t.compute()["device/mfu"]
    assert got == pytest.approx(mfu(tokens_per_step / step_s, fpt, peak, world))


# ------------------------------------------------------------------ the CLI


def _cli(*args: str, cwd=None):
    return subprocess.run([*LOOM, *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=120)


def test_cli_plan_ddp_7b_on_h100x8_is_infeasible_and_names_a_fit(tmp_path):
    p = _cli("plan", "model=gpt_7b", "strategy=ddp", "hardware=h100x8", f"run.root={tmp_path}")
    assert p.returncode == 3, p.stderr
    assert "does not fit" in p.stdout
    fit = make_plan(_cfg("model=gpt_7b", "strategy=ddp", "hardware=h100x8")).suggestion
    assert fit and f"strategy={fit} would fit" in p.stderr
    assert not any(tmp_path.iterdir())  # plan writes no run dir


def test_cli_plan_zero3_7b_fits(tmp_path):
    p = _cli("plan", "model=gpt_7b", "strategy=zero3", "hardware=h100x8", "--json", str(tmp_path / "p.json"))
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["fits"] and plan["peak_flops_per_device"] == pytest.approx(989.4e12)


def test_cli_plan_on_cpu_has_null_peak_and_one_line_warning(tmp_path):
    p = _cli("plan", "hardware=cpu", "--json", str(tmp_path / "p.json"))
    assert p.returncode == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert "peak_flops_per_device" in plan and plan["peak_flops_per_device"] is None
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "MFU will be null" in warnings[0]


def test_plan_never_imports_torch():
    code = ("import sys; from loom.cli import main; rc = main(['plan', 'model=gpt_7b', 'strategy=zero3', "
            "'hardware=h100x8']); assert rc == 0, rc; "
            "bad = [m for m in ('torch', 'pytorch_lightning', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad; print('clean')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr


# ------------------------------------------------------------------ estimate vs measured

# Per-rank bytes a real 2-process CPU run holds (summary.json) against the plan. Only params
# + optimizer states are compared: gradients are freed when training ends. On CPU, offloaded
# optimizer states live in the same memory, so they count. ddp is the default run; the other
# strategies (all matched within 10%, fsdp/zero*/single exactly) are marked slow.
MEASURED = ["single", "ddp", "fsdp", "fsdp_tp", "zero1", "zero2", "zero3", "zero3_offload"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", MEASURED)
def test_estimate_vs_measured_bytes_per_rank(strategy_runs, strategy):
    """The shared short run of each strategy (tests/conftest.py) against its own plan.json."""
    r = strategy_runs[strategy]
    assert r.rc == 0, r.err[-3000:]
    plan = json.loads((r.run_dir / "plan.json").read_text())
    mem = r.summary()["memory"]
    est_mem = plan["memory_per_device_bytes"]
    est = est_mem["params"] + est_mem["optimizer"] + est_mem["host_offload"]
    if strategy == "fsdp":  # its parity run keeps parameters gathered (reshard_after_forward=false):
        # the plan adds that whole fp32 copy, a transient the summary's held-state bytes do not count
        assert yaml.safe_load((r.run_dir / "config.yaml").read_text())["strategy"]["reshard_after_forward"] is False
        est -= 4 * plan["params"]
    for rank, (p, o) in enumerate(zip(mem["param_bytes_per_rank"], mem["optim_state_bytes_per_rank"], strict=True)):
        assert abs((p + o) - est) <= 0.10 * est, (rank, p, o, est)


# ------------------------------------------------------------------ activation checkpointing


def _act_cfg(*extra: str):
    return _cfg("hardware=h100x8", "model=gpt_7b", "strategy=fsdp", "dataset.batch_size=2",
                "dataset.seq_len=128", *extra)


def test_activation_estimate_follows_checkpointing_exactly():
    """Korthikanti et al. 2022 (flash attention): 34*s*b*h bytes per layer in 16-bit; full AC
    keeps each layer's 2*s*b*h input plus one layer's recompute; selective: every other block."""
    cfg = _act_cfg()
    s, b, h, L, V = 128, 2, 4096, 32, 256
    layer, inp, logits = 34 * s * b * h, 2 * s * b * h, 10 * b * s * V  # ~10 bytes per logit at the loss
    got = {mode: activation_bytes(cfg, 1, True, mode) for mode in ("none", "selective", "full")}
    assert got["none"] == pytest.approx(L * layer + logits)
    assert got["full"] == pytest.approx(L * inp + layer + logits)
    assert got["selective"] == pytest.approx(16 * layer + 16 * inp + layer + logits)
    assert got["none"] > got["selective"] > got["full"]
    # fp32: twice the bytes per layer, a 4-byte input
    assert activation_bytes(cfg, 1, False, "full") == pytest.approx(L * 2 * inp + 2 * layer + logits)
    # odd depth: blocks 0, 2 checkpointed, block 1 stores everything
    odd = _act_cfg("model.n_layer=3")
    assert activation_bytes(odd, 1, True, "selective") == pytest.approx(layer + 2 * inp + layer + logits)
    # the default mode is the config's
    plan = make_plan(_act_cfg("trainer.activation_checkpointing=full"))
    assert plan.activation_checkpointing == "full"
    assert plan.memory_per_device_bytes["activations"] == pytest.approx(got["full"])


def test_activation_estimate_tensor_parallel_korthikanti_eq2():
    """Without sequence parallelism only 24 of the 34*s*b*h divide by t (eq. 2); the block
    input kept by full AC is replicated on every TP rank; the logits split over t."""
    cfg = _act_cfg()
    s, b, h, L, V, t = 128, 2, 4096, 32, 256, 4
    sbh, logits = s * b * h, 10 * b * s * V / t
    assert layer_activation_bytes(s, b, h, t, True) == pytest.approx(sbh * (10 + 24 / t))
    assert activation_bytes(cfg, t, True, "none") == pytest.approx(L * sbh * (10 + 24 / t) + logits)
    assert activation_bytes(cfg, t, True, "full") == pytest.approx(L * 2 * sbh + sbh * (10 + 24 / t) + logits)
    assert activation_bytes(cfg, 1, True, "none") / activation_bytes(cfg, t, True, "none") < t


def test_own_strategy_suggestion_names_activation_checkpointing():
    """fsdp's states fit, 128 samples' activations do not: the least checkpointing that fits."""
    plan = make_plan(_cfg("hardware=h100x8", "model=gpt_7b", "strategy=fsdp", "dataset.batch_size=128"))
    assert not plan.fits
    assert plan.suggestion == "fsdp"
    assert plan.suggestion_overrides == ["trainer.activation_checkpointing=selective"]
    assert make_plan(_cfg("hardware=h100x8", "model=gpt_7b", "strategy=fsdp", "dataset.batch_size=128",
                          "trainer.activation_checkpointing=selective")).fits


def test_cli_plan_70b_shaped_names_checkpointing_or_sharding(tmp_path):
    p = _cli("plan", "model=gpt_7b", "model.n_layer=80", "model.d_model=8192", "model.n_head=64",
                "hardware=h100x8", "--json", str(tmp_path / "p.json"))
    assert p.returncode == 3, p.stderr
    plan = json.loads((tmp_path / "p.json").read_text()) if (tmp_path / "p.json").exists() else None
    cfg = _cfg("model=gpt_7b", "model.n_layer=80", "model.d_model=8192", "model.n_head=64", "hardware=h100x8")
    fix = make_plan(cfg)
    assert fix.suggestion_overrides, "no fix named"
    assert fix.suggestion_overrides == ["strategy=zero3_offload", "trainer.activation_checkpointing=selective"]
    assert f"{' '.join(fix.suggestion_overrides)} would fit" in p.stderr
    assert plan is None or plan["suggestion_overrides"] == fix.suggestion_overrides
    # and it does: the suggested overrides make the plan fit
    assert make_plan(_cfg("model=gpt_7b", "model.n_layer=80", "model.d_model=8192", "model.n_head=64",
                          "hardware=h100x8", *fix.suggestion_overrides)).fits


def test_bad_activation_checkpointing_mode_is_refused(tmp_path):
    err = refused(tmp_path, "hardware=cpu", "trainer.activation_checkpointing=sometimes")
    assert "trainer.activation_checkpointing='sometimes'" in err
    assert all(c in err for c in ("none", "selective", "full"))


# ------------------------------------------------------------------ host memory of the build


def test_cli_plan_shows_build_host_memory(tmp_path):
    p = _cli("plan", "model=gpt_7b", "strategy=fsdp", "hardware=h100x8", "--json", str(tmp_path / "p.json"))
    assert p.returncode == 0, p.stderr
    assert "build host" in p.stdout and "GB per rank" in p.stdout
    plan = json.loads((tmp_path / "p.json").read_text())
    d = 4096  # gpt_7b's largest parameter: the MLP up projection, 4*d*d, in fp32
    assert plan["build_host_bytes_per_rank"] == pytest.approx(RUNTIME_HOST_BYTES["gpu"] + 4 * 4 * d * d)
    assert plan["build_host_ok"] and plan["fits"]
    assert Plan.from_dict(plan).build_host_bytes_per_rank == plan["build_host_bytes_per_rank"]


def test_build_host_on_cpu_is_the_parameter_shard():
    ddp = make_plan(_cfg("hardware=cpu", "strategy=ddp"))
    fsdp = make_plan(_cfg("hardware=cpu", "strategy=fsdp"))
    assert ddp.build_host_bytes_per_rank == pytest.approx(RUNTIME_HOST_BYTES["cpu"] + 4 * ddp.params)
    assert fsdp.build_host_bytes_per_rank == pytest.approx(RUNTIME_HOST_BYTES["cpu"] + 4 * fsdp.params / 2)


def test_cli_plan_host_too_small_for_the_build_exits_3(tmp_path):
    p = _cli("plan", "hardware=cpu", "hardware.host_memory_gb=0.5", "model=gpt_1b", f"run.root={tmp_path}")
    assert p.returncode == 3, p.stderr
    assert "building the model needs" in p.stderr and "hardware.host_memory_gb" in p.stderr
    # GPU: the devices fit, eight ranks' runtimes do not fit a 16 GB host
    plan = make_plan(_cfg("hardware=h100x8", "hardware.host_memory_gb=16", "model=gpt_7b", "strategy=fsdp"))
    assert not plan.fits and not plan.build_host_ok and plan.suggestion is None
    msg = infeasible_message(plan.to_dict())
    assert "building the model needs" in msg and "per device but" not in msg
    assert "hardware.devices" in msg  # fewer ranks per node, or more host memory


def test_old_plan_json_still_reads_and_renders():
    """plan.json written before these fields: from_dict fills the defaults, the message works."""
    old = make_plan(_cfg("hardware=h100x8", "model=gpt_7b", "strategy=ddp")).to_dict()
    for key in ("activation_checkpointing", "build_host_bytes_per_rank", "build_host_source", "build_host_ok",
                "host_capacity_bytes", "suggestion_overrides"):
        old.pop(key)
    plan = Plan.from_dict({**old, "some_future_key": 1})
    assert plan.build_host_ok and plan.suggestion_overrides == []
    assert f"strategy={old['suggestion']} would fit" in infeasible_message(old)


# ------------------------------------------------------------------ the wrapper (imports torch)


def _tiny_gpt():
    import torch

    from loom.models.gpt.network import GPT

    torch.manual_seed(0)
    return GPT(n_layer=4, n_head=2, d_model=32, vocab_size=64, block_size=16)


def test_apply_activation_checkpointing_counts_keys_and_gradients():
    torch = pytest.importorskip("torch")
    from loom.models.activation_checkpointing import apply_activation_checkpointing, clean_name
    from loom.models.gpt.network import Block

    ref = _tiny_gpt()
    keys = list(ref.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(model):
        model.zero_grad()
        model(idx).float().pow(2).mean().backward()
        return {clean_name(n): p.grad.clone() for n, p in model.named_parameters()}

    expected = grads(ref)
    for mode, count in (("full", 4), ("selective", 2), ("none", 0)):
        model = _tiny_gpt()
        model.load_state_dict(ref.state_dict())
        assert apply_activation_checkpointing(model, (Block,), mode) == count
        wrapped = [i for i, b in enumerate(model.blocks) if not isinstance(b, Block)]
        assert wrapped == {"full": [0, 1, 2, 3], "selective": [0, 2], "none": []}[mode]
        assert sum(isinstance(m, Block) for m in model.modules()) == 4  # FSDP/TP still find every unit
        assert list(model.state_dict()) == keys
        got = grads(model)
        assert got.keys() == expected.keys()
        assert all(torch.allclose(got[k], expected[k], atol=0, rtol=0) for k in got), mode
    with torch.device("meta"):  # right after a meta build, before any sharding
        from loom.models.gpt.network import GPT

        meta = GPT(n_layer=4, n_head=2, d_model=32, vocab_size=64, block_size=16)
    assert apply_activation_checkpointing(meta, (Block,), "full") == 4
    assert list(meta.state_dict()) == keys
    with pytest.raises(ValueError, match="sometimes"):
        apply_activation_checkpointing(meta, (Block,), "sometimes")
