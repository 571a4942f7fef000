"""The schema of the tracking options (conf/tracking/): one shape for all of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrackingConfig:
    name: str = "offline"
    wandb: bool = True
    csv: bool = True
    mode: str = "offline"             # wandb mode: offline | online (needs an API key) | disabled
    project: str = "loom"
    entity: str | None = None
    # steps before the steady-state window of summary.json `throughput` (null: the first
    # logged window; any window with a compile in it is left out too: loom.tracking.clock)
    warmup_steps: int | None = None


SCHEMAS: dict[str, type] = {"*": TrackingConfig}
MODES = ("offline", "online", "disabled")
