"""`python -m loom.worker <run_dir>`: what torchrun (and srun, through torchrun) starts on every rank."""

import sys

from loom.worker.main import main

sys.exit(main())
