"""Where the config groups live."""

from __future__ import annotations

import os
from pathlib import Path


def conf_dir() -> Path:
    """The primary config directory: `$LOOM_CONF_DIR`, else `conf/` of this checkout."""
    env = os.environ.get("LOOM_CONF_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "conf"


def group_options(group: str) -> list[str]:
    """The yaml files of one config group, i.e. the valid `group=option` choices."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
