"""scripts/gpu_check.sh on a machine without CUDA: a clear message, exit 4, nothing written; an
interpreter without torch (or none at all) is a different message and exit 2, never "no CUDA"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would train")
def test_gpu_check_without_cuda_says_skipped_and_exits_4(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "gpu_check: skipped: no CUDA device" in p.stdout and "nothing was run" in p.stdout
    assert not out.exists()


def test_gpu_check_names_an_interpreter_without_torch_not_a_missing_gpu(tmp_path):
    bare = tmp_path / "bare" / "bin" / "python"  # a venv with no packages: python, but no torch
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    out = tmp_path / "out"
    for python, says in ((str(bare), "cannot import torch"), (str(tmp_path / "nope"), "is not an interpreter here")):
        p = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHON": python})
        assert p.returncode == 2, p.stdout + p.stderr
        assert f"gpu_check: python: {python} ($PYTHON)" in p.stdout and says in p.stdout, p.stdout
        assert "no CUDA" not in p.stdout and not out.exists()
