"""What `loom export` reads and where it writes, decided torch-free: a wrong run dir, format,
step or output is refused (exit 2, one paragraph) before torch is imported.

The weights come from the run's final weights (`final/`, as training wrote them: Loom's
`model.safetensors`, a Hugging Face dir, or a LoRA run's peft adapter dir) or from one checkpoint (`checkpoints/step-N.ckpt`,
any strategy's: loom.export.sources reads each kind). Without `--step`: a completed run's final
weights, else the newest complete checkpoint. `--step N`: the checkpoint of step N (the final
weights when N is the final step and no checkpoint of it was kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from loom.errors import ConfigError
from loom.models.registry import FAMILIES, MODELS
from loom.rundir import checkpoints
from loom.rundir.config_file import load_frozen
from loom.rundir.paths import RunDir
from loom.rundir.safetensors_stream import EXPORT_DTYPES
from loom.rundir.summary import read_summary

FORMATS = {"hf": "the Hugging Face directory from_pretrained loads (config.json, safetensors shards + index, "
                 "the tokenizer); a LoRA run's adapter merged into its base",
           "peft": "a LoRA run's adapter alone, the directory PeftModel.from_pretrained loads "
                   "(adapter_model.safetensors, adapter_config.json)",
           "loom": "Loom's own layout, model.safetensors as in a run's final/"}
# What an export leaves last in its directory: what it holds (format, source, step, dtype), so a
# later `loom generate` reuses it instead of exporting again.
MARKER = "loom-export.json"
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a LoRA run's final/ holds it


@dataclass(frozen=True)
class Source:
    """The weights one export reads: the run's final weights or one checkpoint."""

    kind: str  # "final" | "checkpoint"
    path: Path  # final/model.safetensors, final/ (a Hugging Face dir) or checkpoints/step-N.ckpt
    step: int

    def describe(self, run_dir: Path) -> str:
        return f"{self.path.relative_to(run_dir)} (step {self.step})"


@dataclass(frozen=True)
class Request:
    """One `loom export`, checked: everything the writer needs."""

    run_dir: Path
    cfg: DictConfig
    fmt: str
    source: Source
    out: Path
    dtype: str  # a key of EXPORT_DTYPES

    def marker(self) -> dict[str, str]:
        """What MARKER says of this export: an export dir holding the same is this export."""
        return {"format": self.fmt, "run_id": str(self.cfg.run.id), "step": str(self.source.step),
                "source": str(self.source.path.relative_to(self.run_dir)), "dtype": self.dtype}

    def done(self) -> bool:
        """Whether `out` already holds this export, complete (MARKER is written last)."""
        try:
            return json.loads((self.out / MARKER).read_text()) == self.marker()
        except (OSError, ValueError):
            return False


def _usage(what: str) -> ConfigError:
    return ConfigError(f"Invalid usage: loom export {what}.")


def _choice(flag: str, value: str | None, choices: dict[str, str] | tuple[str, ...]) -> str:
    if value in choices:
        return str(value)
    listed = "; ".join(f"{k}: {v}" for k, v in choices.items()) if isinstance(choices, dict) else ", ".join(choices)
    raise _usage(f"{flag} {value}: valid choices: {listed}")


def run_dir_of(run: str) -> Path:
    """The run dir `run` names (a directory holding the frozen config.yaml)."""
    path = Path(run).expanduser().resolve()
    if not RunDir(path).config.is_file():
        why = "does not exist" if not path.exists() else f"has no {RunDir.config.rel}"
        raise _usage(f"{run}: not a run dir ({path} {why}); name the directory `loom train` printed after "
                     "'run dir:', e.g. runs/<experiment>/<run id>")
    return path


def final_weights(run_dir: Path) -> Source | None:
    """A completed run's final weights as its summary.json names them, when they are on disk."""
    summary = read_summary(run_dir) or {}
    named = summary.get("final_weights")
    if summary.get("status") != "completed" or not named or summary.get("global_step") is None:
        return None
    path = run_dir / str(named)
    whole = path.is_file() or any((path / f).is_file() for f in ("config.json", ADAPTER_CONFIG))
    return Source("final", path, int(summary["global_step"])) if whole else None


def _available(ckpts: dict[int, Path], final: Source | None) -> str:
    steps = sorted({*ckpts, *([final.step] if final else [])})
    if not steps:
        return "it has neither (checkpoint.every_n_steps=0 and the run did not complete)"
    final_note = f" ({final.step}: the final weights)" if final and final.step not in ckpts else ""
    return f"available steps: {', '.join(map(str, steps))}{final_note}"


def _checkpoint(run_dir: Path, path: Path, step: int) -> Source:
    issue = checkpoints.problem(path)
    if issue is not None:
        kind, why = issue
        raise _usage(f"{run_dir} --step {step}: checkpoint {path.name} is {kind} ({why}); "
                     + ("loading it would run code, it is never read" if kind == "unsafe" else "pick another step"))
    return Source("checkpoint", path, step)


def pick_source(run_dir: Path, step: int | None, prefer_checkpoint: bool = False) -> Source:
    """The weights to export (see the module docstring); `prefer_checkpoint`: the checkpoint
    of the final step over final/ when both exist (final/ holds a narrower dtype)."""
    ckpts = {checkpoints.step_of(p): p for p in checkpoints.complete_checkpoints(run_dir)}
    final = final_weights(run_dir)
    if step is not None:
        if step in ckpts:
            return _checkpoint(run_dir, ckpts[step], step)
        if final is not None and step == final.step:
            return final
        raise _usage(f"{run_dir} --step {step}: the run has no checkpoint of step {step} nor final weights of "
                     f"it; {_available(ckpts, final)}")
    if final is not None:
        if prefer_checkpoint and final.step in ckpts:
            return _checkpoint(run_dir, ckpts[final.step], final.step)
        return final
    try:
        newest = checkpoints.newest_checkpoint(run_dir)
    except checkpoints.UnsafeCheckpoint as e:
        raise _usage(f"{run_dir}: {e}") from None
    if newest is None:
        raise _usage(f"{run_dir}: the run has no final weights and no complete checkpoint to export; "
                     f"{_available(ckpts, None)}")
    return Source("checkpoint", newest, int(checkpoints.step_of(newest)))


def _check_hf(cfg: DictConfig, run_dir: Path) -> None:
    """--format hf needs a transformers architecture that holds the run's model."""
    if MODELS[cfg.model.name].hf_config is not None:
        return
    able = ", ".join(f.name for f in FAMILIES if f.hf_config is not None)
    raise _usage(f"{run_dir} --format hf: model={cfg.model.name} has no Hugging Face architecture to export to "
                 f"(models that have one: {able}); use --format loom (model.safetensors)")


def lora_rank(cfg: DictConfig) -> int:
    """The run's model.lora.r (0: no LoRA; a run frozen before LoRA existed has no model.lora)."""
    lora = cfg.model.get("lora")
    return int(lora.get("r") or 0) if lora else 0


def merge_base(cfg: DictConfig) -> tuple[Path | None, str]:
    """The Hugging Face directory a LoRA run's base weights are in (what peft merges into), or
    None and why not: model.init_from when it is one; hf_causal_lm's model.config when it holds
    the weights the run started from (its family's `weights_dir`)."""
    m = cfg.model
    if m.get("init_from"):
        base = Path(str(m.init_from))
        why = f"model.init_from={m.init_from} is no Hugging Face directory (no config.json)"
        return (base, "") if (base / "config.json").is_file() else (None, why)
    weights_dir = MODELS[m.name].weights_dir
    if weights_dir is not None:
        return weights_dir(cfg)
    return None, "the base was initialized by Loom from the seed (no model.init_from), which no directory holds"


def _check_lora(cfg: DictConfig, run_dir: Path, fmt: str) -> None:
    """A LoRA run's weights are an adapter on a frozen base: peft writes it, hf merges it into
    the base's Hugging Face directory; Loom's own layout has no place for it."""
    r = lora_rank(cfg)
    if fmt == "peft" and not r:
        raise _usage(f"{run_dir} --format peft: the run trained no LoRA adapter (model.lora.r={r}: LoRA off), "
                     "its weights are whole; use --format hf or --format loom")
    if fmt == "loom" and r:
        raise _usage(f"{run_dir} --format loom: the run trained a LoRA adapter (model.lora.r={r}) on a frozen "
                     "base; use --format peft (the adapter alone) or --format hf (merged into its base)")
    if fmt == "hf" and r:
        base, why = merge_base(cfg)
        if base is None:
            raise _usage(f"{run_dir} --format hf: merging the LoRA adapter (model.lora.r={r}) needs its base as a "
                         f"Hugging Face directory, but {why}; use --format peft (the adapter alone)")


def output_dir(run_dir: Path, out: str | None, fmt: str, step: int, dtype: str, run_dtype: str) -> Path:
    """--out, or <run>/export/<format>-step-<N>[-<dtype>]: never final/ or checkpoints/ (the
    run's own record, which summary.json and a resume read)."""
    if out is None:
        return RunDir(run_dir).export(fmt, step, "" if dtype == run_dtype else dtype)
    path = Path(out).expanduser().resolve()
    for kept in (RunDir(run_dir).final, checkpoints.checkpoint_dir(run_dir)):
        if path == kept or kept in path.parents:
            raise _usage(f"{run_dir} --out {out}: {kept.name}/ is the run's own record (summary.json and a resume "
                         "read it); choose a directory outside it, or leave --out out for "
                         f"{RunDir(run_dir).exports}/<format>-step-<N>")
    if path.exists() and not path.is_dir():
        raise _usage(f"{run_dir} --out {out}: {path} is a file; name a directory")
    return path


def request(run: str, fmt: str | None, out: str | None = None, step: int | None = None,
            dtype: str | None = None) -> Request:
    """Everything `loom export` was asked, checked against the run dir (ConfigError: exit 2)."""
    fmt = _choice("--format", fmt, FORMATS)
    run_dir = run_dir_of(run)
    cfg = load_frozen(RunDir(run_dir).config)
    if fmt == "hf":
        _check_hf(cfg, run_dir)
    _check_lora(cfg, run_dir, fmt)
    run_dtype = str(cfg.checkpoint.get("export_dtype", "fp32"))
    dtype = _choice("--dtype", dtype, tuple(EXPORT_DTYPES)) if dtype is not None else run_dtype
    if step is not None and step < 0:
        raise _usage(f"{run_dir} --step {step}: a step is a non-negative integer")
    # final/ in a narrower dtype than asked: the final step's checkpoint keeps what training held
    narrower = EXPORT_DTYPES[run_dtype] != "float32" and dtype != run_dtype
    source = pick_source(run_dir, step, prefer_checkpoint=narrower)
    return Request(run_dir, cfg, fmt, source, output_dir(run_dir, out, fmt, source.step, dtype, run_dtype), dtype)
