"""The one declared type every dataset option yields and every model reads: `Batch`.

A dataset's sample is a `Batch` of one (unbatched tensors); the DataModule's loaders stack
samples with `collate`, so a model's training_step receives a `Batch` of `dataset.batch_size`
and reads it by field: no telling a batch's kind by its length or by being a dict.
Lightning moves it to the device as it is (lightning_utilities' apply_to_collection copies a
dataclass field by field) and the DataLoader pins it (`pin_memory`).

A user's own LightningModule (`model=custom`) receives it too: it unpacks as `x, y = batch`
(inputs, targets), as the (features, label) and (tokens, next tokens) tuples did, and its
other fields are there by name.

Torch-free at import (the launcher imports `loom.data` before torch): tensors are typed by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

IGNORE_INDEX = -100  # a target the loss leaves out (torch's cross_entropy ignore_index)
TENSORS = ("inputs", "targets", "positions", "loss_scale", "reference")  # the fields `collate` stacks


@dataclass
class Batch:
    """One micro batch (or, from a dataset's __getitem__, one sample without the batch dim)."""

    inputs: Any                # "torch.Tensor" (B, T) int64 token ids, or (B, ...) float features
    targets: Any               # (B, T) int64 next tokens (IGNORE_INDEX: not trained), or (B,) int64 classes
    positions: Any = None      # (B, T) int64 position in its document (dataset.packing=documents): the mask
    loss_scale: Any = None     # (B,) float32: chat's factor making the loss the global batch's token mean
    #                            (loom.data.sampler); NaN: the micro batch's own token mean (validation)
    reference: Any = None      # (B, 2) float32: a preference pair's precomputed reference log-probs of
    #                            (chosen, rejected), summed over the completion's targets; NaN: not precomputed
    masked: bool = False       # targets hold IGNORE_INDEX (prompts, padding, document boundaries): the
    #                            trained tokens differ from the tokens processed (loom.tracking.trained)
    pairs: bool = False        # preference pairs (dataset=preference): inputs and targets are (B, 2, T),
    #                            [:, 0] the chosen and [:, 1] the rejected completion of each pair, so the
    #                            two always share a micro batch and a rank

    def __iter__(self) -> Iterator[Any]:
        """`x, y = batch`: (inputs, targets), for a user's own LightningModule. Loom reads fields."""
        return iter((self.inputs, self.targets))

    def pin_memory(self) -> Batch:
        """The DataLoader's pin_memory=True calls this for a type it does not know."""
        return replace(self, **{k: getattr(self, k).pin_memory() for k in TENSORS if getattr(self, k) is not None})

    def trained_targets(self) -> Any:
        """The targets the loss trains (a device tensor; no host sync)."""
        return (self.targets != IGNORE_INDEX).sum()


def collate(samples: list[Batch]) -> Batch:
    """The loaders' collate_fn: samples stacked field by field into one Batch."""
    from torch.utils.data import default_collate  # stacks into shared memory in a loader's worker

    first = samples[0]
    stacked = {k: None if getattr(first, k) is None else default_collate([getattr(s, k) for s in samples])
               for k in TENSORS}
    rest = {f.name: getattr(first, f.name) for f in fields(Batch) if f.name not in TENSORS}
    return Batch(**stacked, **rest)
