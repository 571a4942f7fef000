"""config.yaml: the resolved config as frozen once in a run dir, and how ranks read it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from loom.redaction import redact, restore_env_refs, split_env_refs


def frozen_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as config.yaml holds it: secret-keyed `${oc.env:NAME}` references
    stay unresolved (each process reads its own environment; no file holds the secret), and
    any other secret-looking value is redacted."""
    masked, refs = split_env_refs(OmegaConf.to_container(cfg, resolve=False))
    resolved = OmegaConf.to_container(OmegaConf.create(masked), resolve=True)
    return redact(restore_env_refs(resolved, refs))


def frozen_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(frozen_container(cfg)))


def load_frozen(path: Path) -> DictConfig:
    """Read a run's frozen config.yaml (no Hydra, no validation: it was validated once)."""
    return OmegaConf.load(path)
