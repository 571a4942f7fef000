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


# Hydra's own keys of a `_target_` node: not constructor arguments.
HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")


def signature_problem(obj: Any, node: Any) -> tuple[str | None, str] | None:
    """(the offending argument's name or None, why) if calling `obj` with the node's keys would
    fail (an unknown or a missing argument), else None. Only names are bound, never values
    (they may be `${oc.env:...}` secrets), so a typo in a constructor argument is refused at
    validation instead of in every rank after the launch."""
    import difflib
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin or extension type without a signature
        return None
    keys = [str(k) for k in node.keys() if str(k) not in HYDRA_KEYS]
    args = node.get("_args_") or []
    bind = sig.bind_partial if node.get("_partial_") else sig.bind
    try:
        bind(*[None] * len(args), **dict.fromkeys(keys))
    except TypeError as e:
        accepted = [p.name for p in sig.parameters.values()
                    if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        takes = f"it accepts: {', '.join(accepted) or 'no arguments'}"
        unknown = [k for k in keys if k not in sig.parameters]
        if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            close = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return unknown[0], f"{unknown[0]!r} is not an argument of {{target}}{hint}; {takes}"
        return None, f"{{target}} cannot be called with these arguments ({e}); {takes}"
    return None
