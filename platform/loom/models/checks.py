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
# Options whose vocabulary is Loom's byte-level default, which a dataset.tokenizer replaces;
# the others' (llama3_*: Meta's 128,256) is the published one, and a larger tokenizer is refused.
TOKENIZER_SIZED = ("gpt_tiny", "gpt_small", "gpt_125m", "gpt_1b", "gpt_7b", "llama_tiny")
VOCAB_MULTIPLE = 64  # a tokenizer-sized vocabulary is padded to it: matmul-friendly, any TP degree divides it
TENSOR_HINT = "feature datasets: digits, synthetic (dataset.kind=tensors)"


# The module classes of Loom's GPT (loom.models.gpt), named here because validation runs before
# torch is imported: the choices for strategy.shard_units (the registry's `module_classes`).
GPT_MODULE_CLASSES = ("Block", "CausalSelfAttention", "MLP", "Linear", "Embedding", "LayerNorm")

def _vocab(cfg: DictConfig, have: int, key: str = "model.vocab_size", also: str = "") -> None:
    """The model's vocabulary covers the data's token ids; `also`: what the advice needs besides
    the size (a model whose weights are loaded with it: model.random_init=true)."""
    need = data_vocab_size(cfg)
    if need is not None and have < need:
        src = (f"dataset.tokenizer={cfg.dataset.tokenizer} has {need} tokens" if cfg.dataset.get("tokenizer")
               else f"dataset={cfg.dataset.name} has token ids up to {need - 1}")
        _fail(key, have, f"is smaller than the data's vocabulary ({src}); set model.vocab_size={need}{also}")


def size_vocab_to_tokenizer(cfg: DictConfig) -> None:
    """With `dataset.tokenizer`, a TOKENIZER_SIZED option that starts from no checkpoint takes
    the tokenizer's vocabulary, padded up to a multiple of VOCAB_MULTIPLE (a larger
    `model.vocab_size` of the user's stays). `model.vocab_used` then records the tokenizer's
    size, and the loss leaves the padded ids out of its softmax (models.lit._lm_loss): the
    padding never changes the loss. A checkpoint's or a published vocabulary is not resized."""
    m = cfg.model
    if not cfg.dataset.get("tokenizer") or m.get("init_from") or m.name not in TOKENIZER_SIZED:
        return
    need = data_vocab_size(cfg)
    if need is None:
        return
    padded = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    m.vocab_size = max(int(m.vocab_size), padded)
    m.vocab_used = need if need < m.vocab_size else None


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


LLAMA_FIELDS = ("n_layer", "n_head", "n_kv_heads", "d_model", "intermediate_size", "vocab_size", "block_size",
                "rope_theta", "rms_norm_eps", "tie_embeddings", "qkv_bias")


def normalize_llama(cfg: DictConfig) -> None:
    """Fields left null are taken from the config.json of the Hugging Face dir `model.init_from`
    names, or of a run's `final/` exported with checkpoint.export_format=hf (`model=llama`: all
    of them); the user's own overrides stay. An architecture Loom's Llama does not reproduce
    is refused here, naming the supported ones. llama_tiny takes a tokenizer's vocabulary."""
    from loom.models import llama_hf
    from loom.models.init_from import source_file

    m = cfg.model
    size_vocab_to_tokenizer(cfg)  # llama_tiny's byte-level default; no-op with a checkpoint
    src = source_file(str(m.init_from)) if m.get("init_from") else None  # a run dir: its final/
    data = llama_hf.read_config(src) if src is not None and src.is_dir() else None
    if data is None:
        return
    fields = llama_hf.fields_from_config(data, str(m.init_from))
    for key, value in fields.items():
        if m.get(key) is None and (key != "rope_scaling" or m.name == "llama"):
            m[key] = value


def check_llama(cfg: DictConfig, layout: ParallelLayout) -> None:
    m = cfg.model
    for key in LLAMA_FIELDS:
        _require(m.get(key) is not None, f"model.{key}", None,
                 f"model={m.name} takes its shape from model.init_from's config.json: set model.init_from to "
                 "a Hugging Face dir (config.json + model.safetensors), or choose a sized option "
                 "(llama_tiny, llama3_1b, llama3_3b, llama3_8b, llama3_70b)")
    for key in ("n_layer", "n_head", "n_kv_heads", "d_model", "intermediate_size", "vocab_size", "block_size"):
        _require(m[key] >= 1, f"model.{key}", m[key], "must be a positive integer")
    _require(m.d_model % m.n_head == 0, "model.n_head", m.n_head, f"must divide model.d_model={m.d_model}")
    _require(m.n_head % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
             f"must divide model.n_head={m.n_head} (each key/value head serves a whole group of query "
             f"heads); valid: {', '.join(str(d) for d in _divisors(m.n_head))}")
    _require(m.rms_norm_eps > 0, "model.rms_norm_eps", m.rms_norm_eps, "must be > 0")
    _require(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be > 0")
    _check_rope_scaling(m)
    _needs_tokens(cfg)
    _require(cfg.dataset.seq_len <= m.block_size, "dataset.seq_len", cfg.dataset.seq_len,
             f"exceeds the model's context model.block_size={m.block_size}; "
             "lower dataset.seq_len or raise model.block_size")
    _vocab(cfg, m.vocab_size)
    _check_llama_layout(cfg, layout)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_rope_scaling(m: DictConfig) -> None:
    from loom.models.llama_hf import ROPE_SCALING_KEYS

    if m.rope_scaling is None:
        return
    keys = sorted(m.rope_scaling)
    _require(keys == sorted(ROPE_SCALING_KEYS), "model.rope_scaling", dict(m.rope_scaling),
             f"Llama-3.1 scaling has exactly the keys {', '.join(ROPE_SCALING_KEYS)} (null: plain rotary)")
    r = m.rope_scaling
    _require(r.factor > 0 and r.high_freq_factor > r.low_freq_factor > 0, "model.rope_scaling", dict(r),
             "needs factor > 0 and high_freq_factor > low_freq_factor > 0")


def _check_llama_layout(cfg: DictConfig, layout: ParallelLayout) -> None:
    """What the Llama family's splits need: tensor-parallel ranks hold whole key/value heads
    (models.lit's plan splits k/v_proj by output features), a pipeline stage holds at least one
    layer, and a tied head cannot cross stages (embed_tokens lives on the first, the head on
    the last, and Loom does not keep a tied copy in sync across them)."""
    m, s = cfg.model, cfg.strategy
    if layout.tp > 1:
        key = "strategy.tp" if "tp" in s else "strategy.tensor_parallel"
        _require(m.n_kv_heads % layout.tp == 0, key, layout.tp,
                 f"must divide model.n_kv_heads={m.n_kv_heads} (each tensor-parallel rank holds whole "
                 f"key/value heads); valid degrees: {', '.join(str(d) for d in _divisors(m.n_kv_heads))}")
    if layout.pp > 1:
        _require(layout.pp <= m.n_layer, "strategy.pp", layout.pp,
                 f"exceeds model.n_layer={m.n_layer} (a pipeline stage holds at least one layer)")
        # pp=1 alone leaves the preset's degrees short of the world: another degree takes its ranks
        unpiped = "strategy=fsdp" if s.name == "pp" else "strategy.pp=1 strategy.dp_shard=-1"
        _require(not m.tie_embeddings, "model.tie_embeddings", m.tie_embeddings,
                 f"strategy.pp={layout.pp} puts model.embed_tokens on the first pipeline stage and the head "
                 "on the last, so a head tied to the embedding cannot be shared between them; set "
                 f"model.tie_embeddings=false (the head gets a matrix of its own), or {unpiped} "
                 "(tensor parallelism and FSDP keep a tied head)")


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
    """A local config dir is frozen absolute: ranks and resumes may start elsewhere; an alias
    key of `model.overrides` is frozen as the config's own key."""
    from pathlib import Path

    from loom.models.hf_checks import canonical_overrides

    m = cfg.model
    if m.config:
        p = Path(str(m.config)).expanduser()
        if p.exists():
            m.config = str(p.resolve())
    canonical_overrides(cfg)  # an alias (num_hidden_layers) -> its config's key (GPT-2: n_layer)


def check_hf(cfg: DictConfig, layout: ParallelLayout) -> None:
    """config.json read as JSON first (torch-free refusals), then against transformers' class."""
    from loom.models import hf, hf_checks

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
    loaded = not m.random_init and not m.get("init_from") and hf.has_local_weights(str(m.config))
    _hf_context(cfg, data, loaded)
    vocab = data.get("vocab_size")
    if isinstance(vocab, int):
        also = (" model.random_init=true (the weights in model.config have a smaller vocabulary: "
                "its new rows cannot come from them)") if loaded else ""
        _vocab(cfg, vocab, "model.vocab_size" if m.vocab_size is not None else "model.config.vocab_size", also)
    hf_checks.check_architecture(cfg)  # overrides, the build, the implicit weights (transformers)


def _hf_context(cfg: DictConfig, data: dict, loaded: bool) -> None:
    """dataset.seq_len within the config's context; the advice raises the config's own key, and
    adds model.random_init=true where that key sizes a position table the loaded weights hold."""
    from loom.models import hf, hf_checks

    key, seq = hf.context_key(data), cfg.dataset.seq_len
    if key is None or seq <= data[key]:
        return
    raise_it = f"model.overrides.{key}={seq}"
    if loaded and not hf_checks.fits_weights(cfg, {**hf.overrides_of(cfg.model), key: seq}):
        raise_it += " model.random_init=true (a longer position table than the weights hold)"
    _fail("dataset.seq_len", seq, f"exceeds the model's context ({key}={data[key]}, from model.config="
          f"{cfg.model.config}); lower dataset.seq_len to {data[key]} or set {raise_it}")


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
