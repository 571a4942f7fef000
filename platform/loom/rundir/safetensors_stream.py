"""A safetensors file written one tensor at a time: the final weights without a second full copy.

Written by hand because the `safetensors` package has no streaming writer: `save_file` takes
the whole dict of tensors at once (the consolidated model held on one rank, then serialized
again in Rust). DCP's `HuggingFaceStorageWriter` writes per-rank shards and consolidates them in
a second pass, and has nothing to say about ZeRO's flat partitions. The format is small enough
to write directly (https://github.com/huggingface/safetensors#format): 8 bytes little-endian
header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}} padded
with spaces to a multiple of 8, then the raw little-endian bytes of each tensor, back to back.
Every shape and dtype is known from the model before any tensor is gathered, so the header goes
first and each tensor's bytes follow as they arrive; the file loads with plain
`safetensors.torch.load_file`.

Torch-free at module level (rundir/): torch is only touched through the tensors handed in.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Any

# checkpoint.export_dtype -> the torch dtype name floating tensors are cast to.
EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# torch dtype name -> (safetensors dtype tag, bytes per element)
_TAGS = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint8": ("U8", 1), "bool": ("BOOL", 1),
}

Spec = tuple[str, tuple[int, ...], str]  # (key, shape, torch dtype name without "torch.")


def dtype_name(dtype: Any) -> str:
    """"float32" for torch.float32 (and for the string "float32")."""
    return str(dtype).removeprefix("torch.")


def tensor_bytes(spec: Spec) -> int:
    """Bytes of one announced tensor in the file."""
    _, shape, dtype = spec
    return math.prod(shape) * _TAGS[dtype][1]


def header_bytes(specs: list[Spec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header for tensors laid out back to back in `specs` order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in _TAGS:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors encoding; known: {', '.join(_TAGS)}")
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        tag, size = _TAGS[dtype]
        n = math.prod(shape) * size
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsStream:
    """Write `specs`' header now, then `write(name, tensor)` each tensor in the same order.

    `close` checks that every tensor arrived and fsyncs; use it as a context manager on a
    temporary path (loom.atomic.atomic_path) so a half-written file is never the final one.
    """

    def __init__(self, path: Path, specs: list[Spec], metadata: dict[str, str] | None = None) -> None:
        self.specs = list(specs)
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(header_bytes(self.specs, metadata or {}))

    def write(self, name: str, tensor: Any) -> None:
        """Append one tensor's bytes; its name, shape and dtype must be the next spec's."""
        import torch

        if self._next >= len(self.specs):
            raise ValueError(f"{name}: more tensors than the header announced ({len(self.specs)})")
        want = self.specs[self._next]
        got = (name, tuple(tensor.shape), dtype_name(tensor.dtype))
        if got != want:
            raise ValueError(f"tensor {self._next} is {got}, the header announced {want}")
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        # Bytes as stored (little-endian hosts); a uint8 view is zero-copy, and numpy's buffer
        # protocol hands it to write() without another copy (numpy has no bfloat16, uint8 does).
        self._file.write(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
        self._next += 1

    def close(self) -> None:
        try:
            if self._next != len(self.specs):
                raise ValueError(f"only {self._next} of {len(self.specs)} tensors were written")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()

