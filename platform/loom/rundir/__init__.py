"""The files of a run dir (README "What a run writes"): the frozen config,
checkpoints and summary.json. Base modules: every stage reads them, none of them imports a stage."""
