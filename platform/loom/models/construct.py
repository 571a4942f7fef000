"""Building the model on each rank without ever holding it whole (torchtitan's order):

    build on the meta device -> activation checkpointing -> tensor parallel / fully_shard
    -> allocate the local shards on the target device -> initialize them by name.

Under ZeRO-3 the model is built inside Lightning's `deepspeed.zero.Init` context instead
(each module's parameters are partitioned as soon as it is built) and then initialized
through `GatheredParameters`, one parameter at a time. A model that cannot be built on the
meta device is built in full on every rank, as before, with one log line saying why.
`build_peak_rss_gb` is the process's peak RSS at the end of all this (summary.json
`memory.build_peak_rss_gb_per_rank`): the optimizer does not exist yet.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from loom.models.init import FileInit, initialize, materialize, padding_rows, params_on_meta
from loom.models.lora_checks import lora_on

log = logging.getLogger("loom")


def peak_rss_gb() -> float:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def construct(module: Any, strategy: Any | None) -> None:
    """Give `module.model` its weights on this rank (see the module docstring)."""
    with _freed_memory_returned():
        how = _construct(module, strategy)
    module.build_peak_rss_gb = peak_rss_gb()
    log.info(f"model {type(module.model).__name__}: {how}; "
             f"peak RSS so far {module.build_peak_rss_gb:.2f} GB")


def _construct(module: Any, strategy: Any | None) -> str:
    device = strategy.root_device if strategy is not None else torch.device("cpu")
    zero3 = bool(getattr(strategy, "zero_stage_3", False))
    model, init, on_meta, how = parallelized(module, strategy)
    if init is not None:
        if on_meta:
            materialize(model, device, init)
        elif zero3:
            initialize(model, init, device)
    init = getattr(init, "base", init)  # a LoRA run's initializer wraps the model's
    if isinstance(init, FileInit) and init.elements_wanted:
        how += f" ({init.elements_read / init.elements_wanted:.0%} of its elements read on this rank)"
    return how


def parallelized(module: Any, strategy: Any | None) -> tuple[torch.nn.Module, Any, bool, str]:
    """The build up to the weights: (model, its initializer, whether it is still on the meta
    device, how it was built). `module.model` is set, activation checkpointing, compile and the
    strategy's `parallelize` are applied. `loom plan --rehearse` stops here (loom.rehearse)."""
    device = strategy.root_device if strategy is not None else torch.device("cpu")
    zero3 = bool(getattr(strategy, "zero_stage_3", False))
    with _outside_zero_init(zero3), params_on_meta():
        meta_model = module.build_model()
    init, why_not = module.initializer(meta_model)
    if init is not None:  # read by NamedInit's draws (a file's or reset_parameters' values are kept)
        init.zero_rows.update(padding_rows(meta_model))
    source = getattr(module, "init_source", None)
    if source is not None:  # model.init_from: the file's weights instead of a fresh init
        init, why_not = _file_init(module, str(source)), None
    if zero3:
        with _left_for_loom(init is not None):
            model = module.build_model()  # inside zero.Init (Lightning's model_sharded_context)
        how = "built under deepspeed.zero.Init (partitioned per module)"
    elif init is None:
        model = module.build_model()
        how = f"built in full on every rank: it cannot be built on the meta device ({why_not})"
    else:
        model = meta_model
        how = f"built on the meta device, materialized shard by shard on {device.type}"
    if source is not None:
        how += f", weights from model.init_from={source}"
    module.model = model
    if lora_on(module.cfg.get("model")):  # before AC, compile and fully_shard, which must see the adapters
        init = _lora(module, model, init, on_meta=model is meta_model, zero3=zero3)
        how += f", LoRA r={module.cfg.model.lora.r} adapters (base frozen)"
    parallelize = getattr(strategy, "parallelize", None)
    converter = getattr(module, "model_converter", None)
    if converter is not None:  # float8: Linear layers swapped before AC, compile, TP and fully_shard see them
        converter.convert(model, device, fsdp2=parallelize is not None)
    with _outside_zero_init(zero3):  # the wrapper holds no parameters; zero.Init's hooks break it
        _activation_checkpointing(module, model)
    _compile(module, model, per_unit=parallelize is not None)
    if parallelize is not None:
        parallelize(module)
    return model, init, model is meta_model, how


def _lora(module: Any, model: torch.nn.Module, init: Any, on_meta: bool, zero3: bool) -> Any:
    """peft's adapters in `model` (outside zero.Init: the engine partitions them at its start) and
    the initializer under peft's names (loom.models.lora)."""
    from loom.models import lora

    with _outside_zero_init(zero3):
        lora.apply(module, model, on_meta)
    return lora.wrap_init(init, int(module.cfg.seed))


def _file_init(module: Any, path: str) -> FileInit:
    """A FileInit for `path`, with the module's `weight_adapter` where it has one (a family's
    older layout of the same weights)."""
    adapter = getattr(module, "weight_adapter", None)
    return FileInit(path, adapter() if adapter is not None else None)


@contextmanager
def _outside_zero_init(zero3: bool) -> Iterator[None]:
    """Pause DeepSpeed's zero.Init patching (it would partition, i.e. copy out of, meta tensors)."""
    if not zero3:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context

    shutdown_init_context()
    try:
        yield
    finally:
        restore_init_context()


@contextmanager
def _left_for_loom(initialized_by_loom: bool) -> Iterator[None]:
    """Under zero.Init, a module's parameters are allocated whole, initialized by its own
    `reset_parameters` (torch.nn.init), broadcast from rank 0 and only then cut to this rank's
    partition: one whole parameter written on every rank (the build peak's one-parameter
    transient: 64 MiB for gpt_1b's MLP). When Loom writes every partition next (models.init), that
    work is wasted, so neither runs: torch.nn.init's functions leave parameters alone (buffers
    still get theirs) and DeepSpeed keeps its partition of the untouched tensor (`Init._zero_init_param` without its broadcast), whose pages
    never become resident. The build then holds the local shards only, as FSDP's does; on a
    cluster it also skips a broadcast of the whole model from rank 0 at start."""
    if not initialized_by_loom:  # the module's own values are kept: rank 0's, broadcast
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import Init

    def partition_only(self: Any, param: torch.nn.Parameter) -> None:
        self._convert_to_deepspeed_param(param)
        param.partition()

    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    broadcasting = Init.__dict__.get("_zero_init_param")
    for name, fn in saved.items():
        setattr(torch.nn.init, name, _except_parameters(fn))
    if broadcasting is not None:
        Init._zero_init_param = partition_only
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)
        if broadcasting is not None:
            Init._zero_init_param = broadcasting


_INIT_FUNCTIONS = tuple(n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_"))


def _except_parameters(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` for buffers (a module's own values, kept); a parameter is left as it is."""

    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if isinstance(tensor, torch.nn.Parameter) else fn(tensor, *args, **kwargs)

    return init


@contextmanager
def _freed_memory_returned() -> Iterator[None]:
    """While building, have glibc mmap every block over 1 MB, so that a full weight freed
    after its shard is kept (zero.Init, per module; init chunks) goes back to the OS instead
    of fragmenting the heap (measured: +50 MB RSS per rank for 4 layers of gpt_1b). Afterwards
    the threshold is fixed at 32 MB, where glibc's own dynamic threshold would settle."""
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        yield
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)


def _activation_checkpointing(module: Any, model: torch.nn.Module) -> None:
    mode = module.cfg.trainer.get("activation_checkpointing", "none") or "none"
    if mode == "none":
        return
    from loom.models.activation_checkpointing import apply_activation_checkpointing

    wrapped = apply_activation_checkpointing(model, tuple(module.sharding_units), mode)
    log.info(f"activation checkpointing ({mode}): {wrapped} of the model's "
             f"{', '.join(c.__name__ for c in module.sharding_units) or 'unit'} modules recompute in backward")


def _compile(module: Any, model: torch.nn.Module, per_unit: bool) -> None:
    """`trainer.compile`: torch.compile each sharding unit's `forward` (FSDP2: before
    `fully_shard`, torchtitan's `apply_compile`), or the whole model's (single, ddp, zero*).

    Only `forward` is compiled, in place, so module hooks stay outside the graph (FSDP2's
    all-gathers, activation checkpointing's wrapper around the unit) and no `_orig_mod.` enters
    parameter or state-dict names: name-seeded init, checkpoints and final weights are unchanged.
    Compilation itself happens at the first forward, when TP/FSDP have already sharded the module.
    """
    if not module.cfg.trainer.get("compile", False):
        return
    units = [m for m in model.modules() if m is not model and isinstance(m, tuple(module.sharding_units))]
    units = [u for u in units if not any(u is not o and _contains(o, u) for o in units)]
    targets = units if per_unit and units else [model]
    for target in targets:
        target.forward = torch.compile(target.forward)
    log.info(f"torch.compile: {len(targets)} {'unit' if targets[0] is not model else 'whole-model'} "
             f"forward(s) of {type(model).__name__} (compiled at the first step)")


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
