"""The reference model of a preference objective, chosen cheaply (issue 53).

DPO and IPO score the policy against a fixed reference: the weights training started from. A
second full model beside the policy doubles the memory and a forward per step, so Loom offers
three ways to have it, `objective.reference`:

- `adapters` (what `auto` and `online` mean under LoRA): the base with the adapters switched off is the
  reference (peft's `disable_adapter`, without a second copy: loom.models.lora.adapters_off).
- `precompute` (what `auto` means otherwise): before the first step the policy, still equal to the
  reference, scores every pair of the train and validation splits once (a forward, no backward); the
  log-probabilities are stored beside the rendered data, keyed by the reference's fingerprint
  (model config, its init_from file's, the seed and precision) and the data's (`PreferenceSamples.fit_key`),
  and read back by every later run and resume. Training then runs the policy alone.
- `online`: a frozen copy of the starting weights, built and sharded like the policy (FSDP2 shards it
  the same way; DDP and ZeRO-1/2 keep a whole copy per rank, as they keep the policy); one more forward per
  step, nothing stored. Refused under ZeRO-3 (a copy outside DeepSpeed's engine would not be partitioned).

Which way a run takes is `loom.objectives.reference_of` (torch-free, asked by the checks and the plan).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.objectives.registry import option_of

FILE = "reference-{model}-{data}.npy"    # beside the rendered split: (pairs, 2) float32 (chosen, rejected)


def reference_of(cfg: DictConfig) -> str | None:
    """Where the run's reference log-probs come from: "adapters" (the base with LoRA's adapters
    disabled), "precompute" or "online"; None for an objective without a reference."""
    option = option_of(cfg)
    if not option.reference:
        return None
    from loom.models.lora_checks import lora_on

    ref = str(cfg.objective.reference)
    if lora_on(cfg.get("model")):  # the base without its adapters is the online reference, at no cost
        return "precompute" if ref == "precompute" else "adapters"
    return "precompute" if ref == "auto" else ref


def model_key(cfg: DictConfig) -> str:
    """The reference's fingerprint: what decides its log-probabilities (the model's config with its
    init_from file's fingerprint, less LoRA: the reference is the base; the seed of a fresh init; the
    precision its forward runs in)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.pop("lora", None)
    what = {"model": model, "seed": int(cfg.seed), "precision": str(cfg.hardware.precision)}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reference_path(samples: Any, cfg: DictConfig) -> Path:
    """Where a split's precomputed reference log-probabilities live (beside its rendered data)."""
    return Path(samples.split_dir) / FILE.format(model=model_key(cfg), data=samples.fit_key)
