"""How far FP8 GEMMs (model/fp8/fp8_gemm.py: DeepSeek-V3's e4m3 recipe) land from BF16 ones,
per class of GEMM, on the real activations and weights of a trained checkpoint.

    python benchmarks/fp8_gemm_error.py RUN_DIR [--step N] [--rows R] [--json OUT]

One forward of the run's own model (interop/sample.py's one-device path) over R rows of
the run's training data records every RMSNorm's output — the inputs of the attention's
q and kv down-projections (`attention_norm`), of their up-projections (`q_a_norm`,
`kv_a_norm`, inside the attention), and of the dense MLP, the shared expert and the router (`mlp_norm`) — and
the dense MLP's hidden (SwiGLU of the same input) for its down-projection. Each class's
GEMMs are then computed three ways against the float64 product of the float32 operands:
BF16 operands with FP32 accumulation (what the run does today), and the FP8 emulation.
Printed per class: the relative Frobenius error of each and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from europa_jax.job import jax_start

jax_start.default_to_cpu_without_driver()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from europa_jax import param_table  # noqa: E402
from europa_jax.data import sources  # noqa: E402
from europa_jax.interop.sample import read_parameters, sampling_configs  # noqa: E402
from europa_jax.model.fp8 import fp8_gemm  # noqa: E402
from europa_jax.model.transformer import Transformer  # noqa: E402

# (class, the RMSNorm whose output is the input, the weights that take it)
CLASSES = [("attention down-projections", "attention_norm", ("attention", "w_q_a", "w_kv_a")),
           ("attention q up-projection", "attention/q_a_norm", ("attention", "w_q_b")),
           ("attention kv up-projection", "attention/kv_a_norm", ("attention", "w_kv_b")),
           ("dense MLP gate/up", "mlp_norm", ("mlp", "w_gate", "w_up")),
           ("shared expert gate/up", "mlp_norm", ("moe/shared", "w_gate", "w_up"))]


def relative(got: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def errors(x: np.ndarray, w: np.ndarray) -> dict:
    """Relative errors of the BF16 and FP8 products of x [M, K] · w [K, N]."""
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bf16 = np.asarray(jnp.matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                                 preferred_element_type=jnp.float32), np.float64)
    fp8 = np.asarray(fp8_gemm.fp8_matmul(jnp.asarray(x), jnp.asarray(w)), np.float64)
    return {"bf16": relative(bf16, exact), "fp8": relative(fp8, exact)}


def unrolled(params: dict) -> dict:
    """The scanned stacks' parameters as one entry per layer (`moe_layers_3`), so that a
    forward with `scan_layers: false` records each layer's intermediates (a scan drops
    them)."""
    out = {k: v for k, v in params.items() if k not in param_table.STACKS}
    for stack in param_table.STACKS:
        if stack in params:
            n = len(jax.tree.leaves(params[stack])[0])
            for i in range(n):
                name, _ = param_table.stack_key(stack, i, scanned=False)
                out[name] = jax.tree.map(lambda a, i=i: a[i], params[stack])
    return out


def leaves(tree: dict, path: str) -> list:
    node = tree
    for part in path.split("/"):
        node = node[part]
    return node


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    cfg, params, bias, step = read_parameters(args.run_dir, args.step)
    model_cfg, execution = sampling_configs(cfg)
    execution = dataclasses.replace(execution, scan_layers=False)
    params = unrolled(params)
    batch = next(iter(sources.batch_iterator_for(cfg, process_index=0, process_count=1)))
    rows = slice(0, args.rows)
    _, state = Transformer(model_cfg, execution).apply(
        {"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(batch["tokens"][rows]),
        jnp.asarray(batch["segment_ids"][rows]), jnp.asarray(batch["positions"][rows]),
        jnp.asarray(bias), capture_intermediates=True, mutable=["intermediates"])
    captured = state["intermediates"]
    results: dict[str, list[dict]] = {}
    for layer_name, layer in params.items():
        if layer_name not in captured or not isinstance(layer, dict):
            continue
        for name, norm, (module, *weights) in CLASSES:
            try:
                inputs = np.asarray(leaves(captured[layer_name], norm)["__call__"][0],
                                    np.float32)
                block = leaves(layer, module)
            except KeyError:
                continue  # this layer has no such GEMM (a dense MLP in an MoE block)
            x = inputs.reshape(-1, inputs.shape[-1])
            for w_name in weights:
                w = np.asarray(block[w_name], np.float32).reshape(x.shape[-1], -1)
                results.setdefault(name, []).append(errors(x, w))
            if name == "dense MLP gate/up":  # the down-projection takes SwiGLU's hidden
                gate = x @ np.asarray(block["w_gate"], np.float32)
                up = x @ np.asarray(block["w_up"], np.float32)
                hidden = gate / (1 + np.exp(-gate)) * up
                results.setdefault("dense MLP down", []).append(
                    errors(hidden, np.asarray(block["w_down"], np.float32)))
    summary = {name: {k: float(np.mean([r[k] for r in rows_])) for k in ("bf16", "fp8")}
               for name, rows_ in results.items()}
    print(f"{args.run_dir} step {step}, {args.rows} rows of {cfg.data.seq_len} tokens; relative "
          "Frobenius error against the float64 product, mean over layers and weights:")
    for name, e in summary.items():
        print(f"  {name:<30} bf16 {e['bf16']:.2e}   fp8 {e['fp8']:.2e}   "
              f"fp8/bf16 {e['fp8'] / e['bf16']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run_dir": args.run_dir, "step": step, "rows": args.rows,
                       "classes": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
