"""Checkpoints in a run dir: where they are, which is the newest complete one, is it safe.

Torch-free (zipfile + pickletools), so the launcher can refuse a hostile checkpoint before
any process starts. Checkpoints are `checkpoints/step-NNNNNNN.ckpt` (a file, or a directory
for sharded strategies), written under a `.partial` name and renamed when complete on every
rank (loom.checkpoint_saver); `last.ckpt` is a symlink to the newest.
"""

from __future__ import annotations

import io
import logging
import pickletools
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loom.atomic import atomic_path
from loom.rundir.paths import STEP_RE, RunDir
from loom.rundir.safetensors_stream import SafetensorsStream, Spec

log = logging.getLogger("loom")

# Module prefixes a checkpoint's pickles may name. Anything else (os.system, builtins.eval,
# subprocess, ...) would run code on load, so the checkpoint is refused.
SAFE_GLOBAL_PREFIXES = (
    "torch.", "collections.OrderedDict", "collections.defaultdict", "builtins.set", "builtins.frozenset",
    "builtins.slice", "builtins.complex", "builtins.bytearray", "_codecs.encode", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype", "numpy.dtypes.", "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar", "deepspeed.", "pytorch_lightning.", "lightning_fabric.", "lightning.",
    "argparse.Namespace", "loom.", "pathlib.PosixPath", "pathlib.WindowsPath",  # DCP .metadata: storage paths
)


class UnsafeCheckpoint(Exception):
    """A checkpoint whose pickles name code outside the allow-list: never loaded."""


def checkpoint_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def step_path(run_dir: Path, step: int) -> Path:
    return RunDir(run_dir).checkpoint(step)


def step_of(path: Path | None) -> int | None:
    m = STEP_RE.match(path.name) if path else None
    return int(m.group(1)) if m else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """step-*.ckpt (never *.partial), newest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: step_of(p), reverse=True)


def pickle_globals(data: bytes) -> set[str]:
    """Every `module.name` a pickle would import, read without unpickling anything.

    STACK_GLOBAL takes its module and name from the stack; they are pushed as strings or
    fetched back from the memo, so string memo entries are followed.
    """
    names: set[str] = set()
    stack_strings: list[str | None] = []   # what the last pushes were, when strings
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        top = stack_strings[-1] if stack_strings else None
        if name in ("GLOBAL", "INST"):
            names.add(str(arg).replace(" ", "."))
            stack_strings.append(None)
        elif name == "STACK_GLOBAL":
            mod, attr = (stack_strings[-2:] + [None, None])[:2] if len(stack_strings) >= 2 else (None, None)
            names.add(f"{mod}.{attr}" if mod and attr else "<unresolved>.<global>")
            stack_strings.append(None)
        elif name == "MEMOIZE":
            memo[len(memo)] = top
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = top
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack_strings.append(memo.get(int(arg)))
        elif isinstance(arg, str) and "UNICODE" in name or name in ("STRING", "BINSTRING", "SHORT_BINSTRING"):
            stack_strings.append(str(arg))
        else:
            stack_strings.append(None)
    return names


def _pickles_in(path: Path) -> list[tuple[str, bytes]]:
    """The pickle streams of one checkpoint file: torch.save zips, DCP .metadata, plain pickles."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return [(f"{path.name}:{n}", z.read(n)) for n in z.namelist() if n.endswith(".pkl")]
    head = path.read_bytes()
    if head[:1] == b"\x80":  # a plain pickle (protocol 2+), e.g. DCP's .metadata
        return [(path.name, head)]
    return []


def problem(path: Path) -> tuple[str, str] | None:
    """None if the checkpoint is complete and safe, else ("corrupt" | "unsafe", why)."""
    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    if path.is_dir():
        markers = {p.name for p in files}
        if not ({".metadata", "latest"} & markers) and not any(p.suffix in (".pt", ".ckpt") for p in files):
            return ("corrupt", "no .metadata, latest or *.pt file in it")
        if ".metadata" not in markers and any(p.suffix == ".distcp" for p in files):
            return ("corrupt", "DCP shards without .metadata (the write did not finish)")
    elif not zipfile.is_zipfile(path):
        return ("corrupt", "not a complete torch.save archive (truncated?)")
    for f in files:
        if f.suffix in (".distcp",):
            continue
        try:
            streams = _pickles_in(f)
            for name, data in streams:
                bad = sorted(g for g in pickle_globals(data) if not g.startswith(SAFE_GLOBAL_PREFIXES))
                if bad:
                    return ("unsafe", f"{name} would import {', '.join(bad)}")
        except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
            return ("corrupt", f"{f.name}: {e}")
    return None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete, safe checkpoint; corrupt ones are skipped with a warning,
    an unsafe one stops the run (UnsafeCheckpoint)."""
    for path in complete_checkpoints(run_dir):
        issue = problem(path)
        if issue is None:
            return path
        kind, why = issue
        if kind == "unsafe":
            raise UnsafeCheckpoint(
                f"Refusing checkpoint {path}: {why}. Loading it would run code. Delete it (or the run dir) "
                "if you did not put it there; Loom never writes such checkpoints."
            )
        log.warning(f"checkpoint {path.name} is incomplete or corrupt ({why}); falling back to the previous one")
    return None


def remove(path: Path) -> None:
    """A checkpoint, and the universal form a ZeRO resume at another world size derived from it
    (`<name>.universal`, loom.strategies.deepspeed_universal)."""
    for p in (path, path.with_name(path.name + ".universal")):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def write_final_weights(run_dir: Path, specs: list[Spec], tensors: Iterable[tuple[str, Any]],
                        metadata: dict[str, str]) -> Path:
    """final/model.safetensors, streamed (one tensor in memory at a time) and renamed into place
    when whole: loadable with plain `safetensors.torch.load_file`, no Loom needed.

    `specs` announces every (key, shape, dtype) up front; `tensors` yields them in that order."""
    return write_weights_file(RunDir(run_dir).final, specs, tensors, metadata)


def write_weights_file(out: Path, specs: list[Spec], tensors: Iterable[tuple[str, Any]],
                       metadata: dict[str, str]) -> Path:
    """`out`/model.safetensors as `write_final_weights` lays it out (`loom export --format loom`
    writes the same file elsewhere)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    with atomic_path(path) as tmp, SafetensorsStream(tmp, specs, metadata) as stream:
        for name, tensor in tensors:
            stream.write(name, tensor)
    return path
