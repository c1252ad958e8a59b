"""One module per job: a pure plan function and a thin ``run()``."""
