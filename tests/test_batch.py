"""The declared batch (loom.data.batch.Batch): every dataset option's loader yields one with the
declared fields and dtypes, Lightning's device transfer keeps it one, a user's LightningModule
unpacks it as (inputs, targets), and the models' loss reads it by field."""

from __future__ import annotations

import importlib.util

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from chat_helpers import CHATML, make_chat_tokenizer, write_chats

from loom.data.batch import IGNORE_INDEX, Batch, collate
from loom.pipeline import resolve

SEQ = 32


def _first_batch(overrides: list[str]) -> tuple[Batch, int, int]:
    """The first training micro batch of rank 0 of 2 data-parallel ranks, as the run's loader yields it."""
    from loom.data import build_datamodule
    from loom.strategies import layout_of

    cfg = resolve(["hardware=cpu", "hardware.dataloader_workers=0", *overrides])
    dm = build_datamodule(cfg, layout_of(cfg, world=2), 0)
    dm.prepare_data()
    dm.setup("fit")
    return next(iter(dm.train_dataloader())), int(cfg.dataset.batch_size), int(cfg.dataset.get("seq_len") or 0)


def _options(tmp_path) -> dict[str, list[str]]:
    cache = f"dataset.cache_dir={tmp_path / 'cache'}"
    tok = make_chat_tokenizer(tmp_path / "tok", CHATML, eos="<|im_end|>")
    chat = ["dataset=chat", f"dataset.path={write_chats(tmp_path / 'chats.jsonl', 40)}", f"dataset.tokenizer={tok}",
            "model=llama_tiny", "dataset.seq_len=128", "dataset.batch_size=2", "dataset.val_every=0", cache]
    return {
        "synthetic_tokens": ["dataset=synthetic", "dataset.num_samples=100", f"dataset.seq_len={SEQ}"],
        "synthetic_tensors": ["dataset=synthetic", "dataset.kind=tensors", "dataset.shape=[2,3]",
                              "dataset.num_samples=100", "model=mlp"],
        "digits": ["dataset=digits", "model=mlp"],
        "tinycode": ["dataset.max_bytes=300000", f"dataset.seq_len={SEQ}", "dataset.batch_size=4", cache],
        "tinycode_documents": ["dataset.max_bytes=300000", f"dataset.seq_len={SEQ}", "dataset.batch_size=4",
                               "dataset.packing=documents", cache],
        "chat_padded": chat,
        "chat_documents": [*chat, "dataset.packing=documents"],
    }


# (tokens, positions, loss scale): what each option's batch declares
DECLARED = {"synthetic_tokens": (True, False, False), "synthetic_tensors": (False, False, False),
            "digits": (False, False, False), "tinycode": (True, False, False),
            "tinycode_documents": (True, True, False), "chat_padded": (True, False, True),
            "chat_documents": (True, True, True)}


@pytest.mark.parametrize("option", list(DECLARED))
def test_every_option_yields_a_batch_with_the_declared_fields(tmp_path, option):
    if option == "digits" and importlib.util.find_spec("sklearn") is None:
        pytest.skip("scikit-learn is not installed")
    b, micro, seq = _first_batch(_options(tmp_path)[option])
    tokens, positions, scale = DECLARED[option]
    assert isinstance(b, Batch)
    assert b.targets.dtype == torch.int64 and b.inputs.shape[0] == b.targets.shape[0] == micro
    if tokens:
        assert b.inputs.dtype == torch.int64 and b.inputs.shape == b.targets.shape == (micro, seq)
    else:
        assert b.inputs.dtype == torch.float32 and b.targets.shape == (micro,)
    assert (b.positions is not None) == positions and (b.loss_scale is not None) == scale
    assert b.masked == (positions or scale)  # targets that may be -100: trained tokens are counted
    if positions:
        assert b.positions.dtype == torch.int64 and b.positions.shape == (micro, seq)
        assert (b.positions[:, 0] == 0).all() or (b.positions.diff(dim=1) != 1).any()  # restarts at documents
    if scale:  # the sampler's factor of the step's global batch: one value, finite in training
        assert b.loss_scale.dtype == torch.float32 and b.loss_scale.shape == (micro,)
        assert torch.isfinite(b.loss_scale).all() and (b.loss_scale == b.loss_scale[0]).all()
        assert (b.targets == IGNORE_INDEX).any()  # the prompts are not trained


def test_lightning_moves_a_batch_as_a_batch_and_a_user_module_unpacks_it():
    """Lightning's transfer (apply_to_collection over the dataclass's fields) keeps the type and
    every field; a user's LightningModule written for (x, y) tuples trains on it unchanged."""
    from lightning_fabric.utilities.apply_func import move_data_to_device

    x, y = torch.randint(0, 9, (2, 4)), torch.randint(0, 9, (2, 4))
    b = Batch(x, y, positions=torch.arange(4).repeat(2, 1), loss_scale=torch.full((2,), 0.5), masked=True)
    moved = move_data_to_device(b, torch.device("meta"))
    assert isinstance(moved, Batch) and moved.masked and b.inputs.device.type == "cpu"
    assert all(getattr(moved, k).device.type == "meta" and getattr(moved, k).shape == getattr(b, k).shape
               for k in ("inputs", "targets", "positions", "loss_scale"))

    seen = []

    class UserModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 2)

        def training_step(self, batch, batch_idx):
            seen.append(type(batch))
            features, label = batch  # the tuple a user's module was written for
            return F.cross_entropy(self.net(features), label)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    samples = [Batch(torch.randn(3), torch.tensor(i % 2)) for i in range(8)]
    loader = torch.utils.data.DataLoader(samples, batch_size=4, collate_fn=collate)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(UserModule(), train_dataloaders=loader)
    assert seen == [Batch, Batch]


def _module(*overrides: str):
    from loom.models import build_module

    module = build_module(resolve(["hardware=cpu", *overrides]))
    module.configure_model()
    return module.eval()


def test_the_loss_of_a_batch_is_the_one_computed_by_hand():
    """Plain tokens: the mean over trained targets; positions: the network's document mask; a loss
    scale: the summed loss times the scale (NaN: the batch's own mean); classes: cross entropy."""
    module = _module("model=gpt_tiny", "model.n_layer=1", f"dataset.seq_len={SEQ}")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, SEQ), generator=g), torch.randint(0, 256, (2, SEQ), generator=g)
    y[0, :5] = IGNORE_INDEX
    pos = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).repeat(2, 1)
    with torch.no_grad():
        logits, masked = module.model(x), module.model(x, pos)
        flat = lambda out: (out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))  # noqa: E731
        mean, total = F.cross_entropy(*flat(logits)), F.cross_entropy(*flat(logits), reduction="sum")
        assert torch.allclose(module._loss(Batch(x, y)), mean)
        assert torch.allclose(module._loss(Batch(x, y, pos, masked=True)), F.cross_entropy(*flat(masked)))
        assert not torch.allclose(F.cross_entropy(*flat(masked)), mean)  # the positions were used
        scaled = module._loss(Batch(x, y, loss_scale=torch.full((2,), 0.01), masked=True))
        assert torch.allclose(scaled, total * 0.01)
        own = module._loss(Batch(x, y, loss_scale=torch.full((2,), float("nan")), masked=True))
        assert torch.allclose(own, mean)

    mlp = _module("model=mlp", "dataset=synthetic", "dataset.kind=tensors", "dataset.shape=[8,8]")
    f, c = torch.randn(4, 64, generator=g), torch.tensor([0, 3, 9, 1])
    with torch.no_grad():
        assert torch.allclose(mlp._loss(Batch(f, c)), F.cross_entropy(mlp.model(f).float(), c))


def test_trained_tokens_are_counted_for_masked_batches_only():
    from loom.tracking.trained import TrainedTokens

    y = torch.tensor([[1, IGNORE_INDEX, 2], [IGNORE_INDEX, IGNORE_INDEX, 3]])
    counter = TrainedTokens()
    counter.add(Batch(y, y))  # every token a target: nothing to report beside tokens/s
    assert counter.take() != counter.take()  # NaN
    counter.add(Batch(y, y, masked=True))
    counter.add(Batch(y, y, masked=True))
    assert counter.take() == 6
