"""`model=custom`: your own LightningModule, or an nn.Module + a loss, by `_target_`.

Validation (`check_target`) imports the target's module — the user's code, which may import
torch; Loom itself does not — and looks at the class's MRO by name, so it needs no torch of
its own: a class must be a pytorch_lightning LightningModule or a torch.nn.Module. A function
(a factory) is accepted there and its result is checked when the worker builds it. The
allow-list (loom.target_allowlist, `security.allow_targets`) was checked before anything is imported.
"""

from __future__ import annotations

from typing import Any

LIGHTNING = "pytorch_lightning.core.module.LightningModule"
LIGHTNING_UNIFIED = "lightning.pytorch.core.module.LightningModule"
NN_MODULE = "torch.nn.modules.module.Module"


def locate(target: str) -> Any:
    """The object a dotted path names (Hydra's own resolution: modules, then attributes)."""
    from hydra._internal.utils import _locate

    return _locate(target)


def kind_of(obj: Any) -> str | None:
    """'lightning' | 'module' | 'factory' | None (not usable)."""
    if isinstance(obj, type):
        names = {f"{c.__module__}.{c.__qualname__}" for c in obj.__mro__}
        if LIGHTNING in names:
            return "lightning"
        if LIGHTNING_UNIFIED in names:
            return "lightning_unified"
        if NN_MODULE in names:
            return "module"
        return None
    return "factory" if callable(obj) else None


def instantiate(node: Any) -> Any:
    from hydra.utils import instantiate as hydra_instantiate

    return hydra_instantiate(node, _convert_="all")
