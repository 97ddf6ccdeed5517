"""Running a job: process start (Slurm, local), the loop, checkpoints, preemption, exit
codes, what a run writes about itself (logs, metrics, events) and its report."""
