"""`dataset.packing=documents`, the model side (in-process, tiny fp32 models on CPU): a packed row
computes what each of its documents computes alone (logits and loss within 1e-5), one document
is today's causal forward, backward works with and without activation checkpointing, CPU's dense
mask and FlexAttention agree, validation refuses what cannot mask documents, and several
validation sources log their own loss and a token-weighted overall one."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf, open_dict

from loom.data.batch import Batch
from loom.errors import EXIT_INVALID, ConfigError
from loom.models.activation_checkpointing import apply_activation_checkpointing, clean_name
from loom.models.document_mask import attend, document_ids, document_mask
from loom.models.gpt.network import GPT, Block
from loom.models.lit import _lm_loss
from loom.models.llama.network import DecoderLayer, Llama

T, VOCAB = 16, 32
ROWS = ([5, 9, 2], [7, 1, 8])  # document lengths per packed row (row 1: a window starting mid-document)


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(n_layer=2, n_head=2, d_model=16, vocab_size=VOCAB, block_size=T)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(n_layer=2, n_head=4, n_kv_heads=2, d_model=32, intermediate_size=48, vocab_size=VOCAB,
                 block_size=T, rope_theta=10000.0)


NETS = {"gpt": (_gpt, Block), "llama": (_llama, DecoderLayer)}


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, pos) as the data side yields them: y is -100 where a target crosses a boundary."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (len(ROWS), T), generator=g)
    y = torch.randint(0, VOCAB, (len(ROWS), T), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ROWS])
    for b, lengths in enumerate(ROWS):
        for end in torch.tensor(lengths).cumsum(0)[:-1]:
            y[b, end - 1] = -100
    return x, y, pos


def _documents(b: int) -> list[slice]:
    ends = torch.tensor(ROWS[b]).cumsum(0).tolist()
    return [slice(e - n, e) for n, e in zip(ROWS[b], ends, strict=True)]


@pytest.mark.parametrize("name", NETS)
def test_a_packed_row_computes_each_document_alone(name):
    """(a) logits per document and (b) the loss as the token-weighted sum of the documents' own."""
    net = NETS[name][0]().eval()
    x, y, pos = _packed()
    with torch.no_grad():
        packed = net(x, pos)
        for b in range(len(ROWS)):
            total, tokens = 0.0, 0
            for doc in _documents(b):
                alone = net(x[b:b + 1, doc])  # positions from 0, today's causal path
                torch.testing.assert_close(packed[b:b + 1, doc], alone, atol=1e-5, rtol=0)
                n = int((y[b, doc] != -100).sum())  # 0: a one-token document has no target
                if n:
                    total, tokens = total + float(_lm_loss(alone, y[b:b + 1, doc])) * n, tokens + n
            row = float(_lm_loss(packed[b:b + 1], y[b:b + 1]))
            assert abs(row - total / tokens) < 1e-5, (row, total / tokens)


@pytest.mark.parametrize("name", NETS)
def test_one_document_is_the_causal_forward(name):
    """(c) pos = 0..T-1 on every row: the no-pos (SDPA is_causal) logits."""
    net = NETS[name][0]().eval()
    x = _packed()[0]
    with torch.no_grad():
        torch.testing.assert_close(net(x, torch.arange(T).expand_as(x)), net(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NETS)
def test_backward_with_and_without_activation_checkpointing(name):
    """(d) the same gradients with every layer checkpointed (the mask passes through the wrapper)."""
    make, unit = NETS[name]
    x, y, pos = _packed()
    grads = []
    for mode in ("none", "full"):
        net = make()
        assert apply_activation_checkpointing(net, (unit,), mode) == (0 if mode == "none" else 2)
        _lm_loss(net(x, pos), y).backward()
        grads.append({clean_name(n): p.grad for n, p in net.named_parameters()})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[0].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", NETS)
def test_bf16_forward_and_backward(name):
    net = NETS[name][0]().to(torch.bfloat16)
    x, y, pos = _packed()
    _lm_loss(net(x, pos), y).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_flex_attention_matches_the_dense_mask(dtype, tol):
    """FlexAttention's BlockMask (CUDA's path; forward only on CPU) and CPU's dense SDPA mask give
    the same attention, grouped-query heads included."""
    _, _, pos = _packed()
    assert document_ids(pos)[1].tolist() == [1] * 7 + [2] + [3] * 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(ROWS), 4, T, 8, generator=g).to(dtype)
    k, v = (torch.randn(len(ROWS), 2, T, 8, generator=g).to(dtype) for _ in range(2))
    with torch.no_grad():
        dense = attend(q, k, v, document_mask(pos, flex=False))
        flex = attend(q, k, v, document_mask(pos, flex=True))
    torch.testing.assert_close(flex.float(), dense.float(), atol=tol, rtol=0)


def _check(*args: str, packing: str = "documents") -> None:
    """models.check of a resolved cfg with `dataset.packing` set (the model group's check path)."""
    from loom import models, strategies
    from loom.pipeline import resolve

    cfg = resolve(["hardware=cpu", *args])
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        cfg.dataset.packing = packing
    models.check(cfg, strategies.layout_of(cfg))


def test_validation_refuses_what_cannot_mask_documents(tmp_path):
    """(e) exit 2, one paragraph naming the key and the fix; gpt and llama accepted."""
    from tests_helpers import make_hf_config

    _check("model=gpt_tiny")
    _check("model=llama_tiny", "strategy=fsdp", "hardware.devices=2")
    _check("model=gpt_tiny", "strategy=pp", "hardware.devices=2", packing="concat")
    hf = f"model.config={make_hf_config(tmp_path / 'hf', vocab_size=256)}"
    refusals = [
        (["model=hf_causal_lm", hf, "dataset.seq_len=64"], ["model=hf_causal_lm has no document mask",
                                                           "dataset.packing=concat", "model=gpt_*/llama*"]),
        (["model=gpt_tiny", "strategy=pp", "hardware.devices=2"], ["pipeline parallelism", "strategy.pp=2",
                                                                  "strategy=fsdp/fsdp_tp/ddp/zero*"]),
        (["model=gpt_tiny", "model.dropout=0.1"], ["model.dropout", "attention dropout"]),
    ]
    for args, needles in refusals:
        with pytest.raises(ConfigError) as e:
            _check(*args)
        msg = str(e.value)
        assert all(n in msg for n in needles) and "dataset.packing" in msg and len(msg.splitlines()) == 1, msg
    assert EXIT_INVALID == 2  # what the CLI exits with on a ConfigError


class _Loader:
    """An iterable of ready batches (a list would be taken apart by Lightning's CombinedLoader)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _TwoSources(pl.LightningDataModule):
    """Two validation loaders, one of them packed (x, y, pos): the data side's `val_names`."""

    val_names = ["web", "code"]

    def __init__(self, batches: dict[str, list]) -> None:
        super().__init__()
        self.batches = batches

    def val_dataloader(self) -> list:
        return [_Loader(self.batches[n]) for n in self.val_names]


def test_validation_logs_each_source_and_the_token_weighted_loss():
    """(f) val/loss/<name> per loader (its batches' mean) and val/loss over all their tokens."""
    from loom.models import build_module
    from loom.pipeline import resolve

    module = build_module(resolve(["hardware=cpu", "model=gpt_tiny", "model.n_layer=1", "dataset.seq_len=16"]))
    x, y, pos = _packed()
    y2 = y.clone()
    y2[0, :10] = -100  # fewer tokens in this batch: the weights matter
    batches = {"web": [Batch(x, y), Batch(x.flip(0), y.flip(0))], "code": [Batch(x, y2, pos, masked=True)]}
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=_TwoSources(batches))
    module.eval()
    with torch.no_grad():
        losses = {n: [(float(module._loss(b)), int(b.trained_targets())) for b in bs] for n, bs in batches.items()}
    got = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for n, ls in losses.items():
        assert abs(got[f"val/loss/{n}"] - sum(v for v, _ in ls) / len(ls)) < 1e-5, (n, got)
    every = [p for ls in losses.values() for p in ls]
    weighted = sum(v * c for v, c in every) / sum(c for _, c in every)
    assert abs(got["val/loss"] - weighted) < 1e-5, (got, weighted)
    assert set(got) == {"val/loss", "val/loss/web", "val/loss/code"}, got
