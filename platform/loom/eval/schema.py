"""The schema of the `eval` group (conf/eval/): benchmark tasks run by lm-evaluation-harness."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig


@dataclass
class EvalConfig:
    name: str = "default"
    tasks: list[str] = field(default_factory=list)  # lm-eval task names, or paths to task YAML files/dirs
    every_n_steps: int = 0          # 0: only at the end (when tasks are set)
    at_end: bool = True
    limit: int | None = None        # lm-eval's limit: documents per task (null: all)
    num_fewshot: int | None = None  # null: each task's own
    batch_size: int = 8
    apply_chat_template: bool = False
    max_length: int | None = None   # null: the model's context (dataset.seq_len)


SCHEMAS: dict[str, type] = {"*": EvalConfig}


def model_context(cfg: DictConfig) -> int:
    """The longest input the run's model takes: a GPT's block_size, else what it trained on."""
    block = cfg.model.get("block_size") if isinstance(cfg.model, DictConfig) else None
    return int(block or cfg.dataset.seq_len)


def eval_length(cfg: DictConfig) -> int:
    """The tokens of context lm-eval gives the model: eval.max_length, else what it trained on."""
    return int(cfg.eval.max_length or cfg.dataset.seq_len)
