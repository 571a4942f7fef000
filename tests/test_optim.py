"""Optimizers are a real choice: `optim=adamw|sgd`, `optim.fused=auto|true|false`, refused
values name the key and the choices, and the plan's optimizer bytes follow the optimizer.

No `loom train` launch: the optimizer math is checked in-process (fused and unfused AdamW take
the same steps, `optim=sgd` builds momentum SGD that trains gpt_tiny and keeps one buffer per
parameter, clipping under bf16 autocast with a fused optimizer in a one-process Lightning
Trainer); that an optimizer reaches a launched run is every parity run's (tests/test_strategies.py).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import LOOM
from omegaconf import OmegaConf

from loom.optim.build import make_optimizer
from loom.plan.memory import per_param_bytes


def _optim(name: str, **kw) -> OmegaConf:
    base = {"name": name, "lr": 0.05, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8,
            "momentum": 0.9, "nesterov": False, "fused": "auto"}
    return OmegaConf.create({**base, **kw})


def _steps(optim, steps: int = 3) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    opt = make_optimizer(list(model.named_parameters()), optim)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return opt, model


def test_fused_auto_picks_torchs_fused_kernel_on_cpu():
    for name in ("adamw", "sgd"):
        assert all(g["fused"] for g in _steps(_optim(name))[0].param_groups), name
        assert not any(g["fused"] for g in _steps(_optim(name, fused=False))[0].param_groups), name


def test_sgd_state_follows_momentum():
    opt, model = _steps(_optim("sgd"))
    assert len(opt.state) == sum(1 for _ in model.parameters())
    opt, _ = _steps(_optim("sgd", momentum=0.0))
    assert all(not s.get("momentum_buffer") for s in opt.state.values())  # no state kept
    # fused and unfused SGD take the same steps
    a = _steps(_optim("sgd", fused=True))[1]
    b = _steps(_optim("sgd", fused=False))[1]
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_plan_optimizer_bytes_follow_the_optimizer():
    adam, sgd, plain = _optim("adamw"), _optim("sgd"), _optim("sgd", momentum=0.0)
    assert per_param_bytes("ddp", "32-true", adam) == (4.0, 4.0, 8.0)
    assert per_param_bytes("ddp", "32-true", sgd) == (4.0, 4.0, 4.0)
    assert per_param_bytes("ddp", "32-true", plain) == (4.0, 4.0, 0.0)
    assert per_param_bytes("ddp", "bf16-true", sgd) == (2.0, 2.0, 2.0)
    # ZeRO keeps an fp32 master partition on top of the state
    assert per_param_bytes("zero2", "bf16-mixed", adam) == (2.0, 2.0, 12.0)
    assert per_param_bytes("zero2", "bf16-mixed", sgd) == (2.0, 2.0, 8.0)
    assert per_param_bytes("zero3", "32-true", plain) == (4.0, 4.0, 4.0)


@pytest.mark.parametrize(("override", "key", "choices"), [
    ("optim=lion", "optim=lion", "adamw, sgd"),
    ("optim.name=lion", "optim.name='lion'", "adamw, sgd"),
    ("optim.fused=maybe", "optim.fused='maybe'", "auto, true, false"),
    ("optim.fused=1", "optim.fused=1", "auto, true, false"),
])
def test_unknown_optimizer_values_are_refused(override, key, choices, tmp_path):
    p = subprocess.run([*LOOM, "plan", "hardware=cpu", override, f"run.root={tmp_path}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    msg = p.stdout + p.stderr
    assert key in msg and choices in msg, msg
    assert "Traceback" not in msg


def test_fused_and_unfused_adamw_take_the_same_steps():
    """optim.fused=true and false: the same AdamW steps (fused kernel vs foreach), to float
    rounding, on a small model with weight decay on its matrices (make_optimizer's groups)."""
    a, b = _steps(_optim("adamw", fused=True), steps=6), _steps(_optim("adamw", fused=False), steps=6)
    assert all(g["fused"] for g in a[0].param_groups) and not any(g["fused"] for g in b[0].param_groups)
    start = _steps(_optim("adamw"), steps=0)[1]
    for p, q, p0 in zip(a[1].parameters(), b[1].parameters(), start.parameters(), strict=True):
        assert not torch.equal(p, p0)  # it moved
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_optim_sgd_builds_momentum_sgd_that_trains_gpt_tiny():
    """`optim=sgd` as the worker builds it (LoomModule.configure_optimizers: torch SGD with
    momentum, the warmup/cosine schedule): 6 steps on one batch of gpt_tiny lower its loss,
    and the state Loom counts in summary.json (strategies.base.optim_state_bytes) is one fp32
    momentum buffer per parameter: as many bytes as the parameters."""
    from loom.models import build_module
    from loom.pipeline import resolve
    from loom.strategies.base import optim_state_bytes, param_bytes

    cfg = resolve(["model=gpt_tiny", "strategy=single", "hardware=cpu", "hardware.devices=1", "optim=sgd",
                   "trainer.max_steps=6", "dataset.seq_len=64"])
    module = build_module(cfg)
    module.configure_model()
    built = module.configure_optimizers()
    opt, sched = built["optimizer"], built["lr_scheduler"]["scheduler"]
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
    tokens = torch.randint(0, cfg.model.vocab_size, (8, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        opt.zero_grad()
        logits = module.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert optim_state_bytes(opt) == param_bytes(module.model)


class _Regression(__import__("loom.models.lit", fromlist=["LoomModule"]).LoomModule):
    """A LoomModule on a toy regression: Loom's optimizer, clipping and precision hooks."""

    def _loss(self, batch):
        x, y = batch
        return (self.model(x).float() - y).pow(2).mean() * 1e3  # large gradients: clipping must act


def test_clipping_with_bf16_autocast_and_fused_adamw(tmp_path):
    """Lightning's autocast plugin refuses to clip for a fused optimizer (a guard for fp16's loss
    scaler). bf16 has no scaler: Loom clips the true gradients and keeps the fused kernel.
    (fp16 autocast does not exist on CPU: Lightning turns it into bf16.)"""
    import pytorch_lightning as pl

    optim = OmegaConf.merge(_optim("adamw"), {"warmup_steps": 0, "min_lr_ratio": 1.0})
    cfg = OmegaConf.create({"seed": 0, "optim": optim, "trainer": {"max_steps": 3}})
    module = _Regression(cfg, lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    norms: list[float] = []
    clip = 0.01

    class Norms(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            assert opt.defaults["fused"] is True

            def record(optimizer, args, kwargs):
                grads = [p.grad.float() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
            opt.register_step_post_hook(record)  # Lightning runs the closure (backward) in step

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=clip, max_steps=3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Norms()])
    trainer.fit(module, data)
    assert len(norms) == 3 and all(n <= clip * 1.01 for n in norms), norms


def test_fp16_loss_scaling_with_clipping_keeps_auto_off_fused():
    """A fused optimizer unscales fp16 gradients inside its step, after clipping saw them scaled."""
    from loom.optim.build import use_fused

    params = [torch.nn.Parameter(torch.ones(2))]
    assert use_fused("auto", params) and not use_fused("auto", params, scaled_clipping=True)
    assert use_fused(True, params, scaled_clipping=True)  # as asked (validation refuses it with fp16 + clip)


def test_sgd_on_dtensor_parameters_stays_on_foreach(tmp_path):
    """`strategy=fsdp optim=sgd` failed at the first step: aten._fused_sgd_ has no DTensor sharding
    rule (AdamW's fused kernel has one). On a 1-rank gloo mesh, auto keeps SGD on foreach and its
    step runs; AdamW stays fused; an explicit optim.fused=true with SGD there is a clear error."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from loom.optim.build import make_optimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        net = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        named = list(net.named_parameters())
        sgd = OmegaConf.create({"name": "sgd", "lr": 0.1, "momentum": 0.0, "nesterov": False,
                                "weight_decay": 0.0, "fused": "auto"})
        opt = make_optimizer(named, sgd)
        assert opt.defaults["fused"] is False
        net(torch.ones(2, 4)).sum().backward()
        opt.step()  # the fused kernel raised NotImplementedError here
        adamw = OmegaConf.create({"name": "adamw", "lr": 0.1, "betas": [0.9, 0.95], "eps": 1e-8,
                                  "weight_decay": 0.0, "fused": "auto"})
        assert make_optimizer(named, adamw).defaults["fused"] is True
        with pytest.raises(ValueError, match=r"optim.fused=true: .*use optim.fused=auto"):
            make_optimizer(named, OmegaConf.merge(sgd, {"fused": True}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_lr_zero_is_accepted_with_a_warning_and_leaves_the_weights(name, tmp_path, monkeypatch):
    """optim.lr=0 (a frozen evaluation, a save/load round trip) is planned with one warning line
    naming it, not refused; a negative rate still is. The optimizer and schedule the worker builds
    then leave every weight as it was, weight decay included (it is scaled by the rate). Mutations
    caught: the old `> 0` rule (exit 2), the warning dropped, a schedule that adds a floor to lr."""
    import contextlib
    import io

    from loom import cli, pipeline
    from loom.optim.build import build_optimizer

    monkeypatch.setattr(pipeline, "_WARNED", set())  # a warning is printed once per process (command)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["plan", "hardware=cpu", f"optim={name}", "optim.lr=0"]) == 0, err.getvalue()
        assert cli.main(["plan", "hardware=cpu", f"optim={name}", "optim.lr=-0.1"]) == 2
    lines = err.getvalue().splitlines()
    assert sum(ln.startswith("warning: optim.lr=0: the optimizer never changes the weights") for ln in lines) == 1
    assert "Invalid config: optim.lr=-0.1: must be >= 0" in err.getvalue()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    before = [p.detach().clone() for p in model.parameters()]
    built = build_optimizer(list(model.named_parameters()), _optim(name, lr=0.0, warmup_steps=2, min_lr_ratio=0.1), 5)
    opt, sched = built["optimizer"], built["lr_scheduler"]["scheduler"]
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("accumulate, seen", [(1, [False] * 3), (2, [False, True] * 3)])
def test_gradients_are_freed_after_each_step_unless_accumulating(accumulate, seen, tmp_path):
    """Lightning zeroes the gradients in the next step's closure, after its forward: each forward
    would store its activations beside the last step's gradients. LoomModule.optimizer_step frees
    them after the step, so a forward sees none, except the later micro batches of an accumulation
    window (the plan's `grads_in_forward`: the larger of gradients and activations, or their sum)."""
    import pytorch_lightning as pl

    optim = OmegaConf.merge(_optim("adamw"), {"warmup_steps": 0, "min_lr_ratio": 1.0})
    cfg = OmegaConf.create({"seed": 0, "optim": optim, "trainer": {"max_steps": 3}})
    module = _Regression(cfg, lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
    grads_at_forward: list[bool] = []

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.model.register_forward_pre_hook(
                lambda mod, args: grads_at_forward.append(any(p.grad is not None for p in mod.parameters())))

    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Watch()])
    trainer.fit(module, data)
    assert grads_at_forward == seen
    assert trainer.global_step == 3
