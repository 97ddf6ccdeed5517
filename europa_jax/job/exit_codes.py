"""Process exit codes of `europa-jax`: the contract with launch scripts (see README).

A Slurm script requeues on `PREEMPTED` (the state was saved; the next run resumes by
itself) and must not requeue on the others, which a rerun would only repeat.
"""

OK = 0
CRASH = 1  # an uncaught exception (Python's own code): a bug or a hardware fault; or a
# checkpoint that could not be written (a full disk: one line names the last good one)
BAD_INPUT = 2  # config, command line, checkpoint or weights a user must fix, a run
# directory another command holds (run_lock.py), one whose checkpoints are gone (history.py),
# or a corpus shard that changed while the run read it (a `data_error` event)
NONFINITE = 3  # NaN/Inf loss or gradient under `checkpoint.nan_policy`, or loss spikes that
# rolling back did not cure (spikes.py); the last good checkpoint kept
PREEMPTED = 75  # SIGTERM/SIGUSR1: every process saved the same step; requeue (sysexits EX_TEMPFAIL).
# Also one before the first step (preemption.py) and a hang the watchdog broke
# (watchdog.py): nothing saved, the requeue resumes from the last checkpoint
INTERRUPTED = 130  # Ctrl-C (SIGINT; 128 + 2, the shell's code): the step finished and was
# saved, the same command resumes; before the first step, or a second Ctrl-C, it quits at
# once, nothing more saved
