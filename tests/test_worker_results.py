"""The worker's results (final weights, memory figures) are taken while the model is still where
it trained. Lightning's teardown moves the module and its optimizer state to the CPU; on the first
H100 run, gathering after it made DeepSpeed all-reduce a CPU tensor over NCCL (zero2 and zero3
failed at export) and dropped every GPU memory peak. One in-process `fit`, no launch: a teardown
that moves the module to `meta` stands in for the move off the GPU."""

from __future__ import annotations

import torch
from conftest import FAST
from safetensors.torch import load_file


def test_final_weights_and_memory_are_taken_before_teardown(tmp_path, monkeypatch):
    from pytorch_lightning.strategies import SingleDeviceStrategy

    from loom.freeze import freeze
    from loom.pipeline import resolve
    from loom.plan import make_plan
    from loom.rundir.config_file import load_frozen
    from loom.rundir.summary import read_summary
    from loom.worker.fit import fit

    cfg = resolve([*FAST, "strategy=single", "trainer.max_steps=2", "checkpoint.every_n_steps=2",
                   "trainer.limit_val_batches=1", f"run.root={tmp_path}", "run.id=r"])
    run_dir = freeze(cfg, make_plan(cfg)).run_dir
    torn_down = []
    plain_teardown = SingleDeviceStrategy.teardown

    def teardown_off_the_device(self) -> None:
        plain_teardown(self)
        self.lightning_module.to("meta")  # as .cpu() leaves a CUDA run: nothing there to gather from
        torn_down.append(True)

    monkeypatch.setattr(SingleDeviceStrategy, "teardown", teardown_off_the_device)
    assert fit(load_frozen(run_dir / "config.yaml"), run_dir, 0) == 0
    assert torn_down == [True]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed", summary.get("error")
    assert summary["memory"]["param_bytes_per_rank"][0] > 0
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    state = torch.load(run_dir / "checkpoints" / "step-0000002.ckpt", weights_only=True)["state_dict"]
    assert final and set(final) <= {k.removeprefix("model.") for k in state} | set(state)
    for name, tensor in final.items():
        saved = state.get(name, state.get(f"model.{name}"))
        torch.testing.assert_close(tensor.float(), saved.float(), rtol=0, atol=0)
