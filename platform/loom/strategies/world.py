"""Elastic worlds (torch-free): which world sizes a run's layout can use, and the gradient
accumulation that keeps the run's global batch (`trainer.global_batch_size`) at each.

A run may resume at another world size (by hand, `hardware.devices=2`, or by torchrun forming a
smaller world under `hardware.min_nodes`). The global batch is the run's, not the world's: at
every world, accumulation = global batch / (micro batch x dp), with dp from the one layout
object (`layout_of` -> `ParallelLayout`). A world whose layout cannot be built, or whose dp
cannot keep the global batch with a whole accumulation, is refused naming the sizes that can.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig, open_dict

from loom.errors import ConfigError
from loom.layout import ParallelLayout, world_of

# Keys a resumed run may change (a world change), and what is derived from them. strategy.ep
# places the same experts on other ranks, strategy.cp splits the same sequences over other ranks
# (FSDP2's shards over dp x cp: the checkpoint's DTensors are resharded on load);
# hardware.interconnect names the links the node count implies (a CPU profile's loopback on one
# node, unknown across several: hardware.derive), which change nothing a step computes.
WORLD_KEYS = ("hardware.devices", "hardware.num_nodes", "hardware.min_nodes", "trainer.accumulate_grad_batches",
              "strategy.ep", "strategy.cp", "strategy.cp_style", "hardware.interconnect")
SUGGEST_UP_TO = 16  # world sizes named in a refusal: 1 .. max(this, 2 x the asked world)


def world_change_only(diff: list[str]) -> bool:
    """Whether a frozen-vs-command difference (freeze.config_diff lines) changes only the world."""
    return bool(diff) and all(line.split(":", 1)[0] in WORLD_KEYS for line in diff)


def at_world(cfg: DictConfig, world: int) -> DictConfig:
    """`cfg` with its hardware resized to `world` ranks: the nodes' devices kept on several nodes,
    one node of `world` devices otherwise."""
    out = copy.deepcopy(cfg)
    hw = out.hardware
    with open_dict(hw):
        if hw.num_nodes > 1 and world % hw.devices == 0:
            hw.num_nodes = world // hw.devices
        else:
            hw.devices, hw.num_nodes = world, 1
        hw.min_nodes = None if hw.get("min_nodes") is None else min(hw.min_nodes, hw.num_nodes)
    return out


def layout_problem(cfg: DictConfig, world: int) -> tuple[ParallelLayout | None, str | None]:
    """The run's layout at `world` ranks of `cfg.hardware.devices` per node, or why there is none."""
    from loom.strategies import layout_of

    try:
        layout = layout_of(cfg, world=world)
    except ConfigError as e:
        return None, str(e).removeprefix("Invalid config: ")
    split = layout.batch_sharers * layout.dp
    if split != world:
        return None, (f"strategy={cfg.strategy.name} splits {world} ranks as dp x cp x tp x pp = "
                      f"{layout.dp} x {layout.cp} x {layout.tp} x {layout.pp} = {split}")
    if layout.tp > 1 and cfg.hardware.devices % layout.tp:
        return None, (f"tensor parallelism {layout.tp} must divide the devices per node "
                      f"({cfg.hardware.devices}; tensor-parallel groups stay within a node)")
    return layout, None


def accumulation_at(cfg: DictConfig, world: int, global_batch: int) -> tuple[int | None, str | None]:
    """The accumulation that keeps `global_batch` at `world` ranks, or why no world of that size can."""
    layout, problem = layout_problem(cfg, world)
    if layout is None:
        return None, problem
    micro = int(cfg.dataset.batch_size)
    accum = layout.accumulation_for(global_batch, micro)
    if accum is None:
        return None, (f"its {layout.dp} data-parallel ranks x dataset.batch_size={micro} do not divide "
                      f"trainer.global_batch_size={global_batch}")
    return accum, None


def usable_worlds(cfg: DictConfig, global_batch: int, up_to: int) -> list[int]:
    """World sizes 1..up_to at which the run's layout builds and keeps `global_batch`."""
    return [w for w in range(1, up_to + 1) if accumulation_at(at_world(cfg, w), w, global_batch)[0] is not None]


def refusal(cfg: DictConfig, world: int, global_batch: int, problem: str, what: str) -> ConfigError:
    """Exit 2 for a world the run cannot use, naming the world sizes that can."""
    ok = usable_worlds(cfg, global_batch, max(SUGGEST_UP_TO, 2 * world))
    sizes = ", ".join(map(str, ok)) or "none up to " + str(max(SUGGEST_UP_TO, 2 * world))
    return ConfigError(
        f"Invalid config: {what} gives a world of {world} rank(s), which run {cfg.run.id or ''} cannot use: "
        f"{problem}. World sizes that keep strategy={cfg.strategy.name} and trainer.global_batch_size="
        f"{global_batch}: {sizes} (hardware.devices x hardware.num_nodes).")


def derive_accumulation(cfg: DictConfig, global_batch: int, world: int | None = None) -> int:
    """Set `trainer.global_batch_size` and the accumulation that keeps it at `world` (default: the
    profile's devices x nodes) in `cfg`, in place; ConfigError naming the usable sizes otherwise."""
    hw = cfg.hardware
    world = world_of(hw) if world is None else world
    accum, problem = accumulation_at(cfg, world, global_batch)
    if accum is None:
        what = f"hardware.devices={hw.devices} x hardware.num_nodes={hw.num_nodes}"
        raise refusal(cfg, world, global_batch, problem or "", what)
    with open_dict(cfg.trainer):
        cfg.trainer.global_batch_size = int(global_batch)
        cfg.trainer.accumulate_grad_batches = accum
    return accum


def check_elastic_range(cfg: DictConfig) -> None:
    """Under `hardware.min_nodes`, torchrun may form any world from min_nodes to num_nodes nodes:
    each must keep the global batch, or the run is refused before it starts."""
    hw = cfg.hardware
    low = hw.get("min_nodes")
    if low is None or low >= hw.num_nodes:
        return
    gbs = int(cfg.trainer.global_batch_size)
    for nodes in range(int(low), int(hw.num_nodes)):
        world = world_of(hw, nodes)
        accum, problem = accumulation_at(cfg, world, gbs)
        if accum is None:
            what = (f"hardware.min_nodes={low} lets torchrun form {nodes} node(s) x hardware.devices="
                    f"{hw.devices}, which")
            raise refusal(cfg, world, gbs, problem or "", what.removesuffix(", which"))
