"""Peak host memory of `europa-jax export` against the size of the model it exports.

    python benchmarks/export_memory.py [CONFIG] [--max-shard-size 8MB] [--set KEY=VALUE ...]

Saves an initialized state of CONFIG (default small-cpu) as a checkpoint, then exports it
in a fresh process and reports that process's peak RSS growth during the export (after
its imports) next to the model's size: streaming shows as growth well below the model.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout, also when run as a script

MEASURE = """
import json, sys, threading, time
from europa_jax.interop.export import export, parse_size

def rss():  # current resident set, bytes (ru_maxrss would include the imports' peak)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

baseline, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
summary = export(sys.argv[1], sys.argv[2], max_shard_bytes=parse_size(sys.argv[3]))
done.set()
sampler.join()
print(json.dumps({**summary, "peak_rss_growth_bytes": peak[0] - baseline}))
"""


def save_initial_state(config: str, overrides: list[str], run_dir: Path) -> int:
    import jax

    from europa_jax.store import checkpoint
    from europa_jax.parallel import sharding
    from europa_jax.train import train
    from europa_jax.config_loader import load_config

    cfg = load_config(config, overrides)
    jax.config.update("jax_num_cpu_devices", cfg.mesh.n_devices)
    trainer = train.build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    state = train.init_state(trainer, cfg.train.seed)
    saver = checkpoint.Checkpointer(cfg, run_dir, trainer)
    saver.save(0, state, None, reason="benchmark")
    saver.close()
    return sum(x.nbytes for x in jax.tree.leaves(state.params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(REPO / "configs" / "small-cpu.yaml"))
    parser.add_argument("--max-shard-size", default="8MB")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. model.n_layers=16 (more layers, same peak)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, out = Path(tmp) / "run", Path(tmp) / "hf"
        params_bytes = save_initial_state(args.config, args.set, run_dir)
        result = subprocess.run([sys.executable, "-c", MEASURE, str(run_dir), str(out),
                                 args.max_shard_size], cwd=REPO, capture_output=True, text=True,
                                check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        report = json.loads(result.stdout.strip().splitlines()[-1])
    report["params_bytes_fp32"] = params_bytes
    report["peak_growth_over_params"] = report["peak_rss_growth_bytes"] / params_bytes
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
