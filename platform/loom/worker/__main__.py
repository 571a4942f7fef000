"""`python -m loom.worker <run_dir>`: one rank by hand, or under a plain torchrun (Loom's launches
fork their ranks from loom.worker.agent's forkserver instead: loom.worker.main.forked_rank)."""

import sys

from loom.worker.main import main

sys.exit(main())
