"""One registry of the model options: each `model=` option -> its family (loom.models.family).

Adding a family = its folder (`models/<family>/`: `__init__.py` builds a `ModelFamily`, torch
half in `network.py` / `module.py`), its yamls in conf/model/, and one line in FAMILIES.
"""

from __future__ import annotations

from loom.models import checks, gpt, hf, init_from, llama, moe, spec
from loom.models.family import ModelFamily
from loom.models.schema import CustomModelConfig, MLPModelConfig

MLP = ModelFamily(name="mlp", options=("mlp",), schema=MLPModelConfig, check=checks.check_mlp, spec=spec.mlp_spec,
                  build="loom.models.build:mlp", shapes=lambda cfg: init_from.mlp_shapes(cfg.model),
                  summary="a small MLP classifier for feature datasets (digits, synthetic tensors)",
                  normalize=checks.normalize_mlp, largest=spec.mlp_largest)
CUSTOM = ModelFamily(name="custom", options=("custom",), schema=CustomModelConfig, check=checks.check_custom,
                     spec=spec.custom_spec, build="loom.models.build:custom", shapes=init_from.custom_shapes,
                     summary="your own LightningModule or nn.Module (`model.module._target_`)",
                     normalize=checks.normalize_custom, built_on_host=lambda cfg: True)  # its own __init__ allocates

FAMILIES: tuple[ModelFamily, ...] = (gpt.FAMILY, llama.FAMILY, moe.FAMILY, hf.FAMILY, MLP, CUSTOM)
MODELS: dict[str, ModelFamily] = {option: family for family in FAMILIES for option in family.options}
