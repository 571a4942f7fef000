"""LoRA adapters with peft (`model.lora.r` > 0): the worker's half (the launcher's is lora_checks).

The contract other parts build on (`loom export --format peft|hf`, `loom generate`):

- **Applying.** `apply` runs in `construct.parallelized` right after the network is built (on the
  meta device, or under ZeRO-3 outside `zero.Init`) and before activation checkpointing, compile and
  the strategy's `parallelize` (FSDP2's `fully_shard` sees the adapters): peft's
  `inject_adapter_in_model(LoraConfig, model, adapter_name="default")` wraps every targeted Linear,
  then every parameter but the adapters' is frozen (`requires_grad=False`), so the optimizer
  (`optim.build`) holds the adapters alone.
- **Names.** A wrapped Linear's weight is `<path>.base_layer.weight`; its adapters are
  `<path>.lora_A.default.weight` (r x in) and `<path>.lora_B.default.weight` (out x r).
- **Initialization, by name** (`LoraInit`): a base parameter is its name without `.base_layer.`
  (a fresh init's rule, or model.init_from's tensor, e.g. `model.layers.0.self_attn.q_proj.weight`);
  lora_A is peft's default (kaiming-uniform, a=sqrt(5): uniform(+-1/sqrt(in))) drawn from generators
  seeded by the run seed and its name, so every strategy and rank starts from the same adapters;
  lora_B is zero, so step 0's output is the base model's.
- **Checkpoints** hold the adapter alone: the trainable parameters (LightningModule names,
  `model.<path>.lora_{A,B}.default.weight`), their optimizer state and the loop state. The base is
  rebuilt on resume as at the start (model.init_from is read again, or the seeded init). Loading is
  strict for the adapter keys (`check_keys`), non-strict for the frozen base.
- **Final weights**: `final/` is a peft adapter directory, summary.json `final_weights: "final/"`:
  `adapter_model.safetensors` with exactly the keys `peft.get_peft_model_state_dict` gives for a
  `PeftModel` wrapping the transformers model (`base_model.model.<path>.lora_A.weight`; Loom's Llama
  uses transformers' names, hf_causal_lm is the transformers model), in `checkpoint.export_dtype`;
  `adapter_config.json` (LoraConfig.save_pretrained: task_type CAUSAL_LM, base_model_name_or_path =
  model.init_from, else model.config, else null for a base Loom initialized from the seed); and the
  tokenizer's files when the run used one. `PeftModel.from_pretrained(base, final/)` loads it.
- **A score head** (`model.head=score`, loom.models.heads) trains beside the adapters: its parameters
  keep requires_grad, so checkpoints hold them (trainable_keys), and final/ holds them under peft's
  modules_to_save keys (`base_model.model.score.weight`; task_type SEQ_CLS), which
  `PeftModel.from_pretrained(AutoModelForSequenceClassification...(base, num_labels=1), final/)` loads.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from loom.models.activation_checkpointing import clean_name
from loom.models.heads import head_of
from loom.models.init import CHUNK, NamedInit, param_seed

ADAPTER = "default"  # peft's adapter name
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # a PeftModel's prefix before the wrapped model's names
_PARTS = ("lora_A", "lora_B")


def peft_config(m: DictConfig) -> Any:
    """peft's LoraConfig of `model.lora` (its base: model.init_from, else model.config); a
    `model.head=score` head is saved whole beside the adapters (peft's modules_to_save, task SEQ_CLS)."""
    from peft import LoraConfig

    lora, head = m.lora, head_of(m)
    base = m.get("init_from") or m.get("config")
    return LoraConfig(r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                      target_modules=list(OmegaConf.to_container(lora.target_modules)), bias="none",
                      task_type=head.task_type, modules_to_save=list(head.own) or None,
                      base_model_name_or_path=str(base) if base else None)


def is_adapter(name: str) -> bool:
    return any(f".{part}." in name for part in _PARTS)


def base_name(name: str) -> str:
    """A wrapped Linear's base parameter under the name the plain model gives it."""
    return name.replace(".base_layer.", ".")


def adapter_only(module: Any) -> bool:
    """Whether `module` (the LightningModule) trains LoRA adapters: its checkpoints hold them alone."""
    return getattr(module, "lora_config", None) is not None


def apply(module: Any, model: nn.Module, on_meta: bool) -> None:
    """Wrap the targeted Linears of `model` with peft's LoRA layers and freeze the rest but a
    `model.head=score` head, which trains beside them (see the module docstring). Adapters built for real (not on meta) are initialized here, by name."""
    from peft import inject_adapter_in_model

    config = peft_config(module.cfg.model)
    injected = copy.copy(config)
    injected.modules_to_save = None  # peft would wrap the head (score.modules_to_save.default...): kept by name
    inject_adapter_in_model(injected, model, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    head = head_of(module.cfg.model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or head.owns(name))
    module.lora_config = config
    module.strict_loading = False  # the base is not in the checkpoint; `check_keys` is strict for the adapters
    if not on_meta:
        init = LoraInit(None, int(module.cfg.seed))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_adapter(name):
                    init.fill_flat(p.view(-1), clean_name(name), tuple(p.shape), 0)


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """The modules peft injected adapters into (what `adapters_off` switches)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_off(layers: list[nn.Module]) -> Iterator[None]:
    """The base model alone (a preference objective's reference under LoRA: no second copy), as
    peft's `PeftModel.disable_adapter()` gives it, on injected adapters (`tuner_layers`). The layers'
    `_disable_adapters` flag is set directly: peft's `enable_adapters(False)` also flips the adapters'
    requires_grad, which FSDP2's sharded parameters must not see change in the middle of a step."""
    saved = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, saved, strict=True):
            m._disable_adapters = was


def wrap_init(init: NamedInit | None, seed: int) -> NamedInit | None:
    """The model's initializer, seeing peft's names (None stays None: the model keeps its values)."""
    return None if init is None else LoraInit(init, seed)


class LoraInit(NamedInit):
    """Base parameters from `base` under their plain names; lora_A uniform(+-1/sqrt(in)) (peft's
    kaiming_uniform_(a=sqrt(5))) drawn by name in CHUNK-element pieces as NamedInit draws its
    normals (a rank draws only the rows it holds); lora_B zeros. Written by hand because peft's own
    `reset_lora_parameters` draws from the global RNG, which meta construction and sharding change."""

    def __init__(self, base: NamedInit | None, seed: int) -> None:
        super().__init__(seed, lambda name, shape: ("zeros", 0.0))
        self.base = base
        if base is not None:
            self.zero_rows = base.zero_rows

    def fill_flat(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int) -> None:
        if ".lora_B." in name:
            dest.zero_()
        elif ".lora_A." in name:
            self._uniform(dest, name, shape, start, 1.0 / math.sqrt(shape[-1]))
        elif self.base is None:
            raise KeyError(f"{name}: not an adapter, and no initializer for the base")
        else:
            self.base.fill_flat(dest, base_name(name), shape, start)

    def full_value(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if is_adapter(name) or self.base is None:
            return super().full_value(name, shape, device)
        return self.base.full_value(base_name(name), shape, device)

    def _uniform(self, dest: torch.Tensor, name: str, shape: tuple[int, ...], start: int, bound: float) -> None:
        end, total = start + dest.numel(), math.prod(shape)
        for k in range(start // CHUNK, (end - 1) // CHUNK + 1 if end > start else 0):
            lo, hi = k * CHUNK, min((k + 1) * CHUNK, total)
            gen = torch.Generator().manual_seed(param_seed(self.seed, f"{name}#{k}"))
            chunk = torch.empty(hi - lo, device="cpu").uniform_(-bound, bound, generator=gen)
            a, b = max(start, lo), min(end, hi)
            dest[a - start:b - start].copy_(chunk[a - lo:b - lo])


# ---------------------------------------------------------------------- checkpoints
def trainable_keys(module: nn.Module) -> list[str]:
    """The state-dict keys of `module`'s trainable parameters (wrapper segments removed)."""
    return [clean_name(n) for n, p in module.named_parameters() if p.requires_grad]


def adapter_state(module: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (the module's state dict) cut to the adapters when `module` trains LoRA."""
    if not adapter_only(module):
        return state
    keep = set(trainable_keys(module))
    return {k: v for k, v in state.items() if k in keep}


def check_keys(found: Iterable[str], expected: Iterable[str], where: str) -> None:
    """Strict loading of the adapter: the checkpoint holds exactly the trainable parameters."""
    found, expected = set(found), set(expected)
    if found == expected:
        return
    missing, extra = sorted(expected - found), sorted(found - expected)
    raise RuntimeError(
        f"{where} does not hold this run's LoRA adapter: {len(missing)} adapter tensor(s) missing "
        f"({', '.join(missing[:4]) or 'none'}), {len(extra)} unexpected ({', '.join(extra[:4]) or 'none'}). "
        "A LoRA checkpoint holds the trainable adapter parameters alone; resume it with the same model.lora.")


# ---------------------------------------------------------------------- final weights
def peft_key(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A.default.weight` (module.model's name) ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (get_peft_model_state_dict's)."""
    name = clean_name(name)
    for part in _PARTS:
        name = name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return PEFT_PREFIX + name


def export_adapter(out: Path, cfg: DictConfig, trainer: Any, module: Any, rank: int) -> str:
    """final/ as a peft adapter directory (module docstring), gathered one tensor at a time on every
    rank (a collective under sharding) and written by rank 0. Returns summary.json's final_weights."""
    from loom.rundir.hf_export import copy_tokenizer
    from loom.rundir.safetensors_stream import EXPORT_DTYPES, SafetensorsStream, dtype_name

    strategy = trainer.strategy
    dtype = getattr(torch, EXPORT_DTYPES[cfg.checkpoint.export_dtype])
    head = head_of(cfg.model)  # a score head trains beside the adapters: final/ holds it (peft's modules_to_save)
    entries = [(k, t) for k, t in strategy.model_state_entries(trainer, module) if is_adapter(k) or head.owns(k)]
    specs = [(peft_key(k), strategy.full_shape(t), dtype_name(dtype)) for k, t in entries]
    tensors = ((peft_key(k), strategy.gather_full_tensor(trainer, t)) for k, t in entries)
    if rank != 0:
        for _ in tensors:  # take part in every gather
            pass
        return "final/"
    from loom.atomic import atomic_path

    out.mkdir(parents=True, exist_ok=True)
    meta = {"run_id": str(cfg.run.id), "model": str(cfg.model.name), "step": str(trainer.global_step),
            "dtype": str(cfg.checkpoint.export_dtype), "format": "pt"}
    with atomic_path(out / ADAPTER_FILE) as tmp, SafetensorsStream(tmp, specs, meta) as writer:
        for key, t in tensors:
            writer.write(key, t.to(dtype))
    module.lora_config.save_pretrained(str(out))
    copy_tokenizer(out, cfg.dataset.get("tokenizer"))
    return "final/"
