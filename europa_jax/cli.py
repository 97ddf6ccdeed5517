"""`europa-jax train|prepare|export|import|count|plan|report|sample|eval`: the command line.

jax is imported only after the config is read, because the number of CPU devices must be
fixed before jax creates its backends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from europa_jax.config import ConfigError
from europa_jax.config_loader import load_config
from europa_jax.data.corpus import DataError
from europa_jax.job import exit_codes, jax_start, logs
from europa_jax.job.distributed import StartError


CONFIG_HELP = "a YAML config, e.g. configs/tiny-cpu.yaml (the README's default run)"


class _DefaultsShown(argparse.HelpFormatter):
    """An option's help ends with its default where it has one its text does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text  # not flags
                and action.default not in (None, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="europa-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"europa-jax {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    loudness = common.add_mutually_exclusive_group()
    loudness.add_argument("--quiet", "-q", dest="verbosity", action="store_const",
                          const="quiet", default="normal", help="warnings and errors only")
    loudness.add_argument("--verbose", "-v", dest="verbosity", action="store_const",
                          const="verbose", help="debug lines, and the libraries' info lines")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], formatter_class=_DefaultsShown, **kwargs)

    train = command("train", help="train a model from a YAML config")
    train.add_argument("config", help=CONFIG_HELP)
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set optim.learning_rate=1e-3")
    train.add_argument("--run-dir", help="the run's directory: checkpoints, metrics, logs; "
                       "an existing one resumes (default: train.run_dir)")
    train.add_argument("--start-over", action="store_true",
                       help="start at step 0 in a run directory whose checkpoints are all "
                       "gone or set aside (refused otherwise; the old metrics are kept)")

    export = command("export", help="checkpoint → Hugging Face DeepseekV3 safetensors")
    export.add_argument("run_dir", help="the run's directory (checkpoints/ in it)")
    export.add_argument("--out", required=True, help="output directory (created)")
    export.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    export.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    export.add_argument("--max-shard-size", default="5GB", help="bound per safetensors file")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    export.add_argument("--tokenizer", help="the run's tokenizer.json if data.tokenizer moved "
                        "(checked against the corpus manifest)")

    imp = command("import", help="Hugging Face DeepseekV3 safetensors → a run directory")
    imp.add_argument("hf_dir", help="a Hugging Face DeepseekV3 directory (config.json, "
                     "safetensors)")
    imp.add_argument("--config", required=True, help="the YAML config to train it with")
    imp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    imp.add_argument("--out", required=True, help="run directory to create")
    imp.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")

    count = command("count", help="parameter counts from shapes alone (no allocation)")
    count.add_argument("config", help=CONFIG_HELP)
    count.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    plan = command("plan", help="per-device memory, FLOPs, communication, kernels and "
                          "GH200 step estimate, from the step compiled for N GPUs (or CPUs) "
                          "without them")
    plan.add_argument("config", help=CONFIG_HELP)
    plan.add_argument("--devices", type=int,
                      help="the step's device count (default: the config's mesh.data × "
                      "mesh.expert, which it must equal without --search)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    plan.add_argument("--target", default="gh200", choices=["gh200", "h100", "h200", "cpu"],
                      help="the device the step is compiled for: a GPU (needs the `gpu` "
                      "extra; 4 GPUs per node) or cpu (XLA:CPU, the former plan)")
    plan.add_argument("--corpus", metavar="DIR",
                      help="price attention from this prepared corpus's document lengths "
                      "(default: the --documents model)")
    plan.add_argument("--documents", default="dolma", choices=["dolma", "long-tail"],
                      help="the document-length model attention is priced on without "
                      "--corpus: Dolma's measured mix (default) or the long-tailed stress "
                      "case (plan/price/documents.py)")
    plan.add_argument("--compare", choices=["recipe"],
                      help="plan our layout and the recipe's (no context parallelism, "
                      "block-skipping attention both passes) on both document models and "
                      "print our ratio to it (plan/compare.py; four compiles)")
    plan.add_argument("--attention-batches", type=int, default=32, metavar="N",
                      help="global batches sampled through the balancer to price attention")
    plan.add_argument("--probe-moe-layers", metavar="A,B",
                      help="compile A and B MoE layers (e.g. 4,6) and extrapolate to the "
                      "config's depth")
    plan.add_argument("--hardware", metavar="GPU_CHECK_JSON",
                      help="efficiencies measured by benchmarks/gpu_check.py (its JSON's "
                      "calibration) in place of the cited assumptions of plan/price/hardware.py")
    plan.add_argument("--search", action="store_true",
                      help="plan a grid of layouts (each in its own process) and print one "
                      "table and the fastest that fits (plan/layout_search.py)")
    plan.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                      help="a dimension of the --search grid (default: mesh.expert over "
                      "1–16 nodes × execution.moe_chunk_tokens whole or a quarter row)")
    plan.add_argument("--jobs", type=int, default=1, metavar="N",
                      help="--search: plan N layouts at once (each compile of europa-952b "
                      "holds ~2.5 GB of RAM and mostly one core)")

    prepare = command("prepare", help="tokenize text, JSON lines or Parquet files into a "
                      "training corpus")
    source = prepare.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                        help="text files, directories (walked, sorted), JSON lines "
                        "(.jsonl/.ndjson/.json) or .parquet; .gz/.zst compressed")
    source.add_argument("--stdlib", action="store_true",
                        help="the default corpus: this Python's standard library sources")
    prepare.add_argument("--out", required=True, help="new corpus directory (must not exist)")
    prepare.add_argument("--tokenizer", default="bytes",
                         help="'bytes' (default) or a Hugging Face tokenizer.json")
    prepare.add_argument("--eos-token", help="end-of-document token (default: from "
                         "tokenizer_config.json beside the tokenizer, or a known name)")
    prepare.add_argument("--text-field", default="text",
                         help="JSON lines field or Parquet column holding the text")
    prepare.add_argument("--skip-bad", action="store_true",
                         help="skip and count bad records (invalid JSON, missing/null/"
                         "non-string field, text that is not UTF-8) instead of stopping at "
                         "the first; unsupported or corrupt files stay errors")

    sample = command("sample", help="generate text from a run's checkpoint (greedy or "
                     "sampled, decoded through the attention's latent cache)")
    sample.add_argument("run_dir", help="the run's directory (checkpoints/ in it)")
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=64,
                        help="stop after this many new tokens (or at the end-of-text token)")
    sample.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sample.add_argument("--seed", type=int, default=0,
                        help="the draws' random seed (with --temperature above 0)")
    sample.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    sample.add_argument("--tokenizer", help="the run's tokenizer.json if data.tokenizer no "
                        "longer points to it")
    sample.add_argument("--json", action="store_true", help="print one JSON line instead of "
                        "the text: text, ids, prompt_ids, stop, step")

    evaluate = command("eval", help="lm-eval-harness tasks scored on a run's checkpoint "
                       "with our model, on the run's mesh")
    evaluate.add_argument("run_dir", help="the run's directory (checkpoints/ in it)")
    evaluate.add_argument("--tasks", required=True, metavar="A,B",
                          help="task names: the shipped europa_tiny_choice, europa_tiny_gen, "
                          "those of --tasks-dir, or lm_eval's own")
    evaluate.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    evaluate.add_argument("--tasks-dir", help="a directory of lm-eval task YAMLs with local "
                          "data files (docs/evaluation.md)")
    evaluate.add_argument("--limit", type=int, help="documents per task (default: all)")
    evaluate.add_argument("--output", help="also write the JSON result to this file")
    evaluate.add_argument("--tokenizer", help="the run's tokenizer.json if data.tokenizer no "
                          "longer points to it")
    evaluate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="another layout for the forward: mesh.* or "
                          "train.eval_tasks_seq_len")

    report = command("report", help="plots (PNG) and a summary of a run directory; "
                            "works while the run is going")
    report.add_argument("run_dir", help="the run's directory (metrics.jsonl, events.jsonl)")
    report.add_argument("--out", help="where the PNGs and summary.txt go (default: "
                        "RUN_DIR/report)")
    return parser


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
    print(json.dumps(report, indent=2) if args.json else report_text.format_report(report))
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


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("europa-jax")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _set_without_equals(argv: list[str]) -> str | None:
    """The hint for `--set KEY VALUE` (argparse would take VALUE for a positional and
    print the whole usage): the first `--set` without `=`, written as it should be."""
    for i, arg in enumerate(argv[:-1]):
        key = argv[i + 1]
        if arg == "--set" and "=" not in key:
            value = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("-") else ""
            return (f"--set {key} {value}".rstrip() + f": --set takes KEY=VALUE, e.g. "
                    f"--set {key}={value or 'VALUE'}")
    return None


def _main(argv: list[str] | None) -> int:
    hint = _set_without_equals(list(sys.argv[1:] if argv is None else argv))
    if hint:
        _error(ConfigError(hint))
        return exit_codes.BAD_INPUT
    args = _parser().parse_args(argv)
    logs.configure(args.verbosity)
    if args.command == "report":  # no jax
        return _report(args)
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
        return run_training(cfg, args.run_dir, start_over=args.start_over)
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


def run_training(cfg, run_dir: str | None, *, start_over: bool = False) -> int:
    """Train and map the outcome to an `exit_codes` value (also used by multi-process
    launchers): run/outcome.py, with the downstream tasks of `train.eval_tasks`."""
    from europa_jax.run import outcome

    # the tasks are found and loaded before the run directory is touched
    return outcome.train_to_exit_code(cfg, run_dir, tasks=task_evaluation(cfg),
                                      start_over=start_over)


def task_evaluation(cfg):
    """`train.eval_tasks` (eval/during_training.py) for the loop, or None."""
    if not cfg.train.eval_tasks:
        return None
    from europa_jax.eval.during_training import TaskEvaluation

    return TaskEvaluation(cfg)


if __name__ == "__main__":
    sys.exit(main())
