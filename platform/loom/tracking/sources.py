"""summary.json's view of a data mixture (issue 37): the validation loss of each source and the
samples and tokens each source gave.

The LightningModule logs `val/loss/<source>` beside the overall `val/loss` when validation has
several sources; metrics.csv and the trackers keep those names as they are, while summary.json
gathers them under `validation.per_source` {name: loss}, so a reader (and `loom report`) finds
the sources without parsing metric names. A datamodule that knows its mixture has a
`source_report()` method (None, or {"sources": {name: {weight, samples, tokens, epochs}}} for the
samples consumed so far): its answer at the end of the run is summary.json `data`. Other
datamodules have no such method, and their summaries no `data`. No torch here.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("loom")

PER_SOURCE_PREFIX = "loss/"  # `val/loss/<name>`, as the recorder keeps it without its `val/`


def validation_field(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """summary.json `validation` from the last validation's val/* metrics (`val/` dropped):
    the per-source losses moved under `per_source` (only when there are some)."""
    if not metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if not k.startswith(PER_SOURCE_PREFIX)}
    per_source = {k[len(PER_SOURCE_PREFIX):]: v for k, v in metrics.items() if k.startswith(PER_SOURCE_PREFIX)}
    if per_source:
        out["per_source"] = per_source
    return out


def _plain(x: Any) -> Any:
    """JSON's own types: a numpy or torch scalar as a number, NaN/inf as null, tuples as lists
    (a datamodule's counters may be numpy's, which json cannot write: the summary would be lost)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def data_field(trainer: Any) -> dict[str, Any] | None:
    """summary.json `data`: the datamodule's `source_report()` now, or None (no such method, it
    returned None, or it failed: the summary is written all the same, with one warning)."""
    report = getattr(getattr(trainer, "datamodule", None), "source_report", None)
    if not callable(report):
        return None
    try:
        found = report()
    except Exception as e:  # a report of the sources must never cost the run its summary
        log.warning(f"summary.json data not recorded: source_report() failed ({type(e).__name__}: {e})")
        return None
    return _plain(found) if found is not None else None
