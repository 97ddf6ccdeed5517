"""The process: starting jax and the distributed runtime (Slurm, local), logs, exit codes,
preemption signals, a lost peer, the hang watchdog. Knows nothing of the run directory
or the loop."""
