"""The tensors of a run's weights, one at a time, whatever wrote them: final/ (safetensors), a
single/ddp Lightning `.ckpt`, a DCP directory (fsdp, fsdp_tp, pp, nd: sharded DTensors) or a
DeepSpeed ZeRO directory. No process group: the export runs in one plain process.

Each reader is the format's own tool: `safetensors.safe_open`; `torch.load(mmap=True)` (a tensor
is read from the file when touched); DCP's `load(..., no_dist=True)` of one entry at a time into
a whole tensor (DCP reassembles it from every rank's shard files); DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)` (the fp32 master weights rebuilt from
the optimizer partitions of every rank: under ZeRO-3 one parameter at a time; under ZeRO-1/2
DeepSpeed concatenates each parameter group's partitions first, so it holds the fp32 model once).

The checkpoint's own pickles were checked first (rundir.checkpoints.problem: only allow-listed
globals), which is what makes DeepSpeed's `weights_only=False` loads and DCP's pickled metadata
acceptable here.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch

from loom.errors import ConfigError

Shape = tuple[int, ...]


class WeightsSource:
    """name -> tensor, read on demand; `entries` in the source's order with shape and dtype.
    `prefix`: what the source puts before the network's own names (a checkpoint holds the
    LightningModule's state, `model.<name>`; final weights hold the network's)."""

    kind = ""
    prefix = "model."

    def entries(self) -> dict[str, tuple[Shape, torch.dtype]]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reader holds open."""


class SafetensorsSource(WeightsSource):
    """final/model.safetensors, or a Hugging Face dir's single file or indexed shards."""

    kind = "safetensors"
    prefix = ""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        from loom.models.init_from import tensor_files

        self._files = tensor_files(path)
        self._open = {f: safe_open(str(f), "pt") for f in dict.fromkeys(self._files.values())}

    def entries(self) -> dict[str, tuple[Shape, torch.dtype]]:
        out = {}
        for name, f in self._files.items():
            piece = self._open[f].get_slice(name)
            out[name] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
        return out

    def get(self, name: str) -> torch.Tensor:
        return self._open[self._files[name]].get_tensor(name)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class LightningSource(WeightsSource):
    """A single/ddp checkpoint: one torch.save file whose `state_dict` is the LightningModule's."""

    kind = "lightning"

    def __init__(self, path: Path) -> None:
        try:
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:  # a global torch's weights-only loader lacks (hyper-parameters):
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)  # allow-listed above
        self._state = ckpt["state_dict"]

    def entries(self) -> dict[str, tuple[Shape, torch.dtype]]:
        return {k: (tuple(t.shape), t.dtype) for k, t in self._state.items() if isinstance(t, torch.Tensor)}

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]


class DcpSource(WeightsSource):
    """A DCP directory (Lightning's ModelParallelStrategy save: the module's entries under
    `state_dict.`): each entry loaded whole from the shards of every rank that wrote it."""

    kind = "dcp"
    PREFIX = "state_dict."

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._reader = FileSystemReader(str(path))
        meta = self._reader.read_metadata().state_dict_metadata
        self._entries = {k.removeprefix(self.PREFIX): (tuple(m.size), m.properties.dtype)
                         for k, m in meta.items()
                         if k.startswith(self.PREFIX) and isinstance(m, TensorStorageMetadata)}

    def entries(self) -> dict[str, tuple[Shape, torch.dtype]]:
        return dict(self._entries)

    def get(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        shape, dtype = self._entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({self.PREFIX + name: tensor}, storage_reader=self._reader, no_dist=True)
        return tensor


class ZeroSource(WeightsSource):
    """A DeepSpeed ZeRO checkpoint directory (`latest` names the tag Lightning wrote)."""

    kind = "zero"

    def __init__(self, path: Path) -> None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed prints its progress (stdout, tqdm on stderr): the export prints its own line
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self._state = get_fp32_state_dict_from_zero_checkpoint(str(path), lazy_mode=True)

    def entries(self) -> dict[str, tuple[Shape, torch.dtype]]:
        return {k: (tuple(t.shape), getattr(t, "dtype", torch.float32)) for k, t in self._state.items()}

    def get(self, name: str) -> torch.Tensor:
        t = self._state[name]
        return t if isinstance(t, torch.Tensor) else t.contiguous()  # a lazy ZeRO-3 GatheredTensor


# Module wrappers whose names enter a checkpoint's keys but not the network's state_dict: torch's
# activation-checkpoint wrapper (ZeRO-3 names parameters through it) and torch.compile's module.
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped(name: str) -> str:
    """`name` without the wrappers' segments: the network's own name of that tensor."""
    for segment in WRAPPERS:
        name = name.replace(segment, "")
    return name


def open_source(path: Path) -> WeightsSource:
    """The reader for `path`: final weights (a .safetensors file or a Hugging Face dir) or a
    checkpoint (a torch.save file, a DCP dir with `.metadata`, a DeepSpeed dir with `latest`)."""
    if path.suffix == ".safetensors" or (path / "config.json").is_file():
        return SafetensorsSource(path)
    if path.is_file():
        return LightningSource(path)
    if (path / ".metadata").is_file():
        return DcpSource(path)
    if (path / "latest").is_file():
        return ZeroSource(path)
    raise ConfigError(f"Invalid usage: loom export: {path} is no checkpoint Loom wrote (neither a torch.save "
                      "file, a DCP directory with .metadata, nor a DeepSpeed directory with `latest`).")
