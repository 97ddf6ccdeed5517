"""The command line's grammar: `europa-jax`'s commands, their arguments and help, and the
hints given before argparse would print its usage (europa_jax/cli.py runs the commands)."""

from __future__ import annotations

import argparse

COMMANDS = "`europa-jax train|prepare|export|import|count|plan|report|sample|eval`: the command line."

CONFIG_HELP = "a YAML config, e.g. configs/tiny-cpu.yaml (the README's default run)"


class _DefaultsShown(argparse.HelpFormatter):
    """An option's help ends with its default where it has one its text does not state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text  # not flags
                and action.default not in (None, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="europa-jax", description=COMMANDS)
    parser.add_argument("--version", action="version", version=f"europa-jax {version()}")
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
    train.add_argument("--rollback-to", type=int, metavar="STEP",
                       help="resume from checkpoint STEP, not the latest: the later ones "
                       "are moved to rolled_back_checkpoints/ (a run that kept spiking, "
                       "e.g. with a lower --set optim.learning_rate=…)")

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


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("europa-jax")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def set_without_equals(argv: list[str]) -> str | None:
    """The hint for `--set KEY VALUE` (argparse would take VALUE for a positional and
    print the whole usage): the first `--set` without `=`, written as it should be."""
    for i, arg in enumerate(argv[:-1]):
        key = argv[i + 1]
        if arg == "--set" and "=" not in key:
            value = argv[i + 2] if i + 2 < len(argv) and not argv[i + 2].startswith("-") else ""
            return (f"--set {key} {value}".rstrip() + f": --set takes KEY=VALUE, e.g. "
                    f"--set {key}={value or 'VALUE'}")
    return None
