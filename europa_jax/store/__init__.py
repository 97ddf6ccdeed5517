"""The run directory on disk: the Orbax checkpoint manager and reading committed
checkpoints without devices, what a save's outcome was, the run's history of tries, its
lock, the compilation cache, what changed on resume."""
