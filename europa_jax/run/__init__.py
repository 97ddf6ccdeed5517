"""The training run's loop: batches → step, resume, saves, guards (non-finite, spikes),
validation, the profiler window, and how a run ends (outcome → exit code). Built on the
process (job/), the run directory (store/) and what a run records (records/)."""
