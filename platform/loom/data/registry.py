"""One registry of the dataset options: each `dataset=` option -> its `DatasetOption`
(loom.data.option), in the order `loom` lists them.

Adding a dataset option = its module or folder under `data/options/` (schema, checks, normalize,
constants, `datasets(cfg) -> (train, val)` and the `OPTION` it ends with), its yaml in
conf/dataset/, and one line here. Nothing else names it (tests/test_data_options.py).
"""

from __future__ import annotations

from loom.data.option import DatasetOption
from loom.data.options import chat, digits, hf, preference, synthetic, text_files, tinycode, tokens

OPTIONS: tuple[DatasetOption, ...] = (
    tokens.OPTION,
    tinycode.OPTION,
    text_files.OPTION,
    hf.OPTION,
    chat.OPTION,
    preference.OPTION,
    digits.OPTION,
    synthetic.OPTION,
)
DATASETS: dict[str, DatasetOption] = {option.name: option for option in OPTIONS}
