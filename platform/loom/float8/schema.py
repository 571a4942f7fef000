"""The schema of the float8 options (conf/float8/): one dataclass for every recipe."""

from __future__ import annotations

from dataclasses import dataclass, field

# float8=<name> -> torchao's recipe (None: no float8). tensorwise / rowwise / rowwise_with_gw_hp are
# `Float8LinearRecipeName` values (convert_to_float8_training); mxfp8 is torchao's MX path (Blackwell).
RECIPES: dict[str, str | None] = {
    "none": None,
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_with_gw_hp": "rowwise_with_gw_hp",
    "mxfp8": "mxfp8",
}


@dataclass
class Float8Config:
    """float8 training (torchao): which recipe, what stays in high precision, and how."""

    name: str = "none"
    all_gather: bool = False   # FSDP2 all-gathers float8 weights (tensorwise only)
    skip: list[str] = field(default_factory=lambda: ["lm_head", "score"])  # module-name suffixes kept high precision
    auto_filter: bool = True   # keep layers whose shapes gain nothing (torchtitan's auto_filter_small_kn)
    emulate: bool | None = None  # null: emulate on CPU, real float8 matmuls on a GPU
