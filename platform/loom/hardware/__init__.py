"""Hardware profiles (conf/hardware/): the schema and checks of a profile (`check`), whether
this machine can run it (`machine`), its datasheet peaks (`peaks`), and a GPU profile's device
fields re-derived for `hardware.accelerator=cpu` (`derive`). Torch-free: runs in the launcher
before anything heavy is imported."""

from loom.hardware.checks import check, normalize
from loom.hardware.schema import SCHEMAS
from loom.packages import TRAINING, Need

# This group's rows of loom.packages' table: a launcher that submits through a package of its own.
NEEDS: tuple[Need, ...] = (
    Need("hardware.launcher=kubernetes (hardware=kubernetes)", lambda cfg: cfg.hardware.launcher == "kubernetes",
         "kubeflow_trainer_api", example=("hardware=kubernetes",), checked=TRAINING),
)

__all__ = ["NEEDS", "SCHEMAS", "check", "normalize"]
