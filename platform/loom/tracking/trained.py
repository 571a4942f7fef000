"""Tokens a step trains, beside the tokens it processes; and the rates of a count of samples.

A chat row is padded to seq_len and only the assistant's tokens are targets; a documents-packed
row has no target across a boundary: tokens/s counts every position processed (61,440 a step of
which ~600 trained, in one SFT run), so the runs whose batches are `masked` (targets -100 where
nothing is trained; loom.data.batch.Batch) also report `perf/trained_tokens_per_sec` and summary.json
`throughput.trained_tokens_per_sec`. Counted on the device without a host sync (a sum per micro
batch), read at log steps; nothing for unmasked data (every token is a target).
"""

from __future__ import annotations

from typing import Any

import torch

from loom.data.batch import Batch
from loom.hardware.peaks import mfu, mfu_error


class TrainedTokens:
    """This rank's trained targets since the last log step."""

    def __init__(self) -> None:
        self.window: torch.Tensor | None = None

    def add(self, batch: Any) -> None:
        """`batch`: what the loader yielded (a user's module may have transformed it: then nothing)."""
        if isinstance(batch, Batch) and batch.masked:
            n = batch.trained_targets()
            self.window = n if self.window is None else self.window + n

    def take(self) -> float:
        """The window's count (NaN when no batch was masked), and a new window."""
        out = float("nan") if self.window is None else float(self.window)
        self.window = None
        return out


def rates(samples: int, seconds: float, peak_flops: float | None, *, items_per_sample: int, token_data: bool,
          flops_per_token: float | None, world_size: int, bf16_peak_flops: float | None = None,
          peak_precision: str | None = None) -> dict[str, Any]:
    """samples/s, tokens/s, TFLOP/s per device and MFU of `samples` trained in `seconds` (an MFU
    above 1 is an error, `mfu_error`, not a number: the profile's peak is wrong). float8 runs: MFU is
    against the float8 peak and `mfu_bf16_peak` against hardware.precision's (`bf16_peak_flops`, the plan's
    `peak_flops_per_device_bf16`; null without float8), `mfu_peak_precision` the peak MFU is against."""
    tokens = samples * items_per_sample
    ok = seconds > 0 and samples > 0
    out: dict[str, Any] = {"samples_per_sec": samples / seconds if ok else None,
                           "tokens_per_sec": tokens / seconds if ok and token_data else None,
                           "tflops_per_device": None, "mfu": None, "mfu_error": None, "mfu_bf16_peak": None,
                           "mfu_peak_precision": peak_precision}
    if flops_per_token and ok:
        out["tflops_per_device"] = tokens * flops_per_token / world_size / seconds / 1e12
        value = mfu(tokens / seconds, flops_per_token, peak_flops, world_size)
        out["mfu_error"] = mfu_error(value, peak_flops)
        out["mfu"] = None if out["mfu_error"] else value
        if bf16_peak_flops and not out["mfu_error"]:
            out["mfu_bf16_peak"] = mfu(tokens / seconds, flops_per_token, bf16_peak_flops, world_size)
    return out
