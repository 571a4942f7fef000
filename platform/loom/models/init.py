"""Initial weights that do not depend on how the model is sharded.

Each parameter's full value is drawn from its own generator, seeded by the run seed and the
parameter's name; a rank then keeps only its part (a DTensor's local shard, or under ZeRO-3
the partition DeepSpeed keeps after `GatheredParameters`). So `single`, `ddp`, `fsdp`,
`fsdp_tp` and `zero*` start from the same weights for the same seed, and no rank ever holds
more than one full parameter besides its shards.

Written by hand because torch offers no sharding-independent init on CPU: DTensor random ops
are only offset-consistent on CUDA, and `reset_parameters` draws from the global RNG in
module order, which meta construction and sharding change.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from loom.models.activation_checkpointing import clean_name

# (kind, std) for a parameter's name and shape: ("normal", std) | ("zeros", 0) | ("ones", 0)
Rule = Callable[[str, tuple[int, ...]], tuple[str, float]]
# (a parameter's name, the names a file holds, a reader of one of them, the rows of dim 0 wanted
# or None for all) -> those rows of its value, or None. An adapter may ignore `rows` and return
# the whole value (FileInit then cuts the rows); the MoE family's reads only those experts.
Derive = Callable[[str, set[str], Callable[[str], torch.Tensor], range | None], torch.Tensor | None]


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (run seed, parameter name); Python's hash() is salted per process."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def std_rule(std: float, constants: dict[str, float] | None = None) -> Rule:
    """Transformers' common init (normal(initializer_range) matrices, zero biases, unit norms),
    with the architecture's own constant for the 1-D parameters in `constants` (`own_constants`:
    Gemma's `x * (1 + w)` norms start at 0, not 1)."""
    constants = constants or {}

    def rule(name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        if name in constants:
            return "fill", constants[name]
        if name.endswith("bias"):
            return "zeros", 0.0
        return ("normal", std) if len(shape) >= 2 else ("ones", 0.0)

    return rule


def own_constants(meta_model: nn.Module) -> dict[str, float]:
    """The value a transformers model's own `_init_weights` gives each 1-D parameter it fills
    with one constant (norm gains: 1, or 0 where the norm multiplies by 1 + w), by name. Each
    module holding only 1-D parameters is copied to the CPU at full size (a norm: hidden-size
    floats) and initialized there by the model itself, one module at a time; drawn values
    (not constant) are left to the rule. Written by hand because the init runs on meta otherwise,
    where it computes nothing."""
    init = getattr(meta_model, "_init_weights", None)
    out: dict[str, float] = {}
    if init is None:
        return out
    for prefix, module in meta_model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own or any(p.dim() != 1 for p in own.values()):
            continue
        twin = copy.deepcopy(module).to_empty(device="cpu")
        for p in twin.parameters(recurse=False):
            p.data.fill_(float("nan"))  # a parameter the init skips is not mistaken for a constant
        try:
            init(twin)
        except Exception:  # noqa: BLE001 (an init that needs more than the module: the rule decides)
            continue
        for name, p in twin.named_parameters(recurse=False):
            values = p.detach()
            if values.numel() and not values[0].isnan() and bool((values == values[0]).all()):
                out[f"{prefix}.{name}" if prefix else name] = float(values[0])
    return out


CHUNK = 1 << 20  # elements per generator: a rank draws only the chunks its part overlaps


class NamedInit:
    """The initial value of any parameter, by name, on any device: the flattened parameter
    is cut in chunks of CHUNK elements, each drawn from a CPU generator seeded by (run seed,
    name, chunk index), so any contiguous range of it can be drawn alone, and the same seed
    gives the same weights on every device and strategy."""

    def __init__(self, seed: int, rule: Rule, zero_rows: dict[str, int] | None = None) -> None:
        self.seed, self.rule = seed, rule
        self.zero_rows = dict(zero_rows or {})  # parameter -> a row that starts at zero (padding_rows)

    def fill_flat(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int) -> None:
        """Write elements [start, start + dest.numel()) of the flattened full value into `dest` (1-D)."""
        kind, std = self.rule(name, shape)
        if kind != "normal":
            dest.fill_({"zeros": 0.0, "ones": 1.0}.get(kind, std))  # "fill": the rule's value
            return
        self._draw(dest, name, shape, start, std)
        row = self.zero_rows.get(name)
        if row is not None and len(shape) >= 2:
            width = math.prod(shape[1:])
            a, b = max(start, row * width), min(start + dest.numel(), (row + 1) * width)
            if a < b:
                dest[a - start:b - start].zero_()

    def _draw(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int, std: float) -> None:
        """normal(0, std) for that range, from the generators of the chunks it overlaps."""
        end, total = start + dest.numel(), math.prod(shape)
        for k in range(start // CHUNK, (end - 1) // CHUNK + 1 if end > start else 0):
            lo, hi = k * CHUNK, min((k + 1) * CHUNK, total)
            # Drawn on the CPU whatever the destination: CUDA's generator gives other numbers
            # for the same seed, so the same seed would start a GPU run (or zero3_offload's
            # CPU-held parameters beside a GPU strategy's) from different weights.
            gen = torch.Generator().manual_seed(param_seed(self.seed, f"{name}#{k}"))
            chunk = torch.empty(hi - lo, device="cpu").normal_(0.0, std, generator=gen)
            a, b = max(start, lo), min(end, hi)
            dest[a - start:b - start].copy_(chunk[a - lo:b - lo])

    def full_value(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, device=device)
        self.fill_flat(out.view(-1), name, shape, 0)
        return out


class ResetParametersInit(NamedInit):
    """A user's module: each leaf's own `reset_parameters()` (the convention Lightning's
    meta-device materialization uses), run on a full-size CPU twin of that leaf under an RNG
    seeded by the run seed and the leaf's name. Only one twin is alive at a time."""

    def __init__(self, seed: int, meta_model: nn.Module) -> None:
        super().__init__(seed, lambda name, shape: ("zeros", 0.0))
        self.leaves = {name: mod for name, mod in meta_model.named_modules()
                       if any(True for _ in mod.parameters(recurse=False))}
        self._twin: tuple[str, nn.Module] | None = None

    def full_value(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        leaf, _, attr = name.rpartition(".")
        if self._twin is None or self._twin[0] != leaf:
            twin = copy.deepcopy(self.leaves[leaf]).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(param_seed(self.seed, leaf))
                twin.reset_parameters()
            self._twin = (leaf, twin)
        return getattr(self._twin[1], attr).detach().to(device=device, dtype=torch.float32)

    def fill_flat(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int) -> None:
        dest.copy_(self.full_value(name, shape, dest.device).view(-1)[start:start + dest.numel()])


def padding_rows(model: nn.Module) -> dict[str, int]:
    """Every name of an `nn.Embedding(padding_idx=i)` weight (a tied head's too) -> i: that row
    starts at zero, as `nn.Embedding.reset_parameters` and transformers' `_init_weights` leave
    it (it never gets a gradient, so it stays what it started as)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {name: int(m.padding_idx) for m in model.modules()
            if isinstance(m, nn.Embedding) and m.padding_idx is not None for name in names.get(id(m.weight), [])}


def meta_capable(meta_model: nn.Module) -> str | None:
    """None if every module holding parameters can re-create them (`reset_parameters`), else why not."""
    missing = sorted({type(m).__name__ for m in meta_model.modules()
                      if any(True for _ in m.parameters(recurse=False)) and not callable(
                          getattr(m, "reset_parameters", None))})
    return f"{', '.join(missing)} define no reset_parameters()" if missing else None


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Build a module with its parameters on the meta device and its buffers real.

    As accelerate's `init_empty_weights(include_buffers=False)` (not a Loom dependency):
    buffers computed in `__init__` (rotary frequencies, masks) keep their values, while no
    parameter storage is allocated.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = {k: v for k, v in vars(param).items()}
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, init: NamedInit) -> None:
    """Allocate the (possibly sharded) meta parameters on `device` and initialize them; the
    buffers keep the values they were built with."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    tied = _tied_parameters(model)
    model.to_empty(device=device)
    for (owner, attr), *others in tied:  # to_empty gives each module its own new tensor
        for module, name in others:
            setattr(module, name, getattr(owner, attr))
    for name, b in model.named_buffers():
        if name in buffers:
            b.copy_(buffers[name])
    initialize(model, init, device)


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) of every parameter shared by several modules (tied embeddings)."""
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            users.setdefault(id(p), []).append((module, attr))
    return [u for u in users.values() if len(u) > 1]


@torch.no_grad()
def initialize(model: nn.Module, init: NamedInit, device: torch.device) -> None:
    """Write every parameter's initial value into what this rank holds of it."""
    for name, p in model.named_parameters():
        _write(p, init, clean_name(name), device)


def _write(p: torch.Tensor, init: NamedInit, name: str, device: torch.device) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        _write_dtensor(p, init, name, device)
    elif hasattr(p, "ds_id"):
        _write_zero3_partition(p, init, name)
    else:
        init.fill_flat(p.view(-1), name, tuple(p.shape), 0)


def _write_dtensor(p: torch.Tensor, init: NamedInit, name: str, device: torch.device) -> None:
    """A row-sharded (Shard(0)) local tensor is a contiguous range of the flattened
    parameter: draw only that. Other layouts (TP column splits, FSDP over TP's strided
    shards) draw the full value and let DTensor cut this rank's part."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, local = tuple(p.shape), p.to_local()
    # FSDP2 over an expert- or tensor-parallel Shard(0) shards the rows again (_StridedShard):
    # still one contiguous block of rows per rank, which compute_local_shape_and_global_offset finds
    strided_then_shard = [type(pl) for pl in p.placements] == [_StridedShard, Shard] and \
        all(pl.dim == 0 for pl in p.placements)
    if strided_then_shard or all(type(pl) in (Shard, Replicate) and (type(pl) is Replicate or pl.dim == 0)
                                 for pl in p.placements):
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if local.numel():
            init.fill_flat(local.view(-1), name, shape, offset[0] * math.prod(shape[1:]))
        return
    full = init.full_value(name, shape, device)
    local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


def _write_zero3_partition(p: torch.Tensor, init: NamedInit, name: str) -> None:
    """ZeRO-3 keeps elements [rank * n, (rank + 1) * n) of the flattened parameter in
    `p.ds_tensor` (zero-padded at the end; see DeepSpeed's `_partition_param`). Written
    directly because `GatheredParameters` would gather the full parameter on every rank."""
    import torch.distributed as dist

    part = p.ds_tensor
    group = getattr(p, "ds_process_group", None)
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    size = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
    start, total = rank * size, p.ds_numel
    valid = max(0, min(size, total - start))
    flat = part.view(-1)
    if valid:
        init.fill_flat(flat[:valid], name, tuple(p.ds_shape), start)
    flat[valid:].zero_()


class FileInit(NamedInit):
    """`model.init_from`: each parameter's value read from safetensors by name, cast to the
    parameter's dtype on copy (an export in bf16 loads into fp32 parameters): one file, or a
    Hugging Face directory's `model.safetensors` or shards (`model.safetensors.index.json`
    says which shard holds which tensor). A rank filling a range of a parameter (its FSDP2
    rows, its ZeRO-3 partition) reads only the rows covering that range
    (`safe_open(...).get_slice`), so no rank reads the whole checkpoint; a whole value (a
    replicated or tensor-parallel parameter) is read whole, one tensor at a time.
    `elements_read` / `elements_wanted` count what was read against the full tensors filled
    (the construction log line says the ratio). A tensor the file holds under other names (a
    family's older layout) comes from `derive(name, the file's names, read)`, the family's
    weight adapter (its LightningModule's `weight_adapter`), None where it has none."""

    def __init__(self, path: str, derive: Derive | None = None) -> None:
        from pathlib import Path

        from loom.models.init_from import tensor_files

        super().__init__(0, lambda name, shape: ("zeros", 0.0))
        self.path, self.derive = path, derive
        self._where = tensor_files(Path(path))  # tensor name -> the file holding it
        self._keys = set(self._where)
        self._open: dict = {}  # file -> its safe_open handle (opened at first use)
        self._last: tuple[str, torch.Tensor] | None = None
        self.elements_read = 0
        self._wanted: dict[str, int] = {}  # tensor -> its elements, for each tensor filled

    @property
    def elements_wanted(self) -> int:
        return sum(self._wanted.values())

    def _handle(self, name: str):
        from safetensors import safe_open

        f = self._where[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._open[f]

    def _get(self, name: str) -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        self.elements_read += t.numel()
        return t

    def _rows(self, name: str, shape: tuple[int, ...], start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the flattened tensor, read as the rows covering them."""
        part = self._handle(name).get_slice(name)
        if tuple(part.get_shape()) != tuple(shape):
            raise ValueError(f"model.init_from={self.path}: {name} has shape {list(part.get_shape())}, "
                             f"the model's is {list(shape)}")
        row = math.prod(shape[1:])
        first, end = start // row, -(-(start + n) // row)
        block = part[first:end].reshape(-1)
        self.elements_read += block.numel()
        return block[start - first * row:start - first * row + n]

    def _tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, self._read(name))
        t = self._last[1]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"model.init_from={self.path}: {name} has shape {list(t.shape)}, "
                             f"the model's is {list(shape)}")
        return t

    def _read(self, name: str) -> torch.Tensor:
        if name in self._keys:
            return self._get(name)
        derived = self.derive(name, self._keys, self._get, None) if self.derive is not None else None
        if derived is not None:
            return derived
        raise KeyError(f"model.init_from={self.path} has no tensor {name}")

    def fill_flat(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int) -> None:
        self._wanted[name] = math.prod(shape)
        n = dest.numel()
        if len(shape) > 0 and n < math.prod(shape):
            if name in self._keys:
                dest.copy_(self._rows(name, shape, start, n))
                return
            cached = self._last is not None and self._last[0] == name
            if self.derive is not None and not cached:  # a derived tensor (another layout): its adapter reads the rows
                row = math.prod(shape[1:])
                rows = range(start // row, -(-(start + n) // row))
                block = self.derive(name, self._keys, self._get, rows)
                if block is not None and tuple(block.shape) == (len(rows), *shape[1:]):
                    dest.copy_(block.reshape(-1)[start - rows.start * row:start - rows.start * row + n])
                    return
                if block is not None:  # the adapter read it whole: kept for the next range
                    self._last = (name, block)
        dest.copy_(self._tensor(name, shape).reshape(-1)[start:start + n])

    def full_value(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        self._wanted[name] = math.prod(shape)
        return self._tensor(name, shape).to(device=device)
