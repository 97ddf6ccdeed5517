"""`europa-jax train|count|prepare`: the command line.

jax is imported only after the config is read, because the number of CPU devices must be
fixed before jax creates its backends.
"""

from __future__ import annotations

import argparse
import json
import sys

from europa_jax.config import ConfigError, load_config
from europa_jax.corpus import DataError
from europa_jax.distributed import StartError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="europa-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set optim.learning_rate=1e-3")
    train.add_argument("--run-dir", help="where metrics.jsonl goes (default: train.run_dir)")

    count = sub.add_parser("count", help="parameter counts from shapes alone (no allocation)")
    count.add_argument("config")
    count.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    prepare = sub.add_parser("prepare", help="tokenize text/JSONL files into a training corpus")
    source = prepare.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", action="extend", metavar="PATH",
                        help="text files, directories (walked, sorted) or .jsonl[.gz] files")
    source.add_argument("--stdlib", action="store_true",
                        help="the default corpus: this Python's standard library sources")
    prepare.add_argument("--out", required=True, help="new corpus directory (must not exist)")
    prepare.add_argument("--tokenizer", default="bytes",
                         help="'bytes' (default) or a Hugging Face tokenizer.json")
    prepare.add_argument("--eos-token", help="end-of-document token (default: from "
                         "tokenizer_config.json beside the tokenizer, or a known name)")
    prepare.add_argument("--text-field", default="text", help="JSONL field holding the text")
    return parser


def _prepare(args: argparse.Namespace) -> int:
    import time

    from europa_jax import prepare, tokenizer

    tok = tokenizer.load_tokenizer(args.tokenizer, args.eos_token)
    inputs = prepare.stdlib_sources() if args.stdlib else args.input
    labels = [f"stdlib:{prepare.stdlib_root()}"] if args.stdlib else None
    start = time.perf_counter()
    manifest = prepare.prepare_corpus(inputs, args.out, tok, text_field=args.text_field,
                                      input_labels=labels)
    seconds = time.perf_counter() - start
    print(json.dumps({"out": args.out, "documents": manifest.documents,
                      "tokens": manifest.tokens, "shards": len(manifest.shards),
                      "tokenizer": manifest.tokenizer, "seconds": round(seconds, 2),
                      "tokens_per_s": round(manifest.tokens / seconds)}))
    return 0


def _use_cpu_devices(n: int) -> None:
    """Give the CPU backend `n` devices (harmless on GPU hosts, where it is not used)."""
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare":
            return _prepare(args)
        cfg = load_config(args.config, args.set)
        if args.command == "count":
            _use_cpu_devices(1)
            from europa_jax.train import abstract_variables
            import flax.linen as nn
            from europa_jax import flops, optim

            params = nn.unbox(abstract_variables(cfg))
            report = flops.parameter_counts(cfg.model, params)
            report["muon_fraction"] = optim.muon_fraction(params)
            print(json.dumps(report, indent=2))
            return 0
        from europa_jax import distributed

        distributed.start(cfg.mesh)  # joins the job's other processes (Slurm, local.sh)
        from europa_jax.loop import train

        records = train(cfg, args.run_dir)
        print(json.dumps({"first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
                          "steps": cfg.train.steps}))
        return 0
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"europa-jax: error: {e}", file=sys.stderr)
        return 2
    except StartError as e:  # a rank missing or unreachable: not the user's input
        print(f"europa-jax: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
