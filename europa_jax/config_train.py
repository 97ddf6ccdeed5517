"""The train section of the run configuration (`train:` in a config file): steps,
logging, validation, downstream tasks, profiling, trackers and the resilience settings
(config.py holds the other sections and the checks across them). Imports no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from europa_jax.config_checks import ConfigError, positive

# The places `train.trackers` may send logged scalars to (records/trackers.py builds them).
TRACKERS = ("tensorboard", "wandb")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    log_every: int = 1
    seed: int = 0
    # Peak dense bf16 FLOP/s per device, per platform, for MFU. GH200 (H100-class Hopper):
    # 989 TFLOP/s dense bf16; the CPU figure is nominal (benchmarks measure the real one).
    peak_flops_per_device: dict[str, float] = field(
        default_factory=lambda: {"gpu": 989e12, "cpu": 1e11, "tpu": 918e12})
    run_dir: str = "runs/default"
    # Validation loss every N steps (0: never) on the first `eval_batches` batches of the
    # validation documents (data.validation_*): the same batches every time.
    eval_every: int = 0
    eval_batches: int = 2
    # Downstream evaluation (europa_jax/eval/, docs/evaluation.md): lm-eval-harness tasks
    # by name, scored every `eval_tasks_every` steps and at the end with the training
    # forward on the run's mesh. A name is looked up in `eval_tasks_dir`, then the shipped
    # task directory (europa_jax/eval/tasks), then lm_eval's own registry.
    eval_tasks: tuple[str, ...] = ()
    eval_tasks_every: int = 0
    eval_tasks_dir: str | None = None
    eval_tasks_limit: int | None = None  # documents per task (null: all)
    # Length of the evaluation forward's rows (data.global_batch_size of them): what
    # bounds its [rows per device, length, vocab] float32 logits. 0: data.seq_len.
    eval_tasks_seq_len: int = 0
    # A jax.profiler trace of steps [a, b] (1-based, inclusive) into <run_dir>/profile,
    # from process 0 or, with profile_all_processes, from each process.
    profile_steps: tuple[int, ...] = ()
    profile_all_processes: bool = False
    # Gradient accumulation: the global batch in this many pieces inside the step, each
    # holding its share of every device's rows (train.gradients): the same update as one
    # piece, with 1/microbatches of the activations and a weight gather per piece.
    microbatches: int = 1
    # Where logged scalars go besides metrics.jsonl (always written: the run's record), from
    # process 0 (records/trackers.py): TensorBoard event files in the run directory, and/or a
    # Weights & Biases run (the `wandb` extra), offline unless WANDB_MODE says otherwise.
    trackers: tuple[str, ...] = ("tensorboard",)
    # Stragglers (records/stragglers.py): a process whose own time for a step exceeds this ×
    # the median for `straggler_steps` logged steps in a row is an event (0: not measured).
    straggler_factor: float = 1.5
    straggler_steps: int = 3
    # The hang watchdog (job/watchdog.py): no progress for this long dumps every thread's
    # stack and exits for requeue. 0: 10 × the median step time, at least 600 s.
    hang_watchdog: bool = True
    hang_timeout_s: float = 0.0
    # JAX's persistent compilation cache (store/compile_cache.py): "" is JAX_COMPILATION_CACHE_DIR
    # when set, else <run_dir>/compile_cache; "none" turns it off.
    compile_cache_dir: str = ""

    def __post_init__(self):
        positive("train", self, "steps", "log_every", "eval_batches", "microbatches", "straggler_steps")
        if self.straggler_factor != 0 and not self.straggler_factor > 1:
            raise ConfigError(f"train.straggler_factor: {self.straggler_factor} must be > 1 "
                              "(a multiple of the median), or 0 for no straggler measurement")
        if not self.hang_timeout_s >= 0:
            raise ConfigError(f"train.hang_timeout_s: {self.hang_timeout_s} must be >= 0 "
                              "(0: 10 × the median step time, at least 600 s)")
        unknown = [t for t in self.trackers if t not in TRACKERS]
        if unknown or len(set(self.trackers)) != len(self.trackers):
            problem = f"unknown {unknown[0]!r}" if unknown else "a name repeated"
            raise ConfigError(f"train.trackers: {list(self.trackers)} has {problem}; expected "
                              f"a list of distinct names from: {', '.join(TRACKERS)} "
                              "(or [] for none)")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every: {self.eval_every} must be >= 0 (0: never)")
        self._check_eval_tasks()
        steps = self.profile_steps
        if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(f"train.profile_steps: {list(steps)} must be [first, last] with "
                              "1 <= first <= last, or [] for none")

    def _check_eval_tasks(self) -> None:
        """The downstream-evaluation keys agree with each other (whether each task exists
        is known only with lm_eval's index: europa_jax/eval/task_files.py, at startup)."""
        tasks = self.eval_tasks
        bad = [t for t in tasks if not isinstance(t, str) or not t.strip() or "," in t]
        if bad or len(set(tasks)) != len(tasks):
            problem = f"{bad[0]!r} is not a task name" if bad else "a name repeated"
            raise ConfigError(f"train.eval_tasks: {list(tasks)} has {problem}; expected a list "
                              "of distinct lm-eval task names, or [] for none")
        if self.eval_tasks_every < 0:
            raise ConfigError(f"train.eval_tasks_every: {self.eval_tasks_every} must be >= 0 "
                              "(0: never)")
        if tasks and not self.eval_tasks_every:
            raise ConfigError(f"train.eval_tasks: {list(tasks)} but train.eval_tasks_every is 0 "
                              "(off); set how many steps apart they run, or [] for no tasks")
        if self.eval_tasks_every and not tasks:
            raise ConfigError(f"train.eval_tasks_every: {self.eval_tasks_every} but "
                              "train.eval_tasks is empty; name the tasks to run")
        if self.eval_tasks_limit is not None and not self.eval_tasks_limit > 0:
            raise ConfigError(f"train.eval_tasks_limit: {self.eval_tasks_limit} must be "
                              "positive, or null for every document")
        if self.eval_tasks_seq_len < 0:
            raise ConfigError(f"train.eval_tasks_seq_len: {self.eval_tasks_seq_len} must be "
                              ">= 0 (0: data.seq_len)")
        if self.eval_tasks_dir is not None and not str(self.eval_tasks_dir).strip():
            raise ConfigError("train.eval_tasks_dir: '' is not a directory (null for none)")
