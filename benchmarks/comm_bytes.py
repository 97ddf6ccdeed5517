"""Per-step collective bytes per device of the real train step, by op, mesh axis, dtype.

    python benchmarks/comm_bytes.py [--config configs/small-cpu.yaml] [--steps 3] [--json OUT]
        [--set mesh.devices_per_node=2 …]

1. Lowers the step with weight gathers in fp32, bf16 and fp8 (gradient reductions in fp32,
   bf16, bf16) and reads every collective from the HLO (europa_jax.plan.program.hlo_report), the
   part of each that crosses nodes (mesh.devices_per_node GPUs a node; plan/program/links.py) apart.
2. Runs a few real steps with and without group-limited routing (n_group = expert axis,
   topk_group = 2) and reports the MoE token rows that leave a device — what the ragged
   exchange on GPU sends, with per-device deduplication — against one row per remote copy
   and against what the plan expects of uniform routing (moe_dispatch.expected_destinations).
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def lowered_collectives(cfg):
    import jax

    from europa_jax.plan.program import hlo_report
    from europa_jax.parallel import sharding
    from europa_jax.train import train

    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    with jax.set_mesh(mesh):
        lowered = train.jit_train_step(trainer).lower(trainer.abstract_state,
                                                      train.abstract_batch(trainer))
    return hlo_report.summarize(hlo_report.collectives(
        lowered.compiler_ir("hlo").as_hlo_text(), mesh,
        devices_per_node=cfg.mesh.devices_per_node))


def exchanged_rows(cfg, steps):
    import jax

    from europa_jax.run import loop
    from europa_jax.parallel import sharding
    from europa_jax.train import train

    mesh = sharding.make_mesh(cfg.mesh)
    trainer = train.build_trainer(cfg, mesh)
    state = train.init_state(trainer, cfg.train.seed)
    step = train.jit_train_step(trainer)
    with jax.set_mesh(mesh):
        for _, (_, batch) in zip(range(steps), loop.device_batches(
                trainer, loop.host_batch_iterator(cfg))):
            state, metrics = step(state, batch)
    return float(metrics["moe_exchanged_rows_per_copy"]), float(metrics["moe_remote_copy_fraction"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small-cpu.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    import jax

    from europa_jax.config_loader import load_config
    from europa_jax.model.experts import moe_dispatch
    from europa_jax.plan.program import hlo_report

    cfg = load_config(args.config, args.set)
    jax.config.update("jax_num_cpu_devices", cfg.mesh.n_devices)
    results = {"config": args.config, "gathers": {}, "routing": {}}
    for gather, reduce in (("fp32", "fp32"), ("bf16", "bf16"), ("fp8", "bf16")):
        run = dataclasses.replace(cfg, comm=dataclasses.replace(
            cfg.comm, weight_gather_dtype=gather, grad_reduce_dtype=reduce,
            expert_exchange_dtype="bf16" if reduce == "bf16" else "fp32"))
        rows = lowered_collectives(run)
        results["gathers"][gather] = rows
        print(f"\n== weight gathers {gather}, gradient reductions {reduce} ==")
        print(hlo_report.format_table(rows))
    totals = {g: sum(r["bytes_per_device"] for r in rows if r["op"] == "all-gather")
              for g, rows in results["gathers"].items()}
    print("\nall-gather bytes vs fp32: " + ", ".join(
        f"{g} {totals[g] / totals['fp32']:.3f}" for g in totals))

    ep = cfg.mesh.expert
    d_bytes = cfg.model.d_model * 2  # bf16 token rows
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    for name, groups in (("group-limited", (ep, 2)), ("unrestricted", (1, 1))):
        run = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, n_group=groups[0], topk_group=groups[1]))
        rows, remote = exchanged_rows(run, args.steps)
        copies = tokens * cfg.model.top_k
        # each device is as likely as any to be among a token's destinations
        expected = (moe_dispatch.expected_destinations(run.model, ep) * (ep - 1) / ep
                    / cfg.model.top_k)
        results["routing"][name] = {
            "rows_per_copy": rows, "expected_rows_per_copy": expected,
            "remote_copies_per_copy": remote,
            "ragged_bytes_per_device_per_layer": rows * copies * d_bytes / cfg.mesh.n_devices,
            "undeduplicated_bytes_per_device_per_layer":
                remote * copies * d_bytes / cfg.mesh.n_devices}
    print(f"\nMoE exchange, one direction, bf16 rows, after {args.steps} steps "
          f"(n_group={ep}, topk_group=2 vs unrestricted):")
    print(f"{'routing':<14} {'rows/copy':>10} {'expected':>9} {'remote copies/copy':>19} "
          f"{'KiB/device/layer':>17} {'no-dedup KiB':>13}")
    for name, r in results["routing"].items():
        print(f"{name:<14} {r['rows_per_copy']:>10.3f} {r['expected_rows_per_copy']:>9.3f} "
              f"{r['remote_copies_per_copy']:>19.3f} "
              f"{r['ragged_bytes_per_device_per_layer'] / 1024:>17.1f} "
              f"{r['undeduplicated_bytes_per_device_per_layer'] / 1024:>13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
