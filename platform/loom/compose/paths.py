"""Where the config groups live (`LOOM_CONF_DIR`, else Loom's bundled `conf`; loom.bundle says
where the bundled files are for each way of installing Loom)."""

from __future__ import annotations

import os
from pathlib import Path

from loom.bundle import bundled


def conf_dir() -> Path:
    """The primary config directory: `$LOOM_CONF_DIR`, else Loom's bundled `conf`."""
    env = os.environ.get("LOOM_CONF_DIR")
    return Path(env) if env else bundled("conf")


def group_options(group: str) -> list[str]:
    """The yaml files of one config group, i.e. the valid `group=option` choices."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
