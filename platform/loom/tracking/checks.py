"""Launcher-side checks of the tracking config: refuse in the first second, not after start-up.

No torch and no wandb import here (importing wandb alone takes about half a second): the
API key is looked up the way wandb looks it up, in `WANDB_API_KEY` and then in the netrc
entry for the wandb host.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.tracking.schema import MODES

DEFAULT_BASE_URL = "https://api.wandb.ai"


def wandb_host() -> str:
    return urlparse(os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).hostname or "api.wandb.ai"


def _netrc_path() -> Path:
    return Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()


def has_wandb_key() -> bool:
    """A key in WANDB_API_KEY, or a netrc entry (what `wandb login` writes) for the wandb host."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    path = _netrc_path()
    if not path.is_file():
        return False
    try:
        auth = netrc.netrc(str(path)).authenticators(wandb_host())
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def tracking_checks(cfg: DictConfig) -> None:
    """Raise ConfigError (exit 2) for a tracking config that cannot work on this machine."""
    tr = cfg.tracking
    warmup = tr.get("warmup_steps")
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise ConfigError(
            f"Invalid config: tracking.warmup_steps={warmup!r}; valid choices: null (the steady-state "
            "throughput starts after the first logged window) or a number of steps >= 0."
        )
    mode = tr.mode
    if mode not in MODES:
        raise ConfigError(
            f"Invalid config: tracking.mode={mode!r} is not a wandb mode; valid choices: {', '.join(MODES)}."
        )
    if tr.wandb and mode == "online" and not has_wandb_key():
        raise ConfigError(
            f"Invalid config: tracking={tr.name} logs to wandb online (tracking.mode=online) but no wandb "
            f"API key was found (WANDB_API_KEY is unset and {_netrc_path()} has no entry for {wandb_host()}). "
            "Set WANDB_API_KEY (or run `wandb login`), or use tracking=offline to log offline "
            "(`wandb sync <run>/wandb/offline-run-*` uploads it later)."
        )
