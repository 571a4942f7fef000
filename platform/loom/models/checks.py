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
VOCAB_MULTIPLE = 64  # a tokenizer-sized vocabulary is padded to it: matmul-friendly, any TP degree divides it
TENSOR_HINT = "feature datasets: digits, synthetic (dataset.kind=tensors)"


def vocab_covers_data(cfg: DictConfig, have: int, key: str = "model.vocab_size", also: str = "") -> None:
    """The model's vocabulary covers the data's token ids; `also`: what the advice needs besides
    the size (a model whose weights are loaded with it: model.random_init=true)."""
    need = data_vocab_size(cfg)
    if need is not None and have < need:
        src = (f"dataset.tokenizer={cfg.dataset.tokenizer} has {need} tokens" if cfg.dataset.get("tokenizer")
               else f"dataset={cfg.dataset.name} has token ids up to {need - 1}")
        _fail(key, have, f"is smaller than the data's vocabulary ({src}); set model.vocab_size={need}{also}")


def size_vocab_to_tokenizer(cfg: DictConfig) -> None:
    """With `dataset.tokenizer`, an option whose vocabulary is Loom's byte-level default (its
    family's normalize calls this; a published vocabulary is kept, and a larger tokenizer is
    refused) and that starts from no checkpoint takes the tokenizer's vocabulary, padded up to a multiple of VOCAB_MULTIPLE (a larger
    `model.vocab_size` of the user's stays). `model.vocab_used` then records the tokenizer's
    size, and the loss leaves the padded ids out of its softmax (models.lit._lm_loss): the
    padding never changes the loss. A checkpoint's or a published vocabulary is not resized."""
    m = cfg.model
    if not cfg.dataset.get("tokenizer") or m.get("init_from"):
        return
    need = data_vocab_size(cfg)
    if need is None:
        return
    padded = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    m.vocab_size = max(int(m.vocab_size), padded)
    m.vocab_used = need if need < m.vocab_size else None


def needs_tokens(cfg: DictConfig) -> None:
    _require(is_token_data(cfg.dataset), "model.name", cfg.model.name,
             f"model={cfg.model.name} is a causal language model over token sequences but "
             f"dataset={cfg.dataset.name} yields (features, label) samples; use one of the {TOKEN_HINT}")


def within_context(cfg: DictConfig, context: int, key: str) -> None:
    """dataset.seq_len fits the model's longest sequence (`key` names where it is set)."""
    _require(cfg.dataset.seq_len <= context, "dataset.seq_len", cfg.dataset.seq_len,
             f"exceeds the model's context {key}={context}; lower dataset.seq_len or raise {key}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_split_heads(cfg: DictConfig, layout: ParallelLayout, heads: int, key: str, what: str) -> None:
    """Each tensor-parallel rank holds whole `what` (a plan that splits q/k/v by output features)."""
    if layout.tp <= 1:
        return
    s = cfg.strategy
    _require(heads % layout.tp == 0, "strategy.tp" if "tp" in s else "strategy.tensor_parallel", layout.tp,
             f"must divide {key}={heads} (each tensor-parallel rank holds whole {what}); "
             f"valid degrees: {', '.join(str(d) for d in divisors(heads))}")


def check_stages(cfg: DictConfig, layout: ParallelLayout, layers: int, key: str) -> None:
    """A pipeline stage holds at least one layer."""
    _require(layout.pp <= layers, "strategy.pp", layout.pp,
             f"exceeds {key}={layers} (a pipeline stage holds at least one layer)")


def check_untied_for_stages(cfg: DictConfig, layout: ParallelLayout, tied: bool, key: str, fix: str) -> None:
    """A head tied to the embedding cannot cross pipeline stages: the embedding lives on the first,
    the head on the last, and Loom does not keep a tied copy in sync across them."""
    # pp=1 alone leaves the preset's degrees short of the world: another degree takes its ranks
    unpiped = "strategy=fsdp" if cfg.strategy.name == "pp" else "strategy.pp=1 strategy.dp_shard=-1"
    _require(not tied, key, tied,
             f"strategy.pp={layout.pp} puts the token embedding on the first pipeline stage and the head "
             f"on the last, so a head tied to the embedding cannot be shared between them; set {fix} "
             f"(the head gets a matrix of its own), or {unpiped} (tensor parallelism and FSDP keep a tied head)")


def check_packing(cfg: DictConfig, layout: ParallelLayout, document_masks: bool, able: str) -> None:
    """`dataset.packing=documents` needs a network that masks attention per document (`document_masks`
    in the registry; `able`: the families that do) and no pipeline stages: a stage would need each
    token's position beside the activations it receives, which Loom's schedules do not send yet."""
    if cfg.dataset.get("packing") != "documents":
        return
    m = cfg.model
    _require(document_masks, "dataset.packing", "documents",
             f"model={m.name} has no document mask (attention would cross document boundaries); "
             f"use dataset.packing=concat or model={able.replace(', ', '/')}")
    _require(layout.pp <= 1, "dataset.packing", "documents",
             f"packing=documents under pipeline parallelism (strategy.pp={layout.pp}) is not supported yet: "
             "positions would have to travel with the activations; use strategy=fsdp/fsdp_tp/ddp/zero*, "
             "or dataset.packing=concat")
    _require(not m.get("dropout"), "model.dropout", m.get("dropout"),
             "must be 0 with dataset.packing=documents (FlexAttention, which masks each document, has no "
             "attention dropout); set model.dropout=0.0 or dataset.packing=concat")


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
             f"sequences; use one of the {TENSOR_HINT}, or a causal language model")
    n_in, n_cls = feats
    _require(m.in_features == n_in, "model.in_features", m.in_features,
             f"dataset={cfg.dataset.name} has {n_in} features per sample; set it to {n_in} or null")
    _require(m.num_classes >= n_cls, "model.num_classes", m.num_classes,
             f"dataset={cfg.dataset.name} has {n_cls} classes; set it to {n_cls} or null")
    _require(all(h >= 1 for h in m.hidden), "model.hidden", list(m.hidden), "layer widths must be >= 1")
    _require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "must be in [0, 1)")


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
