"""The files of a run dir (DESIGN.md "Run identity and the run directory"): the frozen config,
checkpoints and summary.json. Base modules: every stage reads them, none of them imports a stage."""
