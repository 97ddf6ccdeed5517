"""Every test runs on 8 CPU devices (set before jax creates its backends), and the whole
session shares one jax compilation cache.

Many tests compile the same tiny train step (in-process and in the `europa-jax` processes
they start); after the first, XLA's executable is read back from the cache instead of
compiled again. The cache lives in a fresh directory for each session — every xdist
worker and every subprocess gets it through the environment — and is removed at the end,
so nothing carries over between runs. Results a test computes once for every worker (a
program compiled for GH200, `computed_once`) live beside it, in a store made the same way.

XLA:CPU's LLVM backend runs at -O0 in the test session (and in every process a test
starts): the tests check what the programs compute, not how fast they run, and LLVM's
optimization of the CPU kernels is a large share of compiling a tiny step, which the suite
does hundreds of times (about a sixth of the suite's wall time). Results differ from the
optimized levels only in rounding. A level already in XLA_FLAGS is kept:
`XLA_FLAGS=--xla_backend_optimization_level=3 pytest` tests the optimized kernels.
"""

import dataclasses
import fcntl
import hashlib
import os
import pickle
import shutil
import tempfile
from pathlib import Path

OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith(DEVICE_COUNT_FLAG)]  # xdist workers inherit the controller's
if not any(f.startswith(OPT_LEVEL_FLAG) for f in _flags):
    _flags.append(f"{OPT_LEVEL_FLAG}=0")
# For processes that size their own CPU devices (the CLI, multi-process drivers).
PROCESS_XLA_FLAGS = " ".join(_flags)
os.environ["XLA_FLAGS"] = f"{PROCESS_XLA_FLAGS} {DEVICE_COUNT_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Made by the first process of the run; xdist's workers (started later) inherit it.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="europa-jax-test-cache-")
_OWN_STORE = "EUROPA_JAX_TEST_STORE" not in os.environ
if _OWN_STORE:
    os.environ["EUROPA_JAX_TEST_STORE"] = tempfile.mkdtemp(prefix="europa-jax-test-store-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from europa_jax.config_loader import load_config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The files that take 40 s or more on 2 cores (multi-process runs, whole-model and GPU-target
# compiles), longest first (the whole suite's junit times). xdist hands out whole files
# (`--dist loadfile`, in collection order with `--no-loadscope-reorder`), so starting these
# first lets the two workers finish together instead of one running a slow file alone at
# the end. test_qk_clip, test_fp8_dispatch and test_gpu_step_classes read test_gpu_target's
# GH200 compiles (computed_once): they start after it has begun. Order only: every test runs.
LONGEST_FILES = (
    "test_gpu_target.py", "test_checkpoint.py", "test_mtp.py", "test_resilience.py",
    "test_history.py", "test_microbatches.py", "test_qk_clip.py", "test_fp8_dispatch.py",
    "test_train.py", "test_downstream_eval.py", "test_sample.py", "test_context_parallel.py",
    "test_plan.py", "test_layer_input.py", "test_gpu_interpreter.py",
    "test_rows_per_device.py", "test_cross_node_experts.py", "test_peer_lost.py",
    "test_export.py", "test_layout_search.py", "test_gpu_step_classes.py", "test_comm.py",
    "test_fp8_linear.py", "test_gpu_check.py", "test_gpu_smoke.py", "test_decode.py",
    "test_trackers.py", "test_spikes.py", "test_watch.py", "test_seq_aux_loss.py",
    "test_corpora_end_to_end.py", "test_tiny_run.py", "test_launch_local.py",
    "test_expert_windows.py", "test_offload.py", "test_moe.py", "test_lm_head.py")


def pytest_collection_modifyitems(config, items):
    """Longest files first; within a file, and among the others, the order stays."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session):
    """The run's cache goes with it (a cache set from outside is left alone)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    if _OWN_STORE:
        shutil.rmtree(os.environ["EUROPA_JAX_TEST_STORE"], ignore_errors=True)


_computed: dict[str, object] = {}


def computed_once(name: str, key, compute):
    """compute()'s result for `key` (anything with a stable repr, e.g. a Config), computed
    once a session by whichever xdist worker asks first; the others wait on its lock and
    read it back (pickled in the session's store). For results that take minutes, such as
    a program compiled for GH200, that tests in several files read."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    name = f"{name}-{digest}"
    if name not in _computed:
        path = Path(os.environ["EUROPA_JAX_TEST_STORE"]) / f"{name}.pickle"
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if path.exists():
                _computed[name] = pickle.loads(path.read_bytes())
            else:
                _computed[name] = compute()
                partial = path.with_suffix(".partial")
                partial.write_bytes(pickle.dumps(_computed[name]))
                partial.replace(path)
    return _computed[name]


def process_env(*without: str) -> dict:
    """This session's environment for a process that sizes its own CPU devices: XLA_FLAGS
    without the 8-device flag (the optimization level stays); `without` drops more keys."""
    env = {k: v for k, v in os.environ.items() if k not in without}
    env["XLA_FLAGS"] = PROCESS_XLA_FLAGS
    return env


def config_path(name: str) -> str:
    return os.path.join(REPO, "configs", name)


@pytest.fixture(scope="session")
def tiny_cfg():
    """tiny-cpu shrunk further so one compiled step takes seconds on 2 cores."""
    cfg = load_config(config_path("tiny-cpu.yaml"))
    model = dataclasses.replace(cfg.model, d_model=32, q_lora_rank=16, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                dense_ffn_dim=64, expert_ffn_dim=16)
    execution = dataclasses.replace(cfg.execution, attention_block_size=16)
    data = dataclasses.replace(cfg.data, seq_len=64, global_batch_size=8, max_documents=40,
                               validation_fraction=0.0)
    train = dataclasses.replace(cfg.train, steps=10, eval_every=0)
    return dataclasses.replace(cfg, model=model, execution=execution, data=data, train=train)


def split_changes(model, execution, **changes):
    """(model, execution): a ModelConfig and an ExecutionConfig with each of `changes` set
    in the one that has the key — what the model is, or how it runs."""
    parts = {"model": (model, {}), "execution": (execution, {})}
    for key, value in changes.items():
        (part,) = [p for p, (obj, _) in parts.items() if key in obj.__dataclass_fields__]
        parts[part][1][key] = value
    return tuple(dataclasses.replace(obj, **kw) for obj, kw in parts.values())


def with_settings(cfg, **changes):
    """`cfg` (a Config) with each of `changes` set in its model or execution section."""
    model, execution = split_changes(cfg.model, cfg.execution, **changes)
    return dataclasses.replace(cfg, model=model, execution=execution)


def train_for(cfg, steps):
    """Train `steps` steps from seed 0 on the config's mesh: (final state, losses)."""
    import jax

    from europa_jax.run import loop
    from europa_jax.parallel import sharding
    from europa_jax.train import train

    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, seed=0)
    step = train.jit_train_step(trainer)
    losses = []
    with jax.set_mesh(mesh):
        for _, (_, batch) in zip(range(steps), loop.device_batches(
                trainer, loop.host_batch_iterator(cfg))):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return state, losses


def split_padding(padded, shape):
    """(the leading `shape` part of a zero-padded stored array, the padding's values)."""
    import numpy as np

    used = tuple(slice(0, n) for n in shape)
    rest = np.ones(padded.shape, bool)
    rest[used] = False
    return padded[used], padded[rest]


def saved_state(run_dir, step=None):
    """Leaf key → array of a checkpoint (the last one by default)."""
    from europa_jax.store import saved_checkpoints

    step = step if step is not None else saved_checkpoints.committed_steps(run_dir)[-1]
    step_dir = saved_checkpoints.checkpoint_dir(run_dir) / str(step)
    keys = saved_checkpoints.read_meta(step_dir)["fingerprint"]
    return {k: saved_checkpoints.open_saved_array(step_dir, k).read().result()
            for k in keys if k.startswith("params.") or k == "router_bias_LE"}


def nested_params(state):
    """A checkpoint's `params.*` leaves (saved_state) as the model's nested tree."""
    import jax.numpy as jnp

    params = {}
    for key, value in state.items():
        if key.startswith("params."):
            *parents, leaf = key.split(".")[1:]
            node = params
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = jnp.asarray(value)
    return params


def rows_with_documents(cfg):
    """Packed rows from the real pipeline: one holding a single document, two holding several."""
    import numpy as np

    from europa_jax.run import loop

    single, several = [], []
    for batch in loop.host_batch_iterator(cfg):
        for b in range(batch["tokens"].shape[0]):
            n_docs = len(np.unique(batch["segment_ids"][b]))
            (several if n_docs > 1 else single).append({k: v[b] for k, v in batch.items()})
        if single and len(several) >= 2:
            rows = single[:1] + several[:2]
            return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def objective_gradients(cfg, batch, state, microbatches=1, **changes):
    """((loss, stats), gradients) of `train.gradients` for `cfg` with `changes` of the model
    or its execution (e.g. seq_aux_loss_weight=0.5, fp8_gemms="block", `with_settings`) in
    `microbatches`, as host arrays."""
    import jax

    from europa_jax.parallel import offload, sharding
    from europa_jax.train import train

    cfg = dataclasses.replace(with_settings(cfg, **changes),
                              train=dataclasses.replace(cfg.train, microbatches=microbatches))
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))

    def grads(state, batch):
        params = offload.to_device(state.params, trainer.state_shardings.params)
        return train.gradients(trainer, params, state.router_bias_LE, batch)

    with jax.set_mesh(trainer.mesh):
        return jax.device_get(jax.jit(grads)(state, batch))


def first_batch_and_initial_state(cfg):
    """The config's first global batch on its mesh and a seed-0 train state."""
    import jax

    from europa_jax.parallel import sharding
    from europa_jax.run import loop
    from europa_jax.train import train

    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    with jax.set_mesh(trainer.mesh):
        _, batch = next(iter(loop.device_batches(trainer, loop.host_batch_iterator(cfg))))
    return batch, train.init_state(trainer, seed=0)


def gh200_program_text(fn, *args) -> str:
    """The optimized HLO of `jax.jit(fn)` on `args` (shapes) compiled for 4 GH200s of one
    node, replicated (plan/program/gpu_target.py): what a GPU would run, compiled without one."""
    import jax
    import numpy as np

    from europa_jax.plan.program import gpu_target

    devices = gpu_target.topology(gpu_target.TARGETS["gh200"], 4)
    mesh = jax.sharding.Mesh(np.array(devices), ("gpus",))
    with gpu_target.lowering(mesh):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        lowered = jax.jit(fn, in_shardings=replicated).lower(*args)
        return gpu_target.compile_lowered(lowered, mesh).as_text()


def cli(*args, env=None, timeout=900, **popen):
    """`europa-jax ARGS` in its own process from the repository root: the finished process
    (stdout, stderr, returncode), for the tests whose subject is the process boundary."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "europa_jax.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env, **popen)


def assert_trees_close(actual, expected, rtol, atol=0.0):
    """Two pytrees of the same structure hold the same values within the tolerances; a
    failure names the leaf by its path."""
    import jax
    import numpy as np

    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                            jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def train_in_process(run_dir, overrides=(), config="tiny-cpu.yaml"):
    """`europa-jax train CONFIG --set OVERRIDES --run-dir RUN_DIR`, run by the loop in this
    process (the 8 test devices), with `train.eval_tasks` evaluated as the CLI has them: the
    config it trained. For tests that need a trained run directory, not the process around it."""
    from europa_jax.cli import task_evaluation
    from europa_jax.run import loop

    cfg = load_config(config_path(config), list(overrides))
    loop.train(cfg, run_dir, tasks=task_evaluation(cfg))
    return cfg
