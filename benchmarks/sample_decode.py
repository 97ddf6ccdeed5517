"""Tokens/s of `europa-jax sample`: the latent-cached decode against the whole-row forward
per token (the reference it is tested against), measured in one run.

    python benchmarks/sample_decode.py RUN_DIR [--prompt TEXT] [--new N] [--repeats R]
                                       [--json OUT]

Both paths load the same checkpoint once (`interop.sample.Sampler`), are compiled and
warmed up by a first call, then generate the same tokens (greedy) `--repeats` times each,
alternating, so both see the same machine load; the best of the repeats counts. Prints
tokens/s of each and their ratio. RUN_DIR is any run with a checkpoint, e.g. the README's
default run (`runs/tiny-cpu`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from europa_jax.interop.sample import Sampler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="def main():\n    ")
    parser.add_argument("--new", type=int, default=256, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args(argv)

    sampler = Sampler(args.run_dir)
    best: dict[str, float] = {}
    generated = {}
    for cached in (True, False):  # compile and warm up
        sampler.generate(args.prompt, max_new_tokens=args.new, cached=cached)
    for _ in range(args.repeats):
        for cached in (True, False):
            start = time.perf_counter()
            result = sampler.generate(args.prompt, max_new_tokens=args.new, cached=cached)
            seconds = time.perf_counter() - start
            name = "cached" if cached else "whole_row"
            generated[name] = result.ids
            best[name] = max(best.get(name, 0.0), len(result.ids) / seconds)
    if generated["cached"] != generated["whole_row"]:
        print("the two paths generated different tokens", file=sys.stderr)
        return 1
    record = {"run_dir": args.run_dir, "step": sampler.step,
              "prompt_tokens": len(sampler.encode(args.prompt)),
              "new_tokens": len(generated["cached"]), "repeats": args.repeats,
              "tokens_per_s": best, "ratio": best["cached"] / best["whole_row"]}
    print(f"{record['new_tokens']} new tokens after a {record['prompt_tokens']}-token prompt "
          f"(step {sampler.step}, best of {args.repeats}): cached {best['cached']:,.1f} "
          f"tokens/s, whole row per token {best['whole_row']:,.1f} tokens/s, "
          f"ratio {record['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
