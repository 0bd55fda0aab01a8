"""Where a run goes and what it needs there: the placement plan of every Ray actor (:mod:`.placement`), the
per-GPU memory estimate of that plan (:mod:`.memory`), the Ray connection with token authentication
(:mod:`.ray_setup`) and the preflight of a recipe against this machine or Ray cluster (:mod:`.preflight`)."""
