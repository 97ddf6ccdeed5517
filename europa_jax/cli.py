"""`europa-jax train|prepare|export|import|count|plan|report|sample|eval`: the command line.

jax is imported only after the config is read, because the number of CPU devices must be
fixed before jax creates its backends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from europa_jax import cli_args
from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.data.corpus import DataError
from europa_jax.job import exit_codes, jax_start, logs
from europa_jax.job.distributed import StartError


def _prepare(args: argparse.Namespace) -> int:
    import time

    from europa_jax.data import prepare, tokenizer

    tok = tokenizer.load_tokenizer(args.tokenizer, args.eos_token)
    inputs = prepare.stdlib_sources() if args.stdlib else args.input
    labels = [f"stdlib:{prepare.stdlib_root()}"] if args.stdlib else None
    start = time.perf_counter()
    manifest = prepare.prepare_corpus(inputs, args.out, tok, text_field=args.text_field,
                                      input_labels=labels, skip_bad=args.skip_bad)
    seconds = time.perf_counter() - start
    print(json.dumps({"out": args.out, "documents": manifest.documents,
                      "tokens": manifest.tokens, "shards": len(manifest.shards),
                      "tokenizer": manifest.tokenizer, "skipped_bad": manifest.skipped_bad,
                      "seconds": round(seconds, 2),
                      "tokens_per_s": round(manifest.tokens / seconds)}))
    return 0


def _plan(args: argparse.Namespace, cfg) -> int:
    from pathlib import Path

    if args.devices is None:  # the mesh says how many
        args.devices = cfg.mesh.n_devices
    if args.search or args.vary:
        if args.compare:
            raise ConfigError("--compare: not with --search (compare one layout with the "
                              "recipe's)")
        return _plan_search(args, cfg)
    if args.devices != cfg.mesh.n_devices:
        raise ConfigError(f"--devices {args.devices} does not match mesh data×expert = "
                          f"{cfg.mesh.data}×{cfg.mesh.expert} = {cfg.mesh.n_devices}")
    probes = None
    if args.probe_moe_layers:
        try:
            probes = tuple(int(x) for x in args.probe_moe_layers.split(","))
        except ValueError:
            probes = ()
        if len(probes) != 2 or min(probes) < 1 or probes[0] == probes[1]:
            raise ConfigError(f"--probe-moe-layers {args.probe_moe_layers!r}: expected two "
                              "different positive layer counts, e.g. 4,6")
    if args.attention_batches < 1:
        raise ConfigError(f"--attention-batches {args.attention_batches}: expected >= 1")
    if args.corpus and not (Path(args.corpus) / "manifest.json").is_file():
        raise ConfigError(f"--corpus {args.corpus}: no manifest.json there (expected a corpus "
                          "made by `europa-jax prepare`)")
    if args.target != "cpu" and probes:
        raise ConfigError("--probe-moe-layers: only for --target cpu (a GPU target "
                          "compiles the whole depth in about a minute)")
    from europa_jax.plan.program import gpu_target  # import no jax
    from europa_jax.plan.price import hardware

    machine = hardware.GH200_JUPITER
    if args.hardware:  # a bad file is refused before anything compiles
        machine = hardware.calibrated(machine, args.hardware)
    if args.target != "cpu":
        gpu_target.require_toolchain(args.target)
    # a plan never touches a device: CPU is the backend, a GPU only a compilation target
    gpu_target.prepare_process()
    from europa_jax.plan import plan, report_text  # imports jax; its backends start later

    os.environ["XLA_FLAGS"] = plan.compile_only_xla_flags(os.environ.get("XLA_FLAGS", ""))
    _use_cpu_devices(args.devices if args.target == "cpu" else 1, platform="cpu")
    options = dict(name=Path(args.config).stem, probe_moe_layers=probes, target=args.target,
                   attention_batches=args.attention_batches, machine=machine)
    if args.compare:
        from europa_jax.plan import compare

        result = compare.compare(cfg, lambda c, **kw: plan.plan(c, **options, **kw),
                                 corpus=args.corpus)
        print(json.dumps(result, indent=2) if args.json
              else compare.format_compare(result, options["name"]))
        return exit_codes.CRASH if any(r["error"] for r in result["rows"]) else exit_codes.OK
    if not args.json:  # the compile is a minute's silence for a tiny model, minutes for 1T
        target = ("this machine's CPUs" if args.target == "cpu" else
                  f"{args.devices} × {gpu_target.TARGETS[args.target].name} (no GPU needed)")
        hbm = gpu_target.TARGETS["gh200" if args.target == "cpu" else args.target]
        print(f"plan: compiling {options['name']}'s step for {target}; budget per GPU "
              f"{report_text.size(hbm.hbm_budget_bytes)} of HBM, "
              f"{report_text.size(machine.host_bytes)} of host memory …", file=sys.stderr,
              flush=True)
    report = plan.plan(cfg, corpus=args.corpus, documents_model=args.documents, **options)
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.verbosity == "verbose":
        print(report_text.format_report(report))
    else:
        print(report_text.format_summary(report) + "\n(all of it: --verbose; every figure: "
              "--json; how to read it: docs/plan.md)")
    return exit_codes.CRASH if report["compiled"]["error"] else exit_codes.OK


def _plan_search(args: argparse.Namespace, cfg) -> int:
    from europa_jax.plan import layout_search as search

    grid = search.default_grid(cfg, args.devices)
    grid.update(search.parse_vary(args.vary))
    if args.probe_moe_layers:
        raise ConfigError("--probe-moe-layers: not with --search (each layout compiles whole)")
    extra = ["--target", args.target, "--attention-batches", str(args.attention_batches),
             "--documents", args.documents]
    extra += ["--corpus", args.corpus] if args.corpus else []
    extra += ["--hardware", args.hardware] if args.hardware else []
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: expected a whole number of layouts ≥ 1")
    rows = search.plan_all(search.layouts(args.config, args.set, args.devices, grid),
                           args.config, args.set, args.devices, extra, jobs=args.jobs,
                           progress=None if args.json else sys.stderr)
    best = search.fastest_fitting(rows)
    print(json.dumps({"grid": grid, "layouts": rows, "fastest_fitting": best}, indent=2)
          if args.json else search.format_table(rows, best))
    return exit_codes.OK if any("error" not in r for r in rows) else exit_codes.CRASH


def _use_cpu_devices(n: int, platform: str | None = None) -> None:
    """Give the CPU backend `n` devices (harmless on GPU hosts, where it is not used)."""
    import jax

    if platform:
        jax.config.update("jax_platforms", platform)
    jax.config.update("jax_num_cpu_devices", n)


def _error(e: Exception) -> None:
    """`europa-jax: error: ...` on stderr, once per line of the message (an import names each
    problem of its weights on a line of its own)."""
    for line in str(e).splitlines() or [type(e).__name__]:
        print(f"europa-jax: error: {line}", file=sys.stderr)


def _report(args: argparse.Namespace) -> int:
    from europa_jax.records import report

    try:
        summary = report.write_report(args.run_dir, args.out)
    except report.ReportError as e:
        _error(e)
        return exit_codes.BAD_INPUT
    print(report.format_summary(summary))
    return exit_codes.OK


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `europa-jax report … | head`: the reader has what it wanted
        # Python's recipe: stdout to /dev/null, so the interpreter's last flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exit_codes.OK


def _main(argv: list[str] | None) -> int:
    hint = cli_args.set_without_equals(list(sys.argv[1:] if argv is None else argv))
    if hint:
        _error(ConfigError(hint))
        return exit_codes.BAD_INPUT
    args = cli_args.parser().parse_args(argv)
    logs.configure(args.verbosity)
    if args.command == "report":  # no jax
        return _report(args)
    if args.command == "train":  # a stop request is honoured from here, before jax starts
        from europa_jax.run import fault_injection, outcome  # no jax

        def train() -> int:
            fault_injection.signal_at("startup")  # a test's stop request at this point
            return _command(args)

        return outcome.stoppable(train)
    return _command(args)


def _command(args: argparse.Namespace) -> int:
    if args.command != "plan":  # plan chooses the platform first (_plan)
        jax_start.default_to_cpu_without_driver()
    try:
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "export":
            return _export(args)
        if args.command == "sample":
            from europa_jax.interop import sample

            return sample.run(args)
        if args.command == "eval":
            from europa_jax.eval import command

            return command.run(args)
        cfg = load_config(args.config, args.set)
        if args.command == "train":
            from europa_jax.run import outcome

            outcome.run_dir_known(args.run_dir or cfg.train.run_dir)
        if args.command == "import":
            from europa_jax.interop.hf_import import import_hf
            from europa_jax.job import distributed
            from europa_jax.store.save_outcome import SaveFailed

            distributed.start(cfg.mesh)  # every process reads and saves its own shards
            try:
                summary = import_hf(args.hf_dir, cfg, args.out, overwrite=args.overwrite)
            except SaveFailed as e:  # the disk: nothing of the import was kept
                _error(e)
                return exit_codes.CRASH
            print(json.dumps(summary))
            return exit_codes.OK
        if args.command == "plan":
            return _plan(args, cfg)
        if args.command == "count":  # from the parameter table: no devices, no tracing
            from europa_jax.model import flops
            from europa_jax.train import optim

            report = flops.parameter_counts(cfg.model)
            report["muon_fraction"] = optim.muon_fraction(cfg.model)
            print(json.dumps(report, indent=2))
            return exit_codes.OK
        from europa_jax.job import distributed

        distributed.start(cfg.mesh)  # joins the job's other processes (Slurm, local.sh)
        return run_training(cfg, args.run_dir, start_over=args.start_over,
                            rollback_to=args.rollback_to)
    except (ConfigError, DataError, FileNotFoundError) as e:
        _error(e)
        return exit_codes.BAD_INPUT
    except StartError as e:  # the distributed runtime refused to start: not the user's input
        _error(e)
        return exit_codes.CRASH


def _export(args) -> int:
    from europa_jax.store.saved_checkpoints import CheckpointError
    from europa_jax.interop.export import export, parse_size

    try:
        summary = export(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                         max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite,
                         tokenizer=args.tokenizer)
    except CheckpointError as e:
        _error(e)
        return exit_codes.BAD_INPUT
    print(json.dumps(summary))
    return exit_codes.OK


def run_training(cfg, run_dir: str | None, *, start_over: bool = False,
                 rollback_to: int | None = None) -> int:
    """Train and map the outcome to an `exit_codes` value (also used by multi-process
    launchers): run/outcome.py, with the downstream tasks of `train.eval_tasks`."""
    from europa_jax.run import outcome

    # the tasks are found and loaded before the run directory is touched
    return outcome.train_to_exit_code(cfg, run_dir, tasks=task_evaluation(cfg),
                                      start_over=start_over, rollback_to=rollback_to)


def task_evaluation(cfg):
    """`train.eval_tasks` (eval/during_training.py) for the loop, or None."""
    if not cfg.train.eval_tasks:
        return None
    from europa_jax.eval.during_training import TaskEvaluation

    return TaskEvaluation(cfg)


if __name__ == "__main__":
    sys.exit(main())
