"""The first GPU minutes: does the real train step run on a GPU and agree with the CPU?

    python benchmarks/gpu_smoke.py [--json gpu_smoke.json] [--steps 2] [--cpu-smoke]
                                   [--cpu-timeout SECONDS]

1. **One GPU against the CPU.** europa-952b at its widths (d_model 7,168, 64 MLA heads,
   expert width 1,920) reduced to two MoE layers of 16 experts (routed top-8 in its 4
   groups, two per token), a 32,768 vocabulary and 2,048-token rows, with the shipped
   offload (optimizer state and layer inputs in host memory) and bf16 compute, trains
   `--steps` steps with the real train step (`train.py`'s jitted step: Muon, offload, the
   library kernels the platform takes) on one GPU, and the same config on the same
   batches on this machine's CPU. Per step the losses and gradient norms must agree
   within TOLERANCE, and nothing may be non-finite: not a loss, not a gradient norm, not
   a parameter or optimizer state after the last step. The GPU program's library kernels
   (tokamax's grouped matmul and flash attention) are listed from its HLO: a GPU program
   without them (XLA's dense stand-ins) fails.
2. **Four GPUs: the ragged exchange against the dense one.** The same model with 64
   experts over `expert=4` (16 and one routing group per GPU, as europa-952b's node) and 4
   rows, once with `comm.expert_exchange: ragged` (`ragged_all_to_all`) and once with
   `dense`: the same losses and gradient norms within EXCHANGE_TOLERANCE, and different
   collectives compiled (on a GPU, `ragged-all-to-all` in the ragged run only). Skipped,
   saying so, with fewer GPUs.

`--cpu-smoke` (automatic without a GPU) runs the same logic at tiny widths on CPU devices:
part 1 compares two CPU processes (so it checks the script, not a GPU), part 2 runs the
modelled ragged exchange (parallel/ragged_model.py) against the dense one on 4 CPU
devices. Each run is a process of its own (`--worker`), so that a GPU run and a CPU run
never share a backend and a crash is reported, not fatal; the GPU runs get launch/env.sh's
environment, as a rank would. Exit status 1 when a comparison fails or a run is
non-finite. The JSON holds every run's per-step numbers.

Time on a GPU (estimated, not yet run): `europa-jax plan configs/europa-952b.yaml
--devices 1 --target h100` with these overrides compiles the one-GPU step in ~80 s on 2
CPU cores and prices it at ~0.2 s, 37.8 GB of HBM and 10.3 GB of host memory: it fits
an H100. The CPU reference is the long pole: 105 TFLOP per step, 88 of them Muon's
Newton–Schulz matmuls (one device orthogonalizes every matrix), so at ~1 TFLOP/s of a
16-core host about 2 min a step; it starts first and runs beside the GPU runs, and one
that outlasts `--cpu-timeout` leaves the comparison undone (said so; the GPU run's own
checks still count). The whole script: ~5 min with the default 2 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.dirname(os.path.abspath(__file__))]  # europa_jax, gpu_shared
from gpu_programs import SMOKE_EXECUTION, SMOKE_MODEL  # noqa: E402
from gpu_shared import gpu_count, gpu_driver_present  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "europa-952b.yaml")
# europa-952b at its widths, reduced so that the CPU reference of the same config takes
# minutes: two MoE layers (a dense layer's Muon alone is ~68 TFLOP of Newton-Schulz
# matmuls per step), 16 experts per device (each costs the CPU ~1.8 TFLOP of Muon per
# step: europa-952b's 96 would take ~170), a 32,768 vocabulary (the byte corpus uses 257
# ids), 2,048-token rows.
FULL = ["model.n_layers=2", "model.n_dense_layers=0", "model.vocab_size=32768",
        "model.vocab_pad_multiple=128", "data.seq_len=2048",
        "execution.attention_backward_chunk=2048"]
# the same at gpu_check's smoke widths (gpu_programs.SMOKE_MODEL, SMOKE_EXECUTION), for CI
TINY = ["model.n_layers=2", "model.n_dense_layers=1",
        *(f"model.{key}={value}" for key, value in SMOKE_MODEL.items()
          if key != "n_routed_experts"),  # per device: overrides()
        *(f"execution.{key}={value}" for key, value in SMOKE_EXECUTION.items()),
        "execution.param_pad_multiple=1", "execution.loss_chunk_tokens=0",
        "execution.attention_backward_chunk=0", "data.seq_len=256"]
# by tiny; routed top-8 (tiny: top-4) in europa-952b's 4 groups, two of them per token
EXPERTS_PER_DEVICE = {False: 16, True: 8}
COMMON = ["optim.warmup_steps=1",  # the first step already moves the weights
          "data.source=stdlib", "train.eval_every=0", "train.hang_watchdog=false"]

# Agreement per step, relative to the reference: the runs differ only in kernels (tiled
# accumulation orders, bf16 roundings of different intermediates), and the first step
# starts from the same weights on the same batch. Muon's orthogonalization then turns
# small gradient differences into O(lr) weight differences, so later steps get more room.
TOLERANCE = {"loss": {"first": 1e-2, "later": 3e-2},
             "grad_norm": {"first": 3e-2, "later": 1e-1}}
# the ragged and the dense exchange move the same rows: only the combine order differs
EXCHANGE_TOLERANCE = {"loss": {"first": 1e-3, "later": 1e-2},
                      "grad_norm": {"first": 1e-2, "later": 3e-2}}


# what tells the two exchanges apart in a compiled program (the modelled ragged exchange on
# CPU is all-gathers and all-to-alls of offsets)
COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-gather")


def overrides(tiny: bool, devices: int, exchange: str = "auto") -> list[str]:
    experts = EXPERTS_PER_DEVICE[tiny] * devices
    return [*(TINY if tiny else FULL), *COMMON, f"model.n_routed_experts={experts}",
            "mesh.data=1", f"mesh.expert={devices}", f"data.global_batch_size={devices}",
            f"execution.attention_context_parallel={str(devices > 1).lower()}",
            f"comm.expert_exchange={exchange}"]


# ----------------------------------------------------------------------------- one run


def run_steps(config_overrides: list[str], steps: int) -> dict:
    """`steps` of the real jitted train step on this process's devices: per step the
    loss, gradient norm and finiteness; after them whether every state leaf is finite;
    the compiled program's library kernels."""
    import jax
    import jax.numpy as jnp

    from europa_jax.config_loader import load_config
    from europa_jax.parallel import sharding
    from europa_jax.plan.program import gpu_program
    from europa_jax.run.loop import device_batches, host_batch_iterator
    from europa_jax.train.train import build_trainer, init_state, jit_train_step

    cfg = load_config(CONFIG, [*config_overrides, f"train.steps={steps}"])
    mesh = sharding.make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    out = {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "devices": mesh.devices.size, "steps": []}
    with jax.set_mesh(mesh):
        state = init_state(trainer, cfg.train.seed)
        batches = device_batches(trainer, host_batch_iterator(cfg))
        _, batch = next(batches)
        start = time.perf_counter()
        compiled = jit_train_step(trainer).lower(state, batch).compile()
        out["compile_s"] = time.perf_counter() - start
        text = compiled.as_text()
        out["library_kernels"] = gpu_program.program_facts(text, cfg)["library_kernels"]
        out["collectives"] = {op: text.count(f" {op}(") for op in COLLECTIVES}
        for step in range(steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            metrics = jax.device_get(metrics)
            out["steps"].append({"step": step + 1, "seconds": time.perf_counter() - start,
                                 **{k: float(metrics[k]) for k in
                                    ("loss", "grad_norm", "moe_dropped_fraction")},
                                 "finite": bool(metrics["finite"])})
            if step + 1 < steps:
                _, batch = next(batches)
        leaves = jax.tree.leaves(state)
        finite = [bool(jnp.isfinite(leaf).all()) for leaf in leaves
                  if jnp.issubdtype(leaf.dtype, jnp.floating)]
    out["state_finite"] = all(finite)
    out["nonfinite_state_leaves"] = finite.count(False)
    return out


def worker(args) -> None:
    result = run_steps(json.loads(args.overrides), args.steps)
    with open(args.worker, "w") as f:
        json.dump(result, f, indent=2)


class Run:
    """One run in a process of its own, on `platform` with `devices` devices; started at
    once, its result taken by `result` (a run past `timeout_s` is killed and says so)."""

    def __init__(self, name: str, platform: str, devices: int, config_overrides: list[str],
                 steps: int, workdir: str):
        self.out = os.path.join(workdir, f"{name}.json")
        env = dict(os.environ)
        command = [sys.executable, os.path.abspath(__file__), "--worker", self.out, "--steps",
                   str(steps), "--overrides", json.dumps(config_overrides)]
        if platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = " ".join(
                [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
                + [f"--xla_force_host_platform_device_count={devices}"])
        else:  # a rank's environment (XLA flags, HBM share, host memory), on the first GPUs
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(devices)))
            command = ["bash", "-c", f'source "{REPO}/launch/env.sh" && exec "$@"', "-",
                       *command]
        self.started = time.perf_counter()
        self.stderr = open(os.path.join(workdir, f"{name}.stderr"), "w+")
        self.process = subprocess.Popen(command, cwd=workdir, env=env,
                                        stdout=subprocess.DEVNULL, stderr=self.stderr)

    def result(self, timeout_s: float | None = None) -> dict:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return {"timed_out": f"not done after {timeout_s:.0f} s",
                    "seconds": time.perf_counter() - self.started}
        seconds = time.perf_counter() - self.started
        if code:
            self.stderr.seek(0)
            tail = [line for line in self.stderr.read().splitlines() if line.strip()][-1:]
            return {"error": f"exit {code}: {tail[0] if tail else 'no output'}",
                    "seconds": seconds}
        with open(self.out) as f:
            return {**json.load(f), "seconds": seconds}


# ----------------------------------------------------------------------------- comparing


def problems_of(run: dict, name: str) -> list[str]:
    """What is wrong with one run by itself: an error, or anything non-finite."""
    if "error" in run:
        return [f"{name}: {run['error']}"]
    out = [f"{name} step {s['step']}: non-finite ({s['loss']=}, {s['grad_norm']=})"
           for s in run["steps"]
           if not (s["finite"] and math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]))]
    if not run["state_finite"]:
        out.append(f"{name}: {run['nonfinite_state_leaves']} state leaves hold NaN/Inf "
                   "after the last step")
    return out


def compare(run: dict, reference: dict, tolerance: dict, name: str) -> dict:
    """Per step, `run`'s loss and gradient norm relative to `reference`'s, against
    `tolerance` (the first step's bound, then the later steps')."""
    rows, failures = [], []
    for mine, theirs in zip(run["steps"], reference["steps"]):
        row = {"step": mine["step"]}
        for key, bounds in tolerance.items():
            bound = bounds["first"] if mine["step"] == 1 else bounds["later"]
            rel = abs(mine[key] - theirs[key]) / max(abs(theirs[key]), 1e-30)
            row[f"{key}_rel_diff"] = rel
            if not rel <= bound:  # NaN fails too
                failures.append(f"{name} step {mine['step']}: {key} {mine[key]:.6g} vs "
                                f"{theirs[key]:.6g}, relative {rel:.2e} > {bound:.0e}")
        rows.append(row)
    if len(run["steps"]) != len(reference["steps"]):
        failures.append(f"{name}: {len(run['steps'])} steps against "
                        f"{len(reference['steps'])}")
    return {"per_step": rows, "failures": failures}


def check_kernels(run: dict, name: str) -> list[str]:
    """On a GPU the step must call the library kernels, not XLA's dense stand-ins."""
    if run.get("platform") != "gpu":
        return []
    found = run.get("library_kernels", {})
    return [f"{name}: no {kind} library kernel in the GPU program (found {sorted(found)})"
            for kind in ("grouped_gemm", "attention_forward", "attention_backward")
            if kind not in found]


def exchange_differs(ragged: dict, dense: dict) -> list[str]:
    """The two runs must have compiled different exchanges (on a GPU, `ragged_all_to_all`
    only in the ragged one), else the comparison compares a program with itself."""
    if "error" in ragged or "error" in dense:
        return []
    if ragged["collectives"] == dense["collectives"]:
        return [f"ragged and dense exchanges compiled the same collectives "
                f"{ragged['collectives']}"]
    if ragged["platform"] == "gpu" and not (ragged["collectives"]["ragged-all-to-all"]
                                            and not dense["collectives"]["ragged-all-to-all"]):
        return [f"ragged-all-to-all in the ragged run {ragged['collectives']}, "
                f"the dense run {dense['collectives']}: expected in the ragged run only"]
    return []


# ----------------------------------------------------------------------------- the parts


def single_device(device: dict, cpu: dict) -> dict:
    """The one-device run (GPU, or CPU in the smoke) against the CPU run of its config."""
    part = {"tolerance": TOLERANCE, "device": device, "cpu": cpu,
            "failures": [*problems_of(device, "device"), *check_kernels(device, "device")]}
    if "timed_out" in cpu:  # the GPU run's own checks still count
        part["incomplete"] = [f"cpu reference {cpu['timed_out']}: not compared"]
        return part
    part["failures"] += problems_of(cpu, "cpu")
    if not ("error" in device or "error" in cpu):
        part["comparison"] = compare(device, cpu, TOLERANCE, "device vs cpu")
        part["failures"] += part["comparison"]["failures"]
    return part


def exchanges(ragged: dict, dense: dict) -> dict:
    """The ragged exchange's run against the dense exchange's, on the same devices."""
    part = {"tolerance": EXCHANGE_TOLERANCE, "ragged": ragged, "dense": dense,
            "failures": [*problems_of(ragged, "ragged"), *problems_of(dense, "dense"),
                         *exchange_differs(ragged, dense)]}
    if not ("error" in ragged or "error" in dense):
        part["comparison"] = compare(ragged, dense, EXCHANGE_TOLERANCE, "ragged vs dense")
        part["failures"] += part["comparison"]["failures"]
    return part


def run_parts(tiny: bool, gpu: bool, n_gpus: int, steps: int, cpu_timeout_s: float,
              workdir: str) -> dict:
    """The CPU reference starts first (the long pole) and runs beside the device runs;
    without a GPU the "device" run is the same CPU program, started after the reference so
    that it reads the reference's compile from the compilation cache (when one is set)."""
    single = overrides(tiny, devices=1)
    results = {"overrides": single}
    cpu = Run("cpu", "cpu", 1, single, steps, workdir)
    cpu_result = None if gpu else cpu.result(cpu_timeout_s)
    platform = "gpu" if gpu else "cpu"
    device = Run("device", platform, 1, single, steps, workdir).result()
    if gpu and n_gpus < 4:
        results["exchange"] = {"skipped": f"needs 4 GPUs, this machine has {n_gpus}",
                               "failures": []}
    else:
        ragged, dense = (Run(exchange, platform, 4, overrides(tiny, 4, exchange), steps,
                             workdir).result() for exchange in ("ragged", "dense"))
        results["exchange"] = exchanges(ragged, dense)
    results["single_device"] = single_device(
        device, cpu_result if cpu_result is not None else cpu.result(cpu_timeout_s))
    return results


def summary(results: dict) -> str:
    lines = []
    for part in ("single_device", "exchange"):
        got = results[part]
        if "skipped" in got:
            lines.append(f"{part}: skipped ({got['skipped']})")
            continue
        runs = [k for k in ("device", "cpu", "ragged", "dense") if k in got]
        for name in runs:
            run = got[name]
            if "error" in run or "timed_out" in run:
                lines.append(f"{part}/{name}: {run.get('error') or run['timed_out']}")
                continue
            losses = " ".join(f"{s['loss']:.4f}" for s in run["steps"])
            norms = " ".join(f"{s['grad_norm']:.4g}" for s in run["steps"])
            lines.append(f"{part}/{name} ({run['device']}, {run['devices']} device(s), "
                         f"compile {run['compile_s']:.0f} s, run {run['seconds']:.0f} s): "
                         f"loss {losses}; grad norm {norms}")
        for row in got.get("comparison", {}).get("per_step", []):
            lines.append(f"  step {row['step']}: " + ", ".join(
                f"{k} {v:.1e}" for k, v in row.items() if k != "step"))
    failures = results["failures"]
    lines += [f"INCOMPLETE: {line}" for line in results["incomplete"]]
    lines.append("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="gpu_smoke.json", help="where the results go")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny widths on CPU devices (automatic without a GPU)")
    parser.add_argument("--cpu-timeout", type=float, default=360, metavar="SECONDS",
                        help="the CPU reference's time limit (then the GPU run's own checks "
                        "count, the comparison is reported as not made)")
    parser.add_argument("--worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected at least 1")
    if args.worker:
        return worker(args)
    gpu = gpu_driver_present() and not args.cpu_smoke
    tiny = not gpu
    results = {"tiny": tiny, "steps": args.steps}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_smoke-") as workdir:
        results.update(run_parts(tiny, gpu, gpu_count() if gpu else 0, args.steps,
                                 args.cpu_timeout, workdir))
    results["seconds"] = time.perf_counter() - start
    results["failures"] = [*results["single_device"]["failures"],
                           *results["exchange"]["failures"]]
    results["incomplete"] = results["single_device"].get("incomplete", [])
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    if tiny:
        print("smoke run at tiny widths on CPU devices: checks the script, measures no GPU")
    print(summary(results))
    sys.exit(1 if results["failures"] else 0)


if __name__ == "__main__":
    main()
