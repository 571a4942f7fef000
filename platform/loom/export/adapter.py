"""A LoRA run's weights out: `--format peft`, the adapter directory peft itself saves, and
`--format hf`, the adapter merged into its base by peft.

A LoRA run's network names its parameters as peft does inside the model (`<path>.base_layer.weight`,
`<path>.lora_A.default.weight`); its checkpoints hold the adapter tensors alone and its final/ is
peft's adapter directory. The adapter's file holds the keys `PeftModel.save_pretrained` writes:
`base_model.model.<path>.lora_A.weight`, i.e. peft's `get_peft_model_state_dict` rule (keep the
`lora_` entries, drop the adapter name `.default`) under the PeftModel's own prefix. That rule is
applied here by hand, because building a PeftModel to call peft's function would load the base
model (gigabytes) to write an adapter (megabytes); the tests check the keys against peft's own save
and load the result with `PeftModel.from_pretrained`.

The merge is peft's own (`PeftModel.from_pretrained(base).merge_and_unload()`, then transformers'
`save_pretrained`) into the base's directory (model.init_from, or hf_causal_lm's model.config:
select.merge_base): the base is read whole by transformers, which this path accepts, so the merged
weights are exactly what peft users get, with no second implementation of LoRA's scaling rules
(alpha / r, rsLoRA, DoRA) to keep in step with peft's.

A reward model (`model.head=score`, loom.models.heads) trains its score head beside the adapters: the
adapter file holds it too (peft's modules_to_save key `base_model.model.score.weight`, task SEQ_CLS), and
the merge starts from the base read as `...ForSequenceClassification` (num_labels=1), whose fresh head
peft replaces with the run's.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from loom.errors import ConfigError
from loom.export.select import ADAPTER_CONFIG, Request, merge_base
from loom.export.sources import WeightsSource, open_source, unwrapped
from loom.models.heads import head_of
from loom.rundir.paths import RunDir

ADAPTER_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"  # the one adapter a Loom LoRA run trains


def peft_key(name: str) -> str:
    """The key PeftModel.save_pretrained writes for a tensor the network names `name`."""
    if name.startswith(PEFT_PREFIX):
        return name  # already peft's (final/'s adapter file)
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}", "")


def adapter_tensors(source: WeightsSource, cfg: DictConfig, dtype: torch.dtype, where: str
                    ) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of `source` under peft's saved keys, and a `model.head=score` head's (peft's
    modules_to_save), floating ones cast to `dtype`."""
    out, head = {}, head_of(cfg.model)
    for raw in source.entries():
        name = unwrapped(raw).removeprefix(source.prefix)
        if "lora_" in name or head.owns(name):  # a score head trains beside the adapters (loom.models.heads)
            t = source.get(raw)
            out[peft_key(name)] = t.to(dtype) if t.is_floating_point() else t
    if not out:
        raise ConfigError(f"Invalid usage: loom export: {where} holds no LoRA tensor (no name with lora_A / "
                          "lora_B): it is not a LoRA run's adapter.")
    return out


def _source_path(path: Path) -> Path:
    """final/ as a peft dir reads through its adapter file; other sources as they are."""
    return path / ADAPTER_FILE if (path / ADAPTER_CONFIG).is_file() else path


def adapter_config(req: Request, keys: list[str]) -> dict:
    """The run's own adapter_config.json (final/'s), else peft's LoraConfig of model.lora, its
    target modules the ones the adapter holds tensors for."""
    own = RunDir(req.run_dir).final / ADAPTER_CONFIG
    if own.is_file():
        return json.loads(own.read_text())
    from peft import LoraConfig

    lora, head = OmegaConf.to_container(req.cfg.model.lora, resolve=True), head_of(req.cfg.model)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys if ".lora_" in k})
    config = LoraConfig(r=int(lora["r"]), lora_alpha=lora.get("alpha") or int(lora["r"]),
                        lora_dropout=float(lora.get("dropout") or 0.0), target_modules=targets,
                        base_model_name_or_path=_base_name(req.cfg), task_type=head.task_type,
                        modules_to_save=list(head.own) or None)
    return config.to_dict()


@contextlib.contextmanager
def _quiet(on: bool) -> Iterator[None]:
    """transformers' 'newly initialized: score.weight' notice silenced where the run's head replaces it."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if on:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _base_name(cfg) -> str | None:
    """What adapter_config.json names as the base: model.init_from, else model.config (training's rule)."""
    base = cfg.model.get("init_from") or cfg.model.get("config")
    return str(base) if base else None


def _jsonable(config: dict) -> dict:
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def write_adapter(req: Request, out: Path, dtype: torch.dtype) -> list[Path]:
    """adapter_model.safetensors and adapter_config.json of `req`'s source into `out`."""
    from safetensors.torch import save_file

    source = open_source(_source_path(req.source.path))
    try:
        tensors = adapter_tensors(source, req.cfg, dtype, req.source.describe(req.run_dir))
    finally:
        source.close()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    config = _jsonable(adapter_config(req, list(tensors)))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [out / ADAPTER_CONFIG, out / ADAPTER_FILE]


def write_merged(req: Request, dtype: torch.dtype) -> list[Path]:
    """The base (model.init_from) with the adapter merged in, by peft, saved by transformers
    into `req.out`, with the run's tokenizer files beside as the hf export writes them."""
    import transformers
    from peft import PeftModel
    from transformers.utils import logging as hf_logging

    from loom.models import hf_export_config
    from loom.rundir.hf_export import INDEX, SINGLE, copy_tokenizer

    hf_logging.disable_progress_bar()  # loading and writing shards: the verb prints its own lines
    head = head_of(req.cfg.model)
    with tempfile.TemporaryDirectory(prefix="loom-adapter-") as tmp, warnings.catch_warnings():
        # peft asks transformers' deprecated is_gradient_checkpointing: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        write_adapter(req, Path(tmp), torch.float32)  # merged in fp32, cast after
        auto, own = getattr(transformers, head.auto_class), dict(head.config)  # a score head: num_labels=1
        with _quiet(bool(head.own)):  # the base holds no score head: peft loads the run's over the fresh one
            base = auto.from_pretrained(str(merge_base(req.cfg)[0]), dtype=torch.float32, **own)
        merged = PeftModel.from_pretrained(base, tmp).merge_and_unload()
    if head.own:  # what the hf export's config.json says of the head (pad_token_id for transformers' pooling)
        merged.config.pad_token_id = hf_export_config(req.cfg).get("pad_token_id")
    for stale in [*req.out.glob("model-*-of-*.safetensors"), req.out / INDEX, req.out / SINGLE]:
        stale.unlink(missing_ok=True)  # a re-export: no shard of the last one may stay
    merged.to(dtype).save_pretrained(req.out, max_shard_size=int(float(req.cfg.checkpoint.export_shard_gb) * 1e9))
    copy_tokenizer(req.out, req.cfg.dataset.get("tokenizer"))
    return sorted(p for p in req.out.iterdir() if p.is_file())

