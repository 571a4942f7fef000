"""`loom data prepare`: text, JSON lines, CSV, parquet (optionally .gz / .zst) or Hugging Face
datasets tokenized in parallel into a Megatron-format token store (loom.data.store), the same
bytes whatever the worker count, resumable, visible only when complete. Torch-free.

The training front ends (text_files, tinycode, hf) describe their documents as work units
(`file_doc_units`, `hf_row_units`) and call `prepare`; the CLI uses `units_for_inputs`.
`tokenizer_fingerprint` is the one fingerprint stores and runs compare.
"""

from __future__ import annotations

from loom.data.prepare.encoding import TokenSpec, token_spec, tokenizer_fingerprint
from loom.data.prepare.run import prepare
from loom.data.prepare.units import file_doc_units, hf_row_units, units_for_inputs
from loom.data.prepare.workunit import InputUnit

__all__ = ["InputUnit", "TokenSpec", "file_doc_units", "hf_row_units", "prepare", "token_spec",
           "tokenizer_fingerprint", "units_for_inputs"]
