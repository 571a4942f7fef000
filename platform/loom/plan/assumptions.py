"""Where the plan's batch facts came from (plan.json `assumptions`, the header of `loom plan`).

A plan's memory and step time scale with the sequence length and the batch, and a user who
never typed them is planning at someone else's numbers (llama3_8b at the dataset's seq_len 128).
So each of `seq_len`, `micro_batch`, `accumulate_grad_batches` and `global_batch` is recorded
with its value and its source, in the order Hydra applies them (the last one set wins):

    override          the command line set the key (a sweep's trial overrides count)
    recipe            recipe=NAME's file sets it
    dataset default   conf/dataset/<name>.yaml (or a recipe's `override /dataset:`) sets it
    default           conf/train.yaml or the section's schema
    derived           computed: the accumulation from trainer.global_batch_size, the global
                      batch as micro x accumulation x data-parallel ranks
    auto              strategy=auto scaled the micro batch by the layout's tp x pp

Only the overrides name the user's keys: the validated config alone cannot tell an override from
a default that happens to be equal, so `pipeline.plan_run` passes them in. Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom import strategies
from loom.compose import conf_dir, recipes

# plan.json key -> the config key it reads
KEYS = {"seq_len": "dataset.seq_len", "micro_batch": "dataset.batch_size",
        "accumulate_grad_batches": "trainer.accumulate_grad_batches",
        "global_batch_size": "trainer.global_batch_size"}


def set_by(overrides: list[str], key: str) -> tuple[str, str] | None:
    """("override", the text) when the command line sets `key` (the last one wins), ("recipe",
    its name) when the chosen recipe's file does, else None (a group file or a default)."""
    given = [o for o in overrides if o.lstrip("+").partition("=")[0] == key]
    if given:
        return "override", given[-1].lstrip("+")
    name, path = _recipe(overrides)
    if path is not None and OmegaConf.select(OmegaConf.load(path), key) is not None:
        return "recipe", str(name)
    return None


def _recipe(overrides: list[str]) -> tuple[str | None, Path | None]:
    _, dirs = recipes.split_searchpath([o for o in overrides if o.lstrip("+").startswith(recipes.SEARCHPATH_KEY)])
    found = recipes.discover(dirs)
    name = recipes.chosen(overrides, found)
    return (name, found[name].path) if name else (None, None)


def _source(cfg: DictConfig, overrides: list[str], key: str) -> dict[str, Any]:
    """{value, key, source, detail} of one config key (see the module doc for the sources)."""
    value = OmegaConf.select(cfg, key)
    entry: dict[str, Any] = {"value": value, "key": key}
    by = set_by(overrides, key)
    if by is not None:
        kind, what = by
        return {**entry, "source": kind, "detail": what if kind == "override" else f"recipe={what}"}
    group, _, leaf = key.partition(".")
    if group == "dataset":
        path = conf_dir() / "dataset" / f"{cfg.dataset.name}.yaml"
        if path.is_file() and OmegaConf.select(OmegaConf.load(path), leaf) is not None:
            return {**entry, "source": "dataset default", "detail": f"conf/dataset/{path.name}"}
        return {**entry, "source": "default", "detail": f"the dataset={cfg.dataset.name} schema"}
    return {**entry, "source": "default", "detail": "conf/train.yaml"}


def assumptions(cfg: DictConfig, overrides: list[str], auto_choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """plan.json `assumptions`: {seq_len, micro_batch, accumulate_grad_batches, global_batch}, each
    {value, key, source, detail}."""
    layout = strategies.layout_of(cfg)
    out = {name: _source(cfg, overrides, key) for name, key in KEYS.items() if name != "global_batch_size"}
    if cfg.dataset.get("seq_len") is None:
        out["seq_len"] = {"value": None, "key": "dataset.seq_len", "source": "none",
                          "detail": f"dataset={cfg.dataset.name} has no sequences"}
    micro, accum = int(cfg.dataset.batch_size), int(cfg.trainer.accumulate_grad_batches)
    scale = _auto_scale(auto_choice)
    if scale > 1:  # the user's (or the default) micro batch, then auto's multiple of it
        own = _source(cfg, overrides, "dataset.batch_size")
        out["micro_batch"] = {**own, "value": micro, "source": "auto",
                              "detail": f"strategy=auto's layout: {micro // scale} ({_phrase(own)}) x {scale} "
                                        "(tp x pp), the same global batch on fewer data-parallel ranks"}
    global_batch = layout.global_batch(micro, accum)
    gbs = cfg.trainer.get("global_batch_size")
    if gbs is not None:
        own = _source(cfg, overrides, "trainer.global_batch_size")
        out["global_batch"] = {**own, "value": global_batch}
        if set_by(overrides, "trainer.accumulate_grad_batches") is None:
            out["accumulate_grad_batches"].update(
                source="derived", detail=f"derived from trainer.global_batch_size, {gbs} / (micro {micro} x dp {layout.dp})")
    else:
        out["global_batch"] = {"value": global_batch, "key": "trainer.global_batch_size", "source": "derived",
                               "detail": "derived, trainer.global_batch_size unset"}
    return out


def _auto_scale(choice: dict[str, Any] | None) -> int:
    """tp x pp of strategy=auto's layout (its micro batch is that multiple of the user's)."""
    if not choice:
        return 1
    degrees = choice.get("degrees") or {}
    return int(degrees.get("tp", 1)) * int(degrees.get("pp", 1))


def _phrase(entry: dict[str, Any]) -> str:
    """A source in words: "your override dataset.batch_size=8", "recipe=gpt-pretrain",
    "dataset default, conf/dataset/tinycode.yaml", "default, conf/train.yaml", a derivation."""
    source, detail = entry.get("source"), entry.get("detail", "")
    if source == "override":
        return f"your override {detail}"
    if source in ("derived", "auto", "none", "recipe"):
        return str(detail)
    return f"{source}, {detail}" if detail else str(source)


def phrase(entry: dict[str, Any] | None) -> str:
    """The header's words for one `assumptions` entry (empty for a plan.json without them)."""
    return _phrase(entry) if entry else ""
