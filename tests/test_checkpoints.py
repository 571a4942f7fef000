"""Checkpoints and export that scale (issue 14).

- The streaming safetensors writer (no processes): what it writes loads with plain
  `safetensors.torch.load_file`, bit for bit, in every export dtype.
- Bad input: async checkpoints on a strategy that cannot, an export dtype Loom does not write:
  exit 2 in validation, naming the key and the choices.
- For real (slow): `checkpoint.async=true` under fsdp_tp (FSDP2 x tensor parallel, 4 ranks: the
  DTensor states of both meshes), the job SIGKILLed after a checkpoint became visible (the next
  one then still in flight), resumed by the same command: the curve and the final weights are
  bit-identical to the uninterrupted fsdp_tp run of `strategy_runs`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    COMMON,
    PROCS,
    STEPS,
    LoomResult,
    alive,
    refused,
    start_loom,
    strategy_args,
    worker_pids,
)
from safetensors.torch import load_file

from loom.rundir import checkpoints
from loom.rundir.safetensors_stream import SafetensorsStream, dtype_name


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "wte.weight": torch.randn(7, 5, generator=g).to(dtype),
        "blocks.0.attn.c_attn.weight": torch.randn(3, 4, 2, generator=g).to(dtype),
        "ln_f.bias": torch.randn(5, generator=g).to(dtype),
        "scale": torch.tensor(1.5).to(dtype),            # 0-d
        "empty": torch.zeros(0, 3, dtype=dtype),          # no bytes
        "steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),  # integers keep their dtype
        "mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_file_loads_with_plain_safetensors(tmp_path, dtype):
    want = _tensors(dtype)
    specs = [(k, tuple(t.shape), dtype_name(t.dtype)) for k, t in want.items()]
    meta = {"run_id": "r", "dtype": str(dtype)}
    path = checkpoints.write_final_weights(tmp_path, specs, iter(want.items()), meta)
    got = load_file(str(path))
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata() == meta


def test_stream_refuses_what_the_header_did_not_announce(tmp_path):
    t = torch.ones(2, 2)
    with pytest.raises(ValueError, match="announced"):
        with SafetensorsStream(tmp_path / "a", [("a", (2, 2), "float32")]) as s:
            s.write("a", t.to(torch.float16))
    with pytest.raises(ValueError, match="only 0 of 1"):
        with SafetensorsStream(tmp_path / "b", [("a", (2, 2), "float32")]):
            pass
    # a failed export leaves no final file behind
    with pytest.raises(ValueError):
        checkpoints.write_final_weights(tmp_path, [("a", (2, 2), "float32")], iter([("b", t)]), {})
    assert not (tmp_path / "final" / "model.safetensors").exists()
    assert list((tmp_path / "final").iterdir()) == []


def test_dcp_dir_without_metadata_is_incomplete(tmp_path):
    """An async DCP write cut short: rank 0's meta.pt is there, `.metadata` (written last) is not."""
    d = tmp_path / "step-0000002.ckpt"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x" * 10)
    torch.save({"loops": {}}, d / "meta.pt")
    assert checkpoints.problem(d)[0] == "corrupt"


# ----------------------------------------------------------------------------- bad input


def test_bad_checkpoint_input_fails_fast(loom, tmp_path):
    err = refused(tmp_path, "strategy=zero2", "checkpoint.async=true")
    assert "checkpoint.async=True" in err and "strategy=zero2" in err and "fsdp, fsdp_tp" in err
    err = refused(tmp_path, "strategy=ddp", "checkpoint.async=true")
    assert "checkpoint.async=True" in err and "fsdp, fsdp_tp" in err
    err = refused(tmp_path, "checkpoint.export_dtype=fp8")
    assert "checkpoint.export_dtype='fp8'" in err and "fp32, bf16, fp16" in err


# ----------------------------------------------------------------------------- async resume


@pytest.mark.launch
@pytest.mark.slow
def test_sigkill_under_async_checkpoints_resumes_bit_identical(shared, tmp_path):
    """fsdp_tp with checkpoint.async=true: SIGKILL the launcher as soon as the step-4 save has
    started (step 2 was renamed into place just before it; step 4 is being written in the
    background, or written but not yet renamed, which waits for the step-6 save). Its agent,
    forkserver and 4 ranks die with it within seconds (parent-death signals: no rank trains on).
    The same command, run at once, waits for any rank still alive, resumes from the newest
    complete checkpoint and ends exactly where the uninterrupted fsdp_tp parity run (same config,
    synchronous checkpoints) ended, with one attempt per step in metrics.csv and two attempts in
    the history, the killed one `interrupted` (issue 50: two attempts trained in one run dir)."""
    ref = shared.get(*strategy_args("fsdp_tp"))  # the parity run of strategy_runs (one launch per session)
    assert ref.rc == 0, ref.out + ref.err
    args = ["strategy=fsdp_tp", *COMMON, *PROCS["fsdp_tp"], "checkpoint.every_n_steps=2", "checkpoint.async=true",
            "run.id=a"]
    ckpts = tmp_path / "gpt" / "a" / "checkpoints"
    proc = start_loom("train", *args, root=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (ckpts / "step-0000004.ckpt.partial").exists():
        assert proc.poll() is None, "exited before the step-4 save started: " + proc.stdout.read()
        assert time.monotonic() < deadline, "the step-4 save never started"
        time.sleep(0.02)
    run_dir = ckpts.parent
    victims = worker_pids(run_dir)
    assert len(victims) == 4
    # ps / pgrep -f tell the run's processes apart: each rank, its forkserver, the agent, the launcher
    parents = [_parent(victims[0]), _parent(_parent(victims[0])), _parent(_parent(_parent(victims[0])))]
    assert [_title(pid) for pid in victims + parents] == [*(f"loom[a] rank {r}/4" for r in range(4)),
                                                          "loom[a] forkserver", "loom[a] agent", "loom[a] launcher"]
    assert parents[2] == proc.pid and victims[3] in _pgrep(r"^loom\[a\] rank 3/4$")
    tree = victims + parents[:2]
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, as `kill -9 <launcher>` does
    proc.wait(timeout=60)
    proc.stdout.close()
    again = start_loom("train", *args, root=tmp_path)  # at once: it waits for whatever of the tree still lives
    gone = time.monotonic() + 10
    while any(alive(pid) for pid in tree) and time.monotonic() < gone:
        time.sleep(0.05)
    left = [pid for pid in tree if alive(pid)]
    out, _ = again.communicate(timeout=900)
    assert not left, f"ranks outlived their launcher by 10 s: {left}"
    r = LoomResult(again.returncode, out, "", run_dir)
    assert r.rc == 0, r.out
    # a renamed checkpoint is always complete; anything in flight was `.partial` and is redone
    history = json.loads((run_dir / "world_history.json").read_text())
    assert [a.get("status") for a in history] == ["interrupted", "completed"], history
    steps = [int(row["step"]) for row in r.metrics() if row.get("train/loss")]
    assert steps == list(range(1, STEPS + 1)), steps  # no step twice: one live attempt at a time
    s = r.summary()
    assert s["status"] == "completed" and s["resumed_from_step"] in (2, 4), s["resumed_from_step"]
    got, want = r.losses(), ref.losses()
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want, "loss curves differ"
    wr, wg = _weights(ref.run_dir), _weights(r.run_dir)
    assert wr.keys() == wg.keys()
    for k in wr:
        assert wg[k].dtype == torch.float32 and torch.equal(wg[k], wr[k]), k
    left = sorted(p.name for p in ckpts.iterdir())
    assert not [n for n in left if n.endswith(".partial")], left  # the resumed run rewrote step 4
    # each background save says when it started and when it completed, with its duration
    saves = re.findall(r"^checkpoint step (\d+): writing in the background \(training resumed after [\d.]+ s\)$",
                       r.out, re.M)
    done = re.findall(r"^checkpoint step-(\d+)\.ckpt complete: [\d.]+ s from the start of its save$", r.out, re.M)
    assert saves and sorted(map(int, saves)) == sorted(map(int, done)), r.out
    assert os.readlink(ckpts / "last.ckpt") == f"step-{STEPS:07d}.ckpt"  # the last save was awaited


def _title(pid: int) -> str:
    """A process's command line as ps shows it (loom.process.set_title)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _pgrep(pattern: str) -> list[int]:
    return [int(x) for x in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))
