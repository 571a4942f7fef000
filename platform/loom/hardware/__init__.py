"""Hardware profiles (conf/hardware/): the schema and checks of a profile (`check`), whether
this machine can run it (`machine`), its datasheet peaks (`peaks`), and a GPU profile's device
fields re-derived for `hardware.accelerator=cpu` (`derive`). Torch-free: runs in the launcher
before anything heavy is imported."""

from loom.hardware.checks import check, normalize
from loom.hardware.schema import SCHEMAS

__all__ = ["SCHEMAS", "check", "normalize"]
