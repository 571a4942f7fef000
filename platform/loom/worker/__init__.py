"""Stage 6, worker: what every rank runs on the frozen run dir (forked by `loom.worker.agent`, or
`python -m loom.worker <run_dir>`).

`main.py` sets the process up (logging, threads, the process group), `fit.py` builds the
Trainer from the config groups and trains, `results.py` writes the rank-0 results
(summary.json, final weights, plots), `checkpoint_saver.py` checkpoints during training.
"""
