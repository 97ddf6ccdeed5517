"""Does cuDNN's packed-layout attention compile for a GH200 without a GPU, at MLA's head dims?

    python benchmarks/cudnn_packed_attention.py [--seq 8192] [--heads 4] [--documents 8]

cuDNN's fused attention with a packed ("ragged") layout takes each row's documents as
offsets and skips other documents' blocks in both passes — the document-aware backward
plan/docs call for. jax reaches it through a private module
(`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, `q_offsets`/`kv_offsets`).
This compiles forward+backward of one causal packed call, d_qk 192 and d_v 128, for a
compile-only GH200 and prints the custom calls the program holds.

What it must work around, on jax 0.12.0.1 (printed as it goes):
- the wrapper asks the *local* device for its compute capability while tracing
  (`check_compute_capability`): on a machine without a GPU it refuses head dims over 128
  and the packed layout ("requires a GPU with at least Hopper architecture"). The probe
  answers for the target (sm90) instead;
- its custom partitioning fails on an unsharded jit over a GPU topology (a GSPMDSharding
  where it expects a NamedSharding): the probe gives explicit NamedShardings, and a batch
  of 2 rows (a batch of 1 trips a Shardy rule on the residual).
Compiling says nothing of its numbers or its speed: only a GPU will. Exit 0 when the
program holds cuDNN's forward and backward attention calls.
"""

from __future__ import annotations

import argparse
import re
import sys


def probe(seq: int, heads: int, documents: int) -> list[str]:
    """The custom-call targets of the compiled forward+backward (raises if it fails)."""
    from europa_jax.plan.program import gpu_target

    gpu_target.prepare_process()
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from jax.sharding import NamedSharding, PartitionSpec as P

    from europa_jax.config import MeshConfig

    jax.config.update("jax_platforms", "cpu")
    cudnn.check_compute_capability = lambda capability: True  # the target is sm90
    cudnn.is_cuda_compute_capability_equal = lambda capability: capability == "9.0"
    mesh = gpu_target.mesh(MeshConfig(data=1, expert=4), gpu_target.TARGETS["gh200"])
    rows = 2
    q_k = jax.ShapeDtypeStruct((rows, seq, heads, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((rows, seq, heads, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((rows, documents), jnp.int32)
    offsets = jax.ShapeDtypeStruct((rows, documents + 1), jnp.int32)

    def loss(q, k, v, lengths, offsets):
        out = cudnn.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
            kv_offsets=offsets, scale=192**-0.5, mask_type=cudnn.MaskType.CAUSAL)
        return jnp.sum(out.astype(jnp.float32))

    whole = NamedSharding(mesh, P())
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(whole,) * 5,
                   out_shardings=(whole,) * 3)
    with gpu_target.lowering(mesh):
        lowered = grad.lower(q_k, q_k, v, lengths, offsets)
        text = gpu_target.compile_lowered(lowered, mesh).as_text()
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--documents", type=int, default=8)
    args = parser.parse_args()
    try:
        targets = probe(args.seq, args.heads, args.documents)
    except Exception as e:  # noqa: BLE001 - the answer is the error
        print(f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return 1
    print("custom calls:", ", ".join(targets))
    found = any(t.startswith("__cudnn$fmha") and "Backward" in t for t in targets)
    print("cuDNN packed attention, forward and backward: "
          + ("compiles for GH200" if found else "not in the program"))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
