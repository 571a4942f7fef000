"""Model validation in the launcher (no torch of Loom's own): sizes against the data's
context and vocabulary, the model x dataset fit, and a custom `_target_`; and each option's
normalization (sizes filled from the data, paths made absolute). The registry
(`loom.models.registry`) names which of these each option runs."""

from __future__ import annotations

from omegaconf import DictConfig

from loom.data import data_features, data_vocab_size, is_token_data
from loom.errors import fail as _fail
from loom.errors import require as _require
from loom.layout import ParallelLayout

TOKEN_HINT = "token datasets: tinycode, text_files, hf, synthetic (dataset.kind=tokens)"
TENSOR_HINT = "feature datasets: digits, synthetic (dataset.kind=tensors)"


def _vocab(cfg: DictConfig, have: int, key: str = "model.vocab_size") -> None:
    need = data_vocab_size(cfg)
    if need is not None and have < need:
        src = (f"dataset.tokenizer={cfg.dataset.tokenizer} has {need} tokens" if cfg.dataset.get("tokenizer")
               else f"dataset={cfg.dataset.name} has token ids up to {need - 1}")
        _fail(key, have, f"is smaller than the data's vocabulary ({src}); set model.vocab_size={need}")


def _needs_tokens(cfg: DictConfig) -> None:
    _require(is_token_data(cfg.dataset), "model.name", cfg.model.name,
             f"model={cfg.model.name} is a causal language model over token sequences but "
             f"dataset={cfg.dataset.name} yields (features, label) samples; use one of the {TOKEN_HINT}")


def check_gpt(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    _require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"must divide model.d_model={m.d_model}")
    _needs_tokens(cfg)
    _require(cfg.dataset.seq_len <= m.block_size, "dataset.seq_len", cfg.dataset.seq_len,
             f"exceeds the model's context model.block_size={m.block_size}; "
             "lower dataset.seq_len or raise model.block_size")
    _vocab(cfg, m.vocab_size)


def normalize_mlp(cfg: DictConfig) -> None:
    """in_features / num_classes left null are the dataset's."""
    m, feats = cfg.model, data_features(cfg)
    if feats is not None:
        m.in_features = feats[0] if m.in_features is None else m.in_features
        m.num_classes = feats[1] if m.num_classes is None else m.num_classes


def check_mlp(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    feats = data_features(cfg)
    _require(feats is not None, "model.name", m.name,
             f"model=mlp classifies feature vectors but dataset={cfg.dataset.name} yields token "
             f"sequences; use one of the {TENSOR_HINT}, or a GPT / hf_causal_lm model")
    n_in, n_cls = feats
    _require(m.in_features == n_in, "model.in_features", m.in_features,
             f"dataset={cfg.dataset.name} has {n_in} features per sample; set it to {n_in} or null")
    _require(m.num_classes >= n_cls, "model.num_classes", m.num_classes,
             f"dataset={cfg.dataset.name} has {n_cls} classes; set it to {n_cls} or null")
    _require(all(h >= 1 for h in m.hidden), "model.hidden", list(m.hidden), "layer widths must be >= 1")
    _require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "must be in [0, 1)")


def normalize_hf(cfg: DictConfig) -> None:
    """A local config dir is frozen absolute: ranks and resumes may start elsewhere."""
    from pathlib import Path

    m = cfg.model
    if m.config:
        p = Path(str(m.config)).expanduser()
        if p.exists():
            m.config = str(p.resolve())


def check_hf(cfg: DictConfig, layout: ParallelLayout) -> None:
    from loom.models import hf

    m = cfg.model
    _require(bool(m.config), "model.config", m.config,
             "name a directory holding a transformers config.json (save_pretrained), or a model "
             "name already in the Hugging Face cache, e.g. model.config=/models/my-gpt2")
    try:
        data = hf.config_dict(m)
    except (FileNotFoundError, ValueError, OSError):
        _fail("model.config", m.config,
              "has no config.json locally (not a directory with one, nor a name in the Hugging Face "
              "cache); Loom does not download models: save one with "
              "transformers.AutoConfig...save_pretrained(dir) and pass the directory")
    _needs_tokens(cfg)
    ctx = hf.context_length(data)
    if ctx is not None:
        _require(cfg.dataset.seq_len <= ctx, "dataset.seq_len", cfg.dataset.seq_len,
                 f"exceeds the model's context ({ctx}, from model.config={m.config}); lower "
                 "dataset.seq_len or raise it with model.overrides")
    vocab = data.get("vocab_size")
    if isinstance(vocab, int):
        _vocab(cfg, vocab, "model.vocab_size" if m.vocab_size is not None else "model.config.vocab_size")


def normalize_custom(cfg: DictConfig) -> None:
    """An empty `model.loss` means none (a LightningModule computes its own)."""
    if not cfg.model.loss:
        cfg.model.loss = None


def check_custom(cfg: DictConfig, layout: ParallelLayout) -> None:
    from loom.models import custom

    m = cfg.model
    target = (m.module or {}).get("_target_")
    _require(bool(target), "model.module._target_", target,
             "name your LightningModule or nn.Module class, e.g. model.module._target_=my_pkg.MyModule "
             "security.allow_targets='[my_pkg.]'")
    for key, tgt in (("model.module._target_", target),
                     ("model.loss._target_", (m.loss or {}).get("_target_"))):
        if tgt is None:
            continue
        try:
            obj = custom.locate(str(tgt))
        except Exception as e:
            reason = " ".join(str(e).split())[:300]
            _fail(key, tgt, f"cannot be imported ({type(e).__name__}: {reason}); make sure its package is "
                  "installed or on PYTHONPATH, and the name is spelled module.path.ClassName")
        kind = custom.kind_of(obj)
        if key == "model.loss._target_":
            _require(callable(obj), key, tgt, "is not callable; name a loss class such as torch.nn.CrossEntropyLoss")
            _check_arguments("model.loss", tgt, obj, m.loss)
            continue
        _require(kind != "lightning_unified", key, tgt,
                 "subclasses lightning.pytorch.LightningModule, but Loom's trainer is pytorch_lightning: "
                 "import LightningModule from pytorch_lightning")
        _require(kind is not None, key, tgt,
                 "is not a LightningModule or a torch.nn.Module subclass (nor a function returning one); "
                 f"its bases: {', '.join(c.__name__ for c in getattr(obj, '__mro__', [type(obj)]))}")
        _check_arguments("model.module", tgt, obj, m.module)


def _check_arguments(key: str, target: str, obj, node: DictConfig) -> None:
    """The node's keys bind to the target's signature (names only: values may be secrets)."""
    from loom.errors import ConfigError
    from loom.models import custom

    problem = custom.signature_problem(obj, node)
    if problem:
        arg, why = problem
        raise ConfigError(f"Invalid config: {key}{'.' + arg if arg else ''}: {why.format(target=target)}; "
                          f"set arguments as {key}.NAME=VALUE (+{key}.NAME=VALUE adds one).")
