"""The objective's checks at validation (exit 2 before anything launches): its ranges, then what it
asks of the rest of the run: a score head (reward), a layout that keeps a pair on one rank, a
reference DeepSpeed can shard, and data that is (or is not) preference pairs."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from loom.data import is_pairs
from loom.data.registry import DATASETS
from loom.errors import ConfigError, require
from loom.layout import ParallelLayout
from loom.objectives.reference import reference_of
from loom.objectives.registry import OBJECTIVES, ObjectiveOption
from loom.objectives.schema import REFERENCES
from loom.strategies.deepspeed_config import zero_stage


def check_ranges(o: DictConfig) -> None:
    """The keys an option has, in their ranges (each option's schema holds only its own keys)."""
    if "beta" in o:
        require(o.beta > 0, "objective.beta", o.beta, "must be > 0")
    if "label_smoothing" in o:
        require(0 <= o.label_smoothing < 0.5, "objective.label_smoothing", o.label_smoothing,
                "must be in [0, 0.5): the chance a pair's preference is flipped (0: plain "
                f"{o.name.upper()})")
    if "gamma" in o:
        require(o.gamma >= 0, "objective.gamma", o.gamma, "must be >= 0 (the target reward margin)")
    if "reference" in o:
        require(o.reference in REFERENCES, "objective.reference", o.reference,
                f"valid choices: {', '.join(REFERENCES)} (auto: the base with adapters disabled under LoRA, "
                "else precompute)")
    coef = o.get("center_rewards_coefficient")
    require(coef is None or coef >= 0, "objective.center_rewards_coefficient", coef, "must be >= 0, or null for none")


def check_head(cfg: DictConfig, option: ObjectiveOption) -> None:
    """A reward model scores with a scalar head: hf_causal_lm's model.head=score; and only a reward
    objective trains one (a score head has no token logits for a language-model or DPO loss)."""
    if cfg.model.get("head") == "score" and not option.score_head:
        scored = ", ".join(f"objective={name}" for name, o in OBJECTIVES.items() if o.score_head)
        raise ConfigError(f"Invalid config: model.head=score gives one score per sequence, not token logits, and "
                          f"objective={option.name} trains token log-probabilities. Use {scored} with "
                          "dataset=preference, or model.head=lm.")
    if not option.score_head or cfg.model.get("head") == "score":
        return
    head = cfg.model.get("head")
    has = f"model.head={head}" if head is not None else f"model={cfg.model.name} has no score head"
    raise ConfigError(f"Invalid config: objective={option.name} trains a scalar score head on each sequence, and "
                      f"{has}. Use model=hf_causal_lm model.head=score (a transformers "
                      "...ForSequenceClassification with one label).")


def check_layout(cfg: DictConfig, option: ObjectiveOption, layout: ParallelLayout) -> None:
    """A pair's loss needs both completions' whole log-probs on one rank: no tensor or pipeline split."""
    if option.pairs and (layout.tp > 1 or layout.pp > 1):
        raise ConfigError(
            f"Invalid config: objective={option.name} scores the chosen and rejected completions of a pair "
            f"together, and strategy={cfg.strategy.name} splits the model (tp={layout.tp}, pp={layout.pp}). "
            "Preference objectives run under data parallelism and sharding only: strategy=ddp, fsdp, zero1, "
            "zero2 or zero3 (or tp=1 and pp=1).")


def check_reference(cfg: DictConfig, option: ObjectiveOption) -> None:
    """reference=online under ZeRO-3: a frozen copy built outside DeepSpeed's engine would not be
    partitioned (every rank would hold all of it), so the precomputed log-probs are the way there."""
    if reference_of(cfg) == "online" and zero_stage(cfg.strategy.name) == 3:
        raise ConfigError(
            f"Invalid config: objective.reference=online under strategy={cfg.strategy.name}: the frozen reference "
            "copy would live outside DeepSpeed's engine, unpartitioned (the whole model on every rank). Use "
            "objective.reference=precompute (its log-probs computed once before training), or train LoRA "
            "adapters (model.lora.r > 0), where reference=auto is the base with the adapters disabled.")


def check_data(cfg: DictConfig, option: ObjectiveOption) -> None:
    """A pair objective reads preference pairs; pairs are refused by an objective that is not one."""
    pairs = is_pairs(cfg.dataset)
    named = [name for name, d in DATASETS.items() if d.pairs]
    if option.pairs and not pairs:
        where = f"dataset={named[0]}" if named else "a preference-pair dataset"
        raise ConfigError(
            f"Invalid config: objective={option.name} trains on preference pairs (prompt, chosen, rejected), and "
            f"dataset={cfg.dataset.name} yields none. Use {where} (dataset.path=<prompt/chosen/rejected JSONL>), "
            "or objective=lm.")
    if pairs and not option.pairs:
        choices = ", ".join(name for name, o in OBJECTIVES.items() if o.pairs)
        raise ConfigError(
            f"Invalid config: dataset={cfg.dataset.name} yields preference pairs, which objective={option.name} "
            f"does not train on. Choose a preference objective: objective=<{choices.replace(', ', '|')}> "
            "(e.g. objective=dpo), or a dataset of single sequences.")


def _reference_tokenizer(cfg: DictConfig) -> str | None:
    """Where the starting weights' own tokenizer is: a run dir's frozen dataset.tokenizer, or tokenizer
    files beside the weights (a Hugging Face directory, a run's final/); None: not known."""
    from omegaconf import OmegaConf

    from loom.rundir.paths import RunDir

    m = cfg.model
    for where in (m.get("init_from"), m.get("config")):
        d = Path(str(where)).expanduser() if where else None
        if d is None or not d.is_dir():
            continue
        frozen = RunDir(d).config
        if frozen.is_file():  # a Loom run dir
            tok = (OmegaConf.load(frozen).get("dataset") or {}).get("tokenizer")
            return str(tok) if tok else None
        if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
            return str(d)
    return None


def check_reference_tokenizer(cfg: DictConfig, option: ObjectiveOption) -> None:
    """The reference (the starting weights) must read the ids the pairs are rendered with: a checkpoint
    trained with another tokenizer would score other tokens, and the loss would be silently wrong."""
    if not option.pairs or not cfg.dataset.get("tokenizer"):
        return
    theirs, ours = _reference_tokenizer(cfg), str(cfg.dataset.tokenizer)
    if theirs is None or not Path(theirs).expanduser().is_dir() or Path(theirs).resolve() == Path(ours).resolve():
        return
    from loom.data.prepare.encoding import load_backend

    def vocabulary(name: str) -> dict[str, int]:  # the ids, wherever the files lie (a copy is the same tokenizer)
        return load_backend(name)[0].get_vocab(with_added_tokens=True)

    if vocabulary(theirs) != vocabulary(ours):
        key = "model.init_from" if cfg.model.get("init_from") else "model.config"
        raise ConfigError(
            f"Invalid config: {key}={cfg.model.get('init_from') or cfg.model.get('config')} was trained with the "
            f"tokenizer {theirs}, which differs from dataset.tokenizer={cfg.dataset.tokenizer}: the reference and "
            "the policy would score other token ids than the pairs hold. Render the pairs with the model's own "
            f"tokenizer (dataset.tokenizer={theirs}).")
