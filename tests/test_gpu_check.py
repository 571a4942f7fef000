"""scripts/gpu_check.sh on a machine without CUDA: a clear message, exit 4, nothing written."""

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
