"""`loom plan --compare` and `strategy=auto` (no torch import): every layout of the world that
validation accepts, with its plan's memory, fit and a predicted step time, best first
(`plan/auto.py` takes the first that fits and says why).

Every layout trains the same global batch, dataset.batch_size x accumulate_grad_batches x the
world (as pure data parallelism would): a layout whose replica spans tp x pp ranks takes a
dataset.batch_size tp x pp times larger (its overrides say so), so step times compare.

Each candidate is the composed config with its `strategy` node replaced (a preset's yaml, or
`nd` with one factorization of the world into dp_replicate x dp_shard x tp x pp), then run
through the same `validate` and `make_plan` as `loom train`: a listed layout is one `loom
train` accepts. The step time model, per device:

    compute = FLOPs per step / world x recompute / rate
    (rate: `loom probe`'s hardware.measured.matmul_tflops, else peak x PEAK_EFFICIENCY,
     else FALLBACK_TFLOPS for the accelerator; float8: x the plan's `float8.compute_speedup`, the
     converted layers' FLOPs at the float8 peak (plan/float8.py). Every layout trains the run's own
     float8 setting: those float8 refuses (ZeRO, pipelines, tp > 1) are counted as refused, not listed)
    comm    = the plan's bytes per step per device / bandwidth
    (bandwidth: hardware.measured.allreduce_busbw_gbps, else the profile's interconnect
     figure, the inter-node one across nodes, else FALLBACK_GBPS)
    latency = the plan's communication calls per step x LATENCY_S (a call's fixed cost)
    exposed = the part of comm + latency (+ host transfers when offloading) that the compute
              does not hide, as each library schedules it (`plan/overlap.py`: FSDP2's
              prefetch, DDP's and ZeRO's bucketed reductions; tensor-parallel all-reduces,
              pipeline sends and host transfers block)
    step    = compute x (1 + bubble / (1 - bubble)) + exposed

On CPU the ranks share `hardware.cpu_cores`: with more ranks than cores each computes at
cores / world of its rate, each call waits that much longer for its members to be scheduled,
and a pipeline bubble idles only the cores the waiting stages would have had. Gloo's
communication runs on the same cores, so on CPU nothing is hidden (exposed = comm).
scripts/bench/layouts.py measures every CPU layout against this prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.compose import conf_dir, group_options
from loom.errors import ConfigError
from loom.layout import world_of
from loom.models import attention_heads, expert_count, kv_heads
from loom.plan import Plan, make_plan
from loom.plan.context import CP_MIN_SEQ_LEN, cp_degrees, worth_offering
from loom.plan.links import bandwidth
from loom.plan.memory import GB
from loom.plan.overlap import RECOMPUTE, Wire, exposed_s
from loom.plan.rates import compute_rate
from loom.strategies.degrees import DEGREE_KEYS
from loom.strategies.registry import STRATEGIES, ranked
from loom.strategies.variants import Machine
from loom.validate import validate, with_strategy

# Seconds per communication call, beside its bytes: gloo over loopback (CPU), NCCL within a
# node and across nodes (GPU). scripts/bench/layouts.py calibrates the CPU figure.
LATENCY_S = {"cpu": 2.5e-3, "gpu": 2e-5, "gpu_internode": 1e-4}
PCIE_GBPS = 25.0               # host <-> device, for zero3_offload's per-step transfers
PIPELINE_KEYS = ("pp_schedule", "pp_microbatches")  # carried from the user's strategy to pp / nd
MESH_KEYS = (*DEGREE_KEYS, "ep", "cp")  # every mesh dimension: the layout column and what tells layouts apart


@dataclass
class Candidate:
    """One layout of the world, as `loom plan --compare` lists it (to_dict: --json's rows)."""

    strategy: str
    degrees: dict[str, int]         # dp_replicate, dp_shard, tp, pp
    overrides: list[str]
    memory_per_device_bytes: float
    capacity_per_device_bytes: float | None
    fits: bool
    compute_s: float | None
    comm_s: float                   # every call's bytes and latency (+ host transfers)
    comm_exposed_s: float           # the part of comm_s no compute hides (plan/overlap.py)
    bubble_fraction: float
    predicted_step_s: float | None
    ep: int = 1                     # expert parallelism (strategy.ep): the mesh's fifth dimension
    cp: int = 1                     # context parallelism (strategy.cp): the sixth
    cp_style: str | None = None     # ulysses | ring when cp > 1
    note: str = ""                  # why a layout is listed as it is (cp: what it divides, and if it makes it fit)
    cfg: DictConfig = field(repr=False, default=None)
    plan: Plan = field(repr=False, default=None)

    def to_dict(self) -> dict[str, Any]:
        keys = ("strategy", "degrees", "ep", "cp", "cp_style", "overrides", "memory_per_device_bytes",
                "capacity_per_device_bytes", "fits", "compute_s", "comm_s", "comm_exposed_s", "bubble_fraction",
                "predicted_step_s", "note")
        f8 = self.plan.float8 if self.plan is not None else None
        return {**{k: getattr(self, k) for k in keys}, "float8": f8["recipe"] if f8 else "none"}


@dataclass
class Comparison:
    candidates: list[Candidate]     # best first
    refused: list[tuple[list[str], str]]  # (overrides, validation's message) of layouts not listed
    rate_source: str
    bandwidth_source: str


def compare(composed: DictConfig) -> Comparison:
    """Every layout of `composed`'s world that validates, best first (fits, then predicted time).
    Context-parallel layouts join for long sequences, or when no layout without cp fits
    (`plan.context.worth_offering`)."""
    world = world_of(composed.hardware)
    listing = _Listing(composed, world)
    listing.add(_nodes(composed, world))
    if worth_offering(composed, any(c.fits for c in listing.listed)):
        listing.add([(n, o) for n, o in _nodes(composed, world, cp_degrees(composed, world)) if _cp(n) > 1])
        _note_context(listing.listed)
    listed, refused = listing.listed, listing.refused
    if not listed and refused:
        raise ConfigError(refused[0][1])
    order = {id(c): i for i, c in enumerate(listed)}  # ties: the registry's `rank`, nd's splits last
    listed.sort(key=lambda c: (*rank_key(c), order[id(c)]))
    return Comparison(listed, refused, compute_rate(composed.hardware, None)[1], bandwidth(composed.hardware)[1])


@dataclass
class _Listing:
    """The layouts validated so far (`listed`), those validation refused, and the degrees seen."""

    composed: DictConfig
    world: int
    listed: list[Candidate] = field(default_factory=list)
    refused: list[tuple[list[str], str]] = field(default_factory=list)
    seen: set[tuple[Any, ...]] = field(default_factory=set)
    base: DictConfig | None = None  # the first valid candidate: the others share its typed sections

    def add(self, nodes: list[tuple[DictConfig, list[str]]]) -> None:
        micro, accum = int(self.composed.dataset.batch_size), int(self.composed.trainer.accumulate_grad_batches)
        for node, overrides in nodes:
            scale, cp = STRATEGIES[node.name].model_parallel(node, self.world), _cp(node)
            if scale > 1:  # the same global batch: fewer data-parallel ranks each take a larger batch
                overrides = [*overrides, f"dataset.batch_size={micro * scale}"]
            if cp > 1:  # ... and cp x fewer take cp x more micro batches: each holds seq_len / cp of them
                overrides = [*overrides, f"trainer.accumulate_grad_batches={accum * cp}"]
            try:
                valid = _validated(self.composed, self.base, node, micro * scale, accum * cp)
                self.base = self.base or valid
            except ConfigError as e:
                self.refused.append((overrides, str(e)))
                continue
            plan = make_plan(valid)
            key = tuple(plan.parallel[k] for k in MESH_KEYS)
            if STRATEGIES[node.name].degrees and key in self.seen:
                continue  # the same degrees as a layout listed above (fsdp, fsdp_tp, pp are presets of nd)
            self.seen.add(key)
            self.listed.append(_candidate(valid, plan, overrides))


def _cp(node: DictConfig) -> int:
    return int(node.get("cp", 1) or 1)


def _note_context(listed: list[Candidate]) -> None:
    """Each cp layout's note: activations / cp against the same mesh without cp (its dp_shard x cp
    ranks sharding alone: not ZeRO's, whose degrees read alike), and when that one does not fit and this
    one does, that cp is why."""
    plain = {tuple(c.plan.parallel[k] for k in MESH_KEYS): c for c in listed
             if c.cp == 1 and "cp" in c.cfg.strategy}  # the options with a cp: one FSDP2 mesh, one layout per key
    for c in (c for c in listed if c.cp > 1):
        p = c.plan.parallel
        twin = plain.get((p["dp_replicate"], p["dp_shard"] * c.cp, p["tp"], p["pp"], p["ep"], 1))
        ctx = c.plan.context_parallel or {}
        kind = "ring sends" if c.cp_style == "ring" else "all-to-all"
        c.note = (f"cp={c.cp}: activations / {c.cp}"
                  + (f" ({_gb(twin.plan.memory_per_device_bytes['activations'])} -> "
                     f"{_gb(c.plan.memory_per_device_bytes['activations'])} GB)" if twin else "")
                  + f", {_gb(ctx.get('bytes_per_step_per_device', 0.0))} GB {kind}/step")
        if twin is not None and c.fits and not twin.fits:
            c.note += f"; what makes it fit ({label_degrees(twin)} without cp does not)"


def label_degrees(c: Candidate) -> str:
    """A layout's degrees beyond 1 ("dp_shard=8", "dp_shard=2 tp=2 cp=2")."""
    degrees = {**c.degrees, "ep": c.ep, "cp": c.cp}
    return " ".join(f"{k}={v}" for k, v in degrees.items() if v != 1) or "one device"


def _gb(v: float) -> str:
    return f"{v / GB:,.1f}"


def _validated(composed: DictConfig, base: DictConfig | None, node: DictConfig, batch: int,
               accum: int) -> DictConfig:
    """`validate` of the composed config with `node` as its strategy, `batch` as its dataset.batch_size
    and `accum` as its trainer.accumulate_grad_batches (the sections other than the strategy typed
    once, in `base`)."""
    if base is None:
        cfg = composed.copy()
        cfg.strategy = node
        cfg.dataset.batch_size = batch
        cfg.trainer.accumulate_grad_batches = accum
        return validate(cfg)
    out = base.copy()
    out.dataset = base.dataset.copy()
    out.dataset.batch_size = batch
    out.trainer = base.trainer.copy()
    out.trainer.accumulate_grad_batches = accum
    return with_strategy(out, node)


def rank_key(c: Candidate) -> tuple[bool, float]:
    """Fits first, then the predicted step time (to 3 significant figures: closer is a tie)."""
    t = c.predicted_step_s if c.predicted_step_s is not None else float("inf")
    return (not c.fits, float(f"{t:.3g}"))


def _nodes(composed: DictConfig, world: int, context: list[int] | None = None) -> list[tuple[DictConfig, list[str]]]:
    """Each candidate's strategy node and the overrides that select it: every option with a yaml,
    in the registry's `rank` order, offers its own (its entry's `candidates`, strategies/variants.py;
    `context`: the cp degrees to offer beside them)."""
    have = set(group_options("strategy"))
    pipe = {k: composed.strategy[k] for k in PIPELINE_KEYS if k in composed.strategy}
    heads = gcd(attention_heads(composed) or 0, kv_heads(composed) or 0)
    machine = Machine(world, int(composed.hardware.devices), composed.hardware.accelerator == "gpu", pipe,
                      expert_count(composed), tuple(context or ()), heads, int(composed.dataset.get("seq_len") or 0))
    out: list[tuple[DictConfig, list[str]]] = []
    for name in (n for n in ranked() if n in have):
        for fields in STRATEGIES[name].candidates(machine):
            over = [f"strategy.{k}={_value(v)}" for k, v in fields.items() if v is not None]
            out.append((_merge(_yaml(name), **fields), [f"strategy={name}", *over]))
    return out


def _yaml(name: str) -> DictConfig:
    node = OmegaConf.load(conf_dir() / "strategy" / f"{name}.yaml")
    assert isinstance(node, DictConfig)
    return node


def _merge(node: DictConfig, **values: Any) -> DictConfig:
    return OmegaConf.merge(node, values)  # type: ignore[return-value]


def _value(v: Any) -> str:
    return "null" if v is None else str(v)


def _candidate(cfg: DictConfig, plan: Plan, overrides: list[str]) -> Candidate:
    compute, wire, exposed, bubble, step = predict(cfg, plan)
    return Candidate(
        strategy=plan.strategy, degrees={k: plan.parallel[k] for k in DEGREE_KEYS}, overrides=overrides,
        ep=int(plan.parallel.get("ep") or 1), cp=int(plan.parallel.get("cp") or 1),
        cp_style=plan.parallel.get("cp_style"),
        memory_per_device_bytes=plan.memory_per_device_bytes["total"],
        capacity_per_device_bytes=plan.capacity_per_device_bytes, fits=plan.fits,
        compute_s=compute, comm_s=wire.total, comm_exposed_s=exposed, bubble_fraction=bubble,
        predicted_step_s=step, cfg=cfg, plan=plan)


Prediction = tuple[float | None, Wire, float, float, float | None]


def predict(cfg: DictConfig, plan: Plan) -> Prediction:
    """(compute s, communication s by kind (bytes and calls), the exposed part of it s, bubble
    fraction, step s) of one step of `plan`."""
    hw = cfg.hardware
    rate, _ = compute_rate(hw, plan.peak_flops_per_device_bf16 or plan.peak_flops_per_device)
    rate *= (plan.float8 or {}).get("compute_speedup", 1.0)  # float8: its layers' share at the float8 peak
    share = _oversubscription(hw, plan.world_size)
    compute = None
    if plan.flops_per_step is not None:
        compute = plan.flops_per_step / plan.world_size * RECOMPUTE.get(plan.activation_checkpointing, 1.0) \
            / rate * share
    wire = _wire(plan, bandwidth(hw)[0] * GB, _latency(hw) * share)
    exposed = exposed_s(cfg, plan, wire, compute)
    bubble = float((plan.pipeline or {}).get("bubble_fraction", 0.0))
    # The cores left idle: with `share` ranks per core, a stage waiting in the bubble gives its
    # core to another rank, so the cores idle only when fewer runnable ranks than cores remain.
    idle = max(0.0, 1.0 - (1.0 - bubble) * share)
    step = None if compute is None else compute * (1 + idle / (1 - idle)) + exposed
    return compute, wire, exposed, bubble, step


def _wire(plan: Plan, bytes_per_s: float, latency: float) -> Wire:
    """Each kind of communication's seconds per step: its bytes over the bandwidth and its
    dimension's calls x `latency` (the data-parallel calls shared between gathers and
    reductions by their bytes)."""
    by, calls = plan.comm_bytes_by_collective, plan.comm_messages_per_step
    tp_b, pipe_b = plan.comm_bytes_by_dimension.get("tensor_parallel", 0.0), by.get("pipeline_send", 0.0)
    gather_b = by.get("all_gather", 0.0)
    reduce_b = by.get("reduce_scatter", 0.0) + by.get("all_reduce", 0.0) - tp_b
    dp_lat = calls.get("data_parallel", 0.0) * latency
    gather_lat = dp_lat * gather_b / (gather_b + reduce_b) if gather_b + reduce_b > 0 else 0.0
    host = 0.0
    if plan.strategy_config.get("offload_optimizer") and plan.params:  # grads down, updated params up, every step
        host = plan.params / plan.world_size * (plan.bytes_per_param["grads"] + plan.bytes_per_param["params"]) \
            / (PCIE_GBPS * GB)
    return Wire(gather=gather_b / bytes_per_s + gather_lat, reduce=reduce_b / bytes_per_s + dp_lat - gather_lat,
                # expert parallelism's all-to-alls block as tensor parallelism's all-reduces do (plan.experts)
                tensor=(tp_b + by.get("all_to_all", 0.0)) / bytes_per_s
                + (calls.get("tensor_parallel", 0.0) + calls.get("expert_parallel", 0.0)) * latency,
                pipeline=pipe_b / bytes_per_s + calls.get("pipeline", 0.0) * latency, host=host,
                context=plan.comm_bytes_by_dimension.get("context_parallel", 0.0) / bytes_per_s
                + calls.get("context_parallel", 0.0) * latency)


def _oversubscription(hw: DictConfig, world: int) -> float:
    """Ranks per core on CPU (>= 1): they share the cores, and a collective waits for every
    member to be scheduled; 1 on GPUs (a device per rank)."""
    if hw.accelerator != "cpu" or not hw.get("cpu_cores"):
        return 1.0
    return max(1.0, world / float(hw.cpu_cores))


def _latency(hw: DictConfig) -> float:
    if hw.accelerator == "cpu":
        return LATENCY_S["cpu"]
    return LATENCY_S["gpu_internode" if int(hw.num_nodes) > 1 else "gpu"]


def render_comparison(result: Comparison, hardware: str, model: str) -> None:
    """The candidates as a rich table, best first."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"loom plan --compare: model={model} on hardware={hardware}{_batch(result)}{_float8(result)}")
    notes = any(c.note for c in result.candidates)
    for col in ("#", "strategy", "repl x shard x tp x pp x ep x cp", "memory / device", "fits", "compute s",
                "comm s", "exposed s", "bubble", "step s (predicted)", "overrides", *(("note",) if notes else ())):
        t.add_column(col, justify="right" if col in ("#", "compute s", "comm s", "exposed s", "bubble") else "left")
    for i, c in enumerate(result.candidates, 1):
        cap = f" / {c.capacity_per_device_bytes / GB:,.1f}" if c.capacity_per_device_bytes else ""
        t.add_row(str(i), c.strategy, " x ".join(str(d) for d in (*c.degrees.values(), c.ep, c.cp)),
                  f"{c.memory_per_device_bytes / GB:,.2f}{cap} GB", "yes" if c.fits else "[red]no[/red]",
                  _secs(c.compute_s), _secs(c.comm_s), _secs(c.comm_exposed_s),
                  f"{c.bubble_fraction:.2f}" if c.bubble_fraction else "-",
                  _secs(c.predicted_step_s), " ".join(c.overrides), *((c.note,) if notes else ()))
    console = Console()
    console.width = max(console.width, 180)  # one line per layout, also when piped
    console.print(t)
    console.print(f"compute at {result.rate_source}; communication at {result.bandwidth_source}; exposed: "
                  "what FSDP2's prefetch and DDP's / ZeRO's bucketed reductions leave uncovered (all of it on CPU, "
                  f"tensor-parallel, pipeline and context-parallel communication always); {len(result.refused)} "
                  "layout(s) refused by validation are not listed. Context-parallel layouts (cp) are offered from "
                  f"dataset.seq_len >= {CP_MIN_SEQ_LEN}, or when no layout without cp fits; they keep the global batch "
                  "with cp x the accumulation.")


def _batch(result: Comparison) -> str:
    """What every layout trains per step (the same for all): the global batch and its sequence length."""
    if not result.candidates:
        return ""
    p = result.candidates[0].plan
    if p.items_per_sample > 1:
        return (f", global batch {p.global_batch} x {p.items_per_sample} tokens (dataset.seq_len)"
                f" = {p.tokens_per_step:,} tokens per step")
    return f", global batch {p.global_batch} per step"


def _float8(result: Comparison) -> str:
    """The run's own float8 setting, which every layout trains with (layouts float8 refuses are not listed)."""
    f8 = result.candidates[0].plan.float8 if result.candidates else None
    if not f8:
        return ""
    return f", float8={f8['recipe']}" + (" (emulated)" if f8["emulated"] else f" (x{f8['compute_speedup']:.2f} compute)")


def _secs(v: float | None) -> str:
    return "?" if v is None else f"{v:.3g}"
