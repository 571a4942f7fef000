"""The report.md lines about the data: the loader's share of step time (summary.json `data_wait`)
and, for a mixture, one row per source with its weight, the samples and tokens it gave and its
validation loss (summary.json `data` and `validation.per_source`, loom.tracking.sources). No
torch here."""

from __future__ import annotations

from typing import Any

from loom.report.slow import _md_table


def data_wait_text(data_wait: dict[str, Any] | None) -> str:
    """summary.json `data_wait` in words: the largest window's share, and the warning if one was said."""
    if not data_wait or data_wait.get("max_window_pct") is None:
        return "n/a (no log window after the first)"
    text = (f"{data_wait['max_window_pct']:.1f}% of step time at most "
            f"(the log window ending at step {data_wait.get('max_window_step')})")
    if data_wait.get("warned_at_step") is not None:
        text += (f"; over {data_wait.get('threshold_pct', 5.0):g}% at step {data_wait['warned_at_step']} "
                 f"(likely cause: {data_wait.get('cause')})")
    return text


def _num(v: Any, spec: str) -> str:
    try:
        return "n/a" if v is None else f"{v:{spec}}"
    except (TypeError, ValueError):
        return str(v)


def sources_section(summary: dict[str, Any]) -> list[str]:
    """Markdown lines: the sources table ([] when the run had neither a source report nor
    per-source validation losses). Sources in the datamodule's order, then any only validated."""
    per_source = (summary.get("validation") or {}).get("per_source") or {}
    sources = (summary.get("data") or {}).get("sources") or {}
    names = list(dict.fromkeys([*sources, *per_source]))
    if not names:
        return []
    header = ["source", *(["weight", "samples", "tokens", "epochs"] if sources else []),
              *(["val loss"] if per_source else [])]
    rows = []
    for name in names:
        s = sources.get(name) or {}
        row = [name]
        if sources:
            row += [_num(s.get("weight"), ".3f"), _num(s.get("samples"), ",d"), _num(s.get("tokens"), ",d"),
                    _num(s.get("epochs"), ".3f")]
        if per_source:
            row.append(_num(per_source.get(name), ".4f"))
        rows.append(row)
    step = (summary.get("validation") or {}).get("step")
    said = ["samples and tokens trained from each source"] if sources else []
    said += [f"validation loss at step {step}" if step is not None else "validation loss"] if per_source else []
    return ["## Data sources", "", f"Per source: {' and '.join(said)}.", "", *_md_table(header, rows), ""]
