"""`dataset=digits`: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes),
for classifier runs. The torch half (`sets.py`) builds the arrays; this half is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from loom.data.checks import val_every
from loom.data.fingerprint import no_inputs
from loom.data.option import DatasetOption, always

N_SAMPLES, FEATURES, CLASSES = 1797, 64, 10  # scikit-learn's 8x8 digits


@dataclass
class DigitsDatasetConfig:
    name: str = "digits"
    batch_size: int = 32
    val_every: int = 5                # every Nth sample goes to validation (0: none)


def val_size(ds: DictConfig) -> int | None:
    off = val_every(ds)
    return off if off is not None else N_SAMPLES // ds.val_every


OPTION = DatasetOption(DigitsDatasetConfig, "loom.data.options.digits.sets:datasets", always(False), no_inputs,
                       lambda ds: "scikit-learn's 8x8 digits", val_size=val_size,
                       features=lambda ds: (FEATURES, CLASSES), packages=("sklearn",))
