"""Strategy checks (torch-free): each option's own fields and its fit with the hardware and
model. The registry (`loom.strategies.registry`) names which check each option runs."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.bundle import shipped_path
from loom.errors import fail, require
from loom.layout import ParallelLayout
from loom.models import (
    MODELS,
    attention_heads,
    context_problem,
    expert_count,
    kv_heads,
    model_key,
    module_classes,
    split_problem,
)
from loom.strategies.schema import COMM_HOOKS

MODEL_PARALLEL_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")  # of hardware.schema.PRECISIONS


# checkpoint.async: why the strategies without async checkpoints (the registry's `async_checkpoint`)
# cannot write them in the background (the sentence the refusal gives).
EXPORT_FORMATS = ("loom", "hf")  # checkpoint.export_format
_NO_ASYNC_WHY = {
    "replicated": "Lightning's AsyncCheckpointIO would clone the whole state on the training thread "
              "and still stage it in a BytesIO, with no completion to wait on before the checkpoint "
              "is renamed into place",
    "zero": "DeepSpeed 0.19.8's own background writer (checkpoint.writer.decoupled) fails at "
            "engine start without a Megatron-style model-parallel unit ('UniversalParallelInfo' "
            "object has no attribute 'dp_rank') and needs its launcher's CROSS_RANK/CROSS_SIZE",
}


def check_checkpoint(cfg: DictConfig, async_ok: list[str]) -> None:
    """checkpoint.export_dtype and export_format are ones Loom writes; checkpoint.async only where
    it can run (`async_ok`: the registry's options with `async_checkpoint`)."""
    from loom.rundir.safetensors_stream import EXPORT_DTYPES

    c, name = cfg.checkpoint, cfg.strategy.name
    require(c.export_dtype in EXPORT_DTYPES, "checkpoint.export_dtype", c.export_dtype,
            f"valid choices: {', '.join(EXPORT_DTYPES)} (the dtype of every floating-point tensor "
            "in final/model.safetensors)")
    require(c.export_format in EXPORT_FORMATS, "checkpoint.export_format", c.export_format,
            f"valid choices: {', '.join(EXPORT_FORMATS)} (loom: final/model.safetensors; hf: final/ is a "
            "directory transformers' from_pretrained loads)")
    require(float(c.export_shard_gb) > 0, "checkpoint.export_shard_gb", c.export_shard_gb,
            "must be > 0 (the largest weight file of checkpoint.export_format=hf, in GB)")
    if c["async"] and name not in async_ok:
        why = _NO_ASYNC_WHY["zero" if name.startswith("zero") else "replicated"]
        require(False, "checkpoint.async", c["async"],
                f"strategy={name} cannot write checkpoints in the background: {why}. Strategies with "
                f"async checkpoints: {', '.join(async_ok)}; or set checkpoint.async=false")


# trainer.compile: strategies that cannot run a compiled model, and why (the refusal's sentence).
_NO_COMPILE_WHY = {
    "zero3": "ZeRO-3 gathers each submodule's parameters in forward hooks that torch.compile traces "
             "into: on torch 2.13 / DeepSpeed 0.19.8 every layer recompiles until dynamo's recompile "
             "limit (8) and falls back to eager, so compile only adds time",
}


def check_compile(cfg: DictConfig) -> None:
    """trainer.compile only where the strategy runs the compiled model (single, ddp, fsdp,
    fsdp_tp, zero1, zero2: checked by tests/test_compile.py)."""
    name = cfg.strategy.name
    if cfg.trainer.compile and name.startswith("zero3"):
        require(False, "trainer.compile", True,
                f"strategy={name} cannot compile: {_NO_COMPILE_WHY['zero3']}. Use strategy=fsdp "
                "(per-block compile before FSDP2) or zero2, or set trainer.compile=false")


def check_single(cfg: DictConfig, layout: ParallelLayout) -> None:
    require(layout.world == 1, "hardware.devices", cfg.hardware.devices,
            "strategy=single runs one process: set hardware.devices=1 "
            "(and hardware.num_nodes=1) or choose strategy=ddp")


def check_ddp(cfg: DictConfig, layout: ParallelLayout) -> None:
    s = cfg.strategy
    require(s.comm_hook in COMM_HOOKS, "strategy.comm_hook", s.comm_hook,
            "valid choices: null, " + ", ".join(str(h) for h in COMM_HOOKS[1:]))
    require(s.bucket_cap_mb >= 1, "strategy.bucket_cap_mb", s.bucket_cap_mb, "must be >= 1")


def check_model_parallel(cfg: DictConfig, layout: ParallelLayout) -> None:
    """fsdp / fsdp_tp: sharding units exist in the model; the TP size fits devices and heads."""
    s, hw, model = cfg.strategy, cfg.hardware, cfg.model
    if s.shard_units is not None:
        units = list(s.shard_units)
        require(len(units) > 0, "strategy.shard_units", units,
                "list at least one module class name, or null for the model's default "
                "(its decoder layers; a transformers model's _no_split_modules)")
        classes = module_classes(cfg)  # the model family's names (models.registry); empty: not known here
        if classes:
            bad = [u for u in units if u not in classes]
            require(not bad, "strategy.shard_units", units,
                    f"{', '.join(map(str, bad))} is not a module class of model={model.name}; "
                    f"valid choices: {', '.join(classes)}")
    require(hw.precision in MODEL_PARALLEL_PRECISIONS, "hardware.precision", hw.precision,
            f"strategy={s.name} has no fp16 mixed precision: FSDP2's MixedPrecisionPolicy casts to "
            "bf16 and reduces in fp32, and fp16 would need a gradient scaler Lightning's "
            f"ModelParallelStrategy does not provide; valid choices: {', '.join(MODEL_PARALLEL_PRECISIONS)}. "
            "Use hardware.precision=bf16-mixed, or strategy=ddp or zero1/zero2/zero3 for 16-mixed")
    if "tensor_parallel" in s:
        _check_tensor_parallel(cfg, layout)
    check_expert_parallel(cfg, layout)
    check_context_parallel(cfg, layout)


def check_expert_parallel(cfg: DictConfig, layout: ParallelLayout) -> None:
    """strategy.ep: a mixture of experts whose experts and data-parallel shard dim it divides;
    built with FSDP2 alone (no tp, pp or HSDP beside it yet)."""
    ep = int(cfg.strategy.get("ep", 1) or 1)
    if ep == 1:
        return
    require(ep >= 1, "strategy.ep", ep, "must be >= 1 (1: no expert parallelism)")
    experts = expert_count(cfg)
    require(experts > 0, "strategy.ep", ep, f"model={cfg.model.name} has no routed experts to split; use strategy.ep=1")
    valid = [d for d in range(1, experts + 1) if experts % d == 0 and layout.dp_shard % d == 0]
    require(experts % ep == 0, "strategy.ep", ep,
            f"must divide model.num_experts={experts} (each expert-parallel rank holds whole experts); valid: "
            f"{', '.join(map(str, valid))}")
    require(layout.dp_shard % ep == 0, "strategy.ep", ep,
            f"must divide the data-parallel shard size dp_shard={layout.dp_shard} (expert-parallel ranks are "
            f"data-parallel ranks that exchange tokens); valid: {', '.join(map(str, valid))}")
    require(layout.tp == 1 and layout.pp == 1 and layout.dp_replicate == 1, "strategy.ep", ep,
            f"expert parallelism is built beside FSDP2 alone so far (this layout: dp_replicate={layout.dp_replicate} "
            f"tp={layout.tp} pp={layout.pp}); use strategy.tp=1 strategy.pp=1, and strategy.hybrid_shard=false "
            "across nodes")


CP_STYLES = ("ulysses", "ring")  # strategy.cp_style
CP_OPTIONS = ("fsdp", "fsdp_tp", "nd")  # the options with a strategy.cp (their schemas)


def key_notes() -> dict[str, str]:
    """What a strategy.* key some options have means for the others (appended to an unknown-key refusal)."""
    return {f"strategy.{k}": f"strategy.{k} (context parallelism) is a mesh dimension of "
                             f"strategy={', '.join(CP_OPTIONS)}: ZeRO, DDP and pp keep whole sequences; use "
                             f"strategy=fsdp strategy.cp=N" for k in ("cp", "cp_style")}


def check_context_parallel(cfg: DictConfig, layout: ParallelLayout) -> None:
    """strategy.cp / cp_style: the model's attention splits, the sequence and the heads divide, and
    what it is built beside so far (no pipeline, expert parallelism or preference pairs yet)."""
    s, cp = cfg.strategy, layout.cp
    style = s.get("cp_style", "ulysses")
    require(style in CP_STYLES, "strategy.cp_style", style,
            "valid choices: ulysses (all-to-all from sequence to heads around attention, any device), "
            "ring (torch's context_parallel, CUDA only)")
    if cp == 1:
        return
    model = cfg.model.name
    others = layout.tp * layout.pp
    fits = [str(k * cp * others) for k in range(1, 5)]
    require(layout.world % (cp * others) == 0, "strategy.cp", cp,
            f"strategy.cp={cp}" + (f" x tp x pp = {cp * others}" if others > 1 else "") + f" must divide the world "
            f"size {layout.world} (hardware.devices x hardware.num_nodes); worlds that fit: {', '.join(fits)}, ...")
    problem = context_problem(cfg)
    require(problem is None, "strategy.cp", cp, f"model={model} cannot split its sequences: {problem}; use strategy.cp=1")
    unit = cp * (2 if style == "ring" else 1)
    seq = int(cfg.dataset.seq_len)
    near = sorted({max(unit, seq // unit * unit), (seq // unit + 1) * unit})
    require(seq % unit == 0, "dataset.seq_len", seq,
            f"must be a multiple of {unit}: each of the strategy.cp={cp} ranks holds an equal slice of every "
            + ("sequence, two chunks each under cp_style=ring (the causal work balanced)" if style == "ring"
               else "sequence") + f", and Loom pads nothing; valid nearby: {', '.join(map(str, near))}")
    if style == "ring":
        require(cfg.hardware.accelerator == "gpu", "strategy.cp_style", style,
                "ring attention runs on CUDA only (torch 2.13's context_parallel has no sharding rule for the "
                "CPU attention kernel); use strategy.cp_style=ulysses")
        require(cfg.dataset.get("packing") != "documents", "strategy.cp_style", style,
                "ring attention (torch's context_parallel over SDPA) is plain causal, so packed documents would "
                "attend across each other; use strategy.cp_style=ulysses, which keeps the document mask")
    else:
        _check_ulysses_heads(cfg, layout)
    built = layout.ep == 1 and layout.dp_replicate == 1
    require(built, "strategy.cp", cp,
            f"context parallelism is built beside FSDP2, tensor and pipeline parallelism so far (this layout: "
            f"ep={layout.ep} dp_replicate={layout.dp_replicate}); use strategy.ep=1 and strategy.dp_replicate=1 "
            "(strategy.hybrid_shard=false across nodes), or strategy.cp=1")
    from loom.data import is_pairs

    require(not is_pairs(cfg.dataset), "strategy.cp", cp,
            "a preference pair's two sequences are scored whole by the pair objective; use strategy.cp=1")


def _check_ulysses_heads(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Ulysses hands each of cp x tp ranks whole query heads and whole key/value heads."""
    split, heads, kv = layout.cp * layout.tp, attention_heads(cfg), kv_heads(cfg)
    on = f"strategy.cp={layout.cp}" + (f" x tensor parallelism {layout.tp}" if layout.tp > 1 else "")
    for what, n, key in (("query", heads, model_key(cfg, "heads")), ("key/value", kv, model_key(cfg, "kv_heads"))):
        if n is None or n % split == 0:
            continue
        valid = [d for d in range(1, n + 1) if n % (d * layout.tp) == 0 and (heads or n) % (d * layout.tp) == 0]
        fail("strategy.cp", layout.cp,
             f"{on} = {split} must divide the {n} {what} heads ({key}={n}): Ulysses gives each rank whole heads; "
             f"valid strategy.cp: {', '.join(map(str, valid))}; or strategy.cp_style=ring on CUDA, which splits "
             "no heads")


def _check_tensor_parallel(cfg: DictConfig, layout: ParallelLayout) -> None:
    s, hw, model = cfg.strategy, cfg.hardware, cfg.model
    tp = s.tensor_parallel
    require(tp >= 1, "strategy.tensor_parallel", tp, "must be a positive integer (>= 1)")
    heads = attention_heads(cfg)

    def whole_heads(d: int) -> bool:  # each tensor-parallel rank holds whole heads
        return heads is None or heads % d == 0

    keep = (f"; or keep it and use hardware.devices={', '.join(str(tp * k) for k in range(1, 5))}, ..."
            if whole_heads(tp) else f" ({tp} cannot split {model_key(cfg, 'heads')}={heads} heads either)")
    require(hw.devices % tp == 0, "strategy.tensor_parallel", tp,
            f"must divide hardware.devices={hw.devices} (tensor-parallel groups stay within a node); valid "
            f"choices: {', '.join(str(d) for d in range(1, hw.devices + 1) if hw.devices % d == 0 and whole_heads(d))}"
            + keep)
    require(layout.world % tp == 0, "strategy.tensor_parallel", tp, f"must divide the world size {layout.world}")
    problem = split_problem(cfg, "tensor_parallel")
    require(problem is None, "model.name", model.name,
            f"strategy={s.name} needs a model with a tensor-parallel plan, and model={model.name} has none: "
            f"{problem}. Use strategy=fsdp for this model")
    require(whole_heads(tp), "strategy.tensor_parallel", tp,
            f"must divide {model_key(cfg, 'heads')}={heads} (each tensor-parallel rank holds whole heads)")


def normalize_zero(cfg: DictConfig) -> None:
    """The user's DeepSpeed JSON is frozen as an absolute path: ranks and resumes may run elsewhere
    (`conf/deepspeed/*.json`, the shipped examples, are found in an installed Loom too)."""
    s = cfg.strategy
    if s.get("deepspeed_config"):
        s.deepspeed_config = str(shipped_path(str(s.deepspeed_config)).resolve())


def check_zero(cfg: DictConfig, layout: ParallelLayout) -> None:
    """DeepSpeed ZeRO: offload options per stage, the user's JSON, host memory for offload."""
    from loom.strategies.deepspeed_config import resolved_deepspeed_config, zero_stage

    s = cfg.strategy
    require(not s.offload_params or zero_stage(s.name) == 3, "strategy.offload_params", s.offload_params,
            f"parameter offload needs ZeRO stage 3 (strategy=zero3 or zero3_offload), not strategy={s.name}")
    require(cfg.hardware.accelerator != "cpu" or cfg.hardware.precision != "16-mixed", "hardware.precision",
            cfg.hardware.precision, f"strategy={s.name} on CPU: DeepSpeed's CPU accelerator has no fp16; "
            "use hardware.precision=bf16-mixed or 32-true")
    resolved_deepspeed_config(cfg, layout)  # one ConfigError listing every problem of the user's JSON
    problem = MODELS[cfg.model.name].zero3_problem(cfg) if zero_stage(s.name) == 3 else None
    if problem:
        key, why = problem
        fail(key, cfg.model.get(key.split(".", 1)[1]), f"{why} (strategy={s.name})")
    if s.offload_optimizer or s.offload_params:
        _check_offload_memory(cfg, layout)


def check_zero3_offload(cfg: DictConfig, layout: ParallelLayout) -> None:
    s = cfg.strategy
    require(s.offload_optimizer, "strategy.offload_optimizer", s.offload_optimizer,
            "strategy=zero3_offload is ZeRO-3 with the optimizer on the host; use strategy=zero3 for no offload")
    check_zero(cfg, layout)


def _check_offload_memory(cfg: DictConfig, layout: ParallelLayout) -> None:
    from loom.models import model_spec

    s, hw = cfg.strategy, cfg.hardware
    params = model_spec(cfg).params
    # ZeRO-Offload keeps the fp32 master copy + Adam m and v on the host: 12 bytes per
    # parameter, partitioned over all ranks; one node hosts `devices` partitions.
    per_param = 12 + (4 if s.offload_params else 0)
    need = per_param * params / layout.world * hw.devices
    have = hw.host_memory_gb * 1e9 * 0.8
    require(need <= have, "hardware.host_memory_gb", hw.host_memory_gb,
            f"strategy={s.name} keeps {need / 1e9:,.1f} GB of optimizer state"
            f"{' and parameters' if s.offload_params else ''} in host memory per node "
            f"({per_param} bytes x {params / 1e6:,.1f}M params x {hw.devices}/{layout.world} ranks), "
            f"more than 80% of hardware.host_memory_gb; use more nodes, a smaller model, "
            f"or a profile with more host memory")


def check_pp(cfg: DictConfig, layout: ParallelLayout) -> None:
    """strategy=pp: the degrees were resolved by `layout_of`; the pipeline options here."""
    from loom.strategies.degrees import check_pipeline

    check_pipeline(cfg, layout.pp)


def check_nd(cfg: DictConfig, layout: ParallelLayout) -> None:
    """strategy=nd: tp divides the heads, the pipeline options, and the combinations built so far."""
    from loom.strategies.degrees import check_pipeline

    model = cfg.model
    if layout.tp > 1:
        problem = split_problem(cfg, "tensor_parallel")
        require(problem is None, "strategy.tp", layout.tp,
                f"model={model.name} has no tensor-parallel plan ({problem}); use strategy.tp=1")
        heads = attention_heads(cfg)
        require(heads is None or heads % layout.tp == 0, "strategy.tp", layout.tp,
                f"must divide {model_key(cfg, 'heads')}={heads} (each tensor-parallel rank holds whole heads); "
                f"valid: {', '.join(str(d) for d in range(1, (heads or 1) + 1) if (heads or 1) % d == 0)}")
        require(cfg.hardware.devices % layout.tp == 0, "strategy.tp", layout.tp,
                f"must divide hardware.devices={cfg.hardware.devices} (tensor-parallel groups stay within a node)")
    check_pipeline(cfg, layout.pp)
    if layout.pp == 1:
        check_model_parallel(cfg, layout)
    else:
        check_context_parallel(cfg, layout)
    built = layout.pp > 1 or layout.dp_replicate == 1 or layout.dp_shard > 1
    require(built, "strategy", f"dp_replicate={layout.dp_replicate} dp_shard={layout.dp_shard} "
            f"tp={layout.tp} pp={layout.pp}",
            "this combination is not built yet: with strategy.pp=1, dp_replicate > 1 needs dp_shard > 1 "
            "(HSDP); set strategy.dp_shard, add a pipeline (strategy.pp > 1) or use strategy=ddp")
