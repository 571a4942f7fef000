"""Resuming a ZeRO checkpoint at another data-parallel world size, through DeepSpeed's universal
checkpoint.

A ZeRO checkpoint is cut by the world that wrote it (one optimizer partition per data-parallel
rank), and DeepSpeed refuses it at another size ("Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported"). DeepSpeed's own answer, used
here as it is: `deepspeed.checkpoint.ds_to_universal` rewrites the partitions as one folder per
parameter (fp32 master, Adam m and v, whole), and an engine whose config has
`checkpoint.load_universal` cuts its own partition of each at load, for stages 1, 2 and 3. What
DeepSpeed leaves to its caller, and this module does:

- when: the checkpoint's recorded `dp_world_size` (its first model-states file) differs from
  the current one (ZeRO here is pure data parallelism: the world size). A same-size resume loads
  the original, as before.
- where and by whom: once, on global rank 0, into `step-N.ckpt.universal` beside the checkpoint
  (the original is never modified; `loom.rundir.checkpoints.remove` drops the sibling with it),
  built under `.partial` and renamed when whole, so a crash mid-conversion is redone and a
  finished one is reused by the next restart (after Loom's pickle allow-list check, as any
  checkpoint). The other ranks wait on the broadcast of the outcome, and a failed conversion
  fails every rank with the converter's error.
- the switch: Lightning hands the strategy the checkpoint path only after `deepspeed.initialize`
  (DeepSpeedStrategy restores after setup), so `checkpoint.load_universal` cannot be in the
  config the engine was built from. The engine reads it (`_config.load_universal_checkpoint`)
  only inside `load_checkpoint`, so it is turned on for that one call (`loading_universal`),
  which is what the key in the config would have done.
- ZeRO-3: two slips of its universal load, undone by `_repair_stage3`.
- `inject_missing_state`: a plain model's stage 1/2 checkpoint carries no
  `universal_checkpoint_info` (Megatron-style models set it); the converter's own option adds the
  version marker it requires.

The converter runs serially (`num_extract_workers=1`): a process pool forked from a rank that
holds a process group is not worth the risk for a step that runs once per world change.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from loom.rundir import checkpoints

log = logging.getLogger("loom")

SUFFIX = ".universal"
TAG_FILE = "latest"             # Lightning saves with tag "checkpoint"; DeepSpeed records it here
UNIVERSAL_TAG_FILE = "latest_universal"


def universal_dir(ckpt: Path) -> Path:
    """Where the universal form of checkpoint `ckpt` (a DeepSpeed checkpoint dir) goes."""
    return ckpt.with_name(ckpt.name + SUFFIX)


def _tag(ckpt: Path) -> str:
    latest = ckpt / TAG_FILE
    return latest.read_text().strip() if latest.is_file() else "checkpoint"


def saved_dp_world(ckpt: Path) -> int:
    """The data-parallel world size the checkpoint was written at, as DeepSpeed recorded it.

    Read memory-mapped: only the small pickled header is parsed, not the weights."""
    import torch

    files = sorted((ckpt / _tag(ckpt)).glob("*model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no DeepSpeed *model_states.pt under {_tag(ckpt)}/")
    # weights_only=False: DeepSpeed's own state (its config, an argparse Namespace); the run dir's
    # checkpoints passed Loom's pickle allow-list (checkpoints.problem) before being chosen.
    state = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    return int(state["dp_world_size"])


def convert(ckpt: Path) -> Path:
    """`ds_to_universal` of `ckpt` into its sibling (reused when already whole); its console
    output goes to the rank log at debug level."""
    from deepspeed.checkpoint import ds_to_universal

    out = universal_dir(ckpt)
    if (out / UNIVERSAL_TAG_FILE).is_file():
        issue = checkpoints.problem(out)  # DeepSpeed unpickles it: Loom's allow-list first
        if issue is None:
            log.info(f"reusing the universal checkpoint {out.name}")
            return out
        log.warning(f"{out.name} is {issue[0]} ({issue[1]}): converting {ckpt.name} again")
        checkpoints.remove(out)
    tmp = out.with_name(out.name + ".partial")
    checkpoints.remove(tmp)
    tag = _tag(ckpt)
    args = argparse.Namespace(
        input_folder=str(ckpt / tag), output_folder=str(tmp / tag), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )
    console = io.StringIO()
    with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
        ds_to_universal.main(args)
    log.debug(console.getvalue())
    # ds_to_universal writes `latest_universal` beside its output folder: inside tmp, so it moves along.
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def loading_universal(engine, config: dict, universal: Path) -> Iterator[None]:
    """`checkpoint.load_universal: true` for one `engine.load_checkpoint` of `universal` (see the
    module docstring); the strategy's config dict says so too, as a record of what the engine ran
    with. A ZeRO-3 load is then repaired (`_repair_stage3`)."""
    before = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True
    config.setdefault("checkpoint", {})["load_universal"] = True
    try:
        yield
        if engine.zero_optimization_partition_weights():
            _repair_stage3(engine.optimizer.optimizer, universal / _tag(universal))
    finally:
        engine._config.load_universal_checkpoint = before


def _repair_stage3(optimizer, folder: Path) -> None:
    """Two slips of DeepSpeed 0.19's ZeRO-3 universal load
    (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`), undone here; stages 1 and 2 have neither:
    - it copies the first param group's hyperparameters onto every group. Loom's AdamW has two
      groups, decayed and not (biases, norms): the second would be decayed from then on. The
      converter kept every group's (`zero/optimizer_state.pt`): each gets its own back.
    - it gives every sub-group's state one and the same `step` tensor, which torch's Adam
      increments in place: the second group would count two steps per step (seen: the loss one
      step after a resume off by 6e-4). Each gets its own copy."""
    import torch

    saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(f"{folder}: {len(groups)} optimizer param groups saved, {len(optimizer.param_groups)} now")
    for group, old in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in old.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def prepare(strategy, ckpt: Path) -> Path | None:
    """The universal checkpoint to load instead of `ckpt` when the data-parallel world changed
    (None: load `ckpt` as it is). Collective: every rank calls it; rank 0 decides and converts."""
    outcome: tuple[str | None, str | None, int | None] = (None, None, None)
    if strategy.is_global_zero:
        try:
            saved = saved_dp_world(ckpt)
            if saved != strategy.world_size:
                log.info(f"{ckpt.name} was written by {saved} data-parallel ranks, this run has "
                         f"{strategy.world_size}: converting it to DeepSpeed's universal checkpoint")
                outcome = (str(convert(ckpt)), None, saved)
        except Exception as e:  # every rank raises it below, instead of waiting forever
            outcome = (None, f"{type(e).__name__}: {e}", None)
    path, error, saved = strategy.broadcast(outcome, src=0)
    if error:
        raise RuntimeError(f"cannot resume {ckpt} at {strategy.world_size} data-parallel ranks: "
                           f"converting it to DeepSpeed's universal checkpoint failed ({error})")
    if path is None:
        return None
    log.info(f"resuming from {Path(path).name} (universal; written at {saved} ranks, loading at "
             f"{strategy.world_size})")
    return Path(path)
