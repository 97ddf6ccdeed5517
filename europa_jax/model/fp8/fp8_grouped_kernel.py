"""A grouped FP8 GEMM with DeepSeek-V3's block scales for Hopper, in Pallas Mosaic GPU.

No library offers one for sm90 (tokamax 0.0.17's sm90 grouped matmul dequantizes an FP8
operand; XLA's `ragged_dot` has no FP8 path; docs/open-questions.md), so this is ours:

    out[m, n] = Σ_chunks  s_x[m, c] · s_w[e, c, n / 128] · Σ_{k in c} q_x[m, k] · q_w[e, n, k]

for each row block of `block_m` rows, all of one expert `e` (`block_group_B`: the
contiguous layout DeepGEMM's grouped GEMM takes, and the blocked expert kernel's: each
expert's rows padded to whole blocks, expert_matmul.BlockLayout). A program computes one
[block_m, block_n] tile; it walks K in 128-wide chunks through a pipeline of TMA copies,
multiplies each chunk's e4m3 tiles on the tensor cores into a fresh FP32 accumulator
(`wgmma`) and adds it into the running FP32 sum times its two scales — the per-chunk
promotion of DeepSeek-V3 §3.3.2 that keeps the tensor cores' limited accumulation precision
to one chunk. With block_n = 128 a tile lies in one weight block: the weight scale is one
number per chunk, the activation scales one per row.

FP8 `wgmma` takes both operands K-major, so the weights come as [G, N, K] (K contiguous).
The same kernel computes the backward's dx = dy · wᵀ: dy quantized in 1×128 tiles along N
is the lhs, the weights in their own [G, K, N] layout (N contiguous) the K-major rhs, the
block scales transposed (`grad_input_operands`). The weight gradient dw_e = x_eᵀ · dy_e
contracts each expert's rows: `fp8_grouped_weight_grad` takes x and dy re-quantized in
128×1 tiles along the rows and stored transposed (rows contiguous: K-major for this
contraction), and each program sums its expert's 128-row blocks, each block's FP32
product times its two scale vectors. Experts' rows are then padded to 128-row blocks.

Tested on CPU in jax's Mosaic GPU interpreter against model/fp8/fp8_gemm.py and compiled for
GH200 (tests/test_fp8_grouped_kernel.py); not yet run on a GPU, nor wired into the model.
Shape suffixes (europa_jax/__init__.py): M rows, K contraction, N outputs, G experts,
X chunks of K, Y blocks of N, B row blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from europa_jax.model.fp8.fp8_gemm import CHUNK

FP8 = jnp.float8_e4m3fn


def fp8_grouped_matmul(xq_MK: jax.Array, sx_XM: jax.Array, wq_GNK: jax.Array,
                       sw_GXY: jax.Array, block_group_B: jax.Array, *, block_m: int = 64,
                       block_n: int = CHUNK, out_dtype=jnp.bfloat16,
                       max_concurrent_steps: int = 2) -> jax.Array:
    """[M, N] in `out_dtype`: each row block times its expert's weights, FP32 inside.

    xq_MK e4m3 rows, sx_XM their float32 scales per 128-wide chunk (transposed: a chunk's
    scales for a row block are one contiguous copy); wq_GNK e4m3 weights K-major, sw_GXY
    float32 scales per 128×128 block; block_group_B int32, the expert of each row block.
    """
    m, k = xq_MK.shape
    g, n, k_w = wq_GNK.shape
    if xq_MK.dtype != FP8 or wq_GNK.dtype != FP8:
        raise ValueError(f"e4m3 operands expected, got {xq_MK.dtype} and {wq_GNK.dtype}")
    if k_w != k or k % CHUNK or n % block_n or m % block_m or CHUNK % block_n:
        raise ValueError(f"rows [{m}, {k}] · weights [{g}, {n}, {k_w}]: K must be a multiple "
                         f"of {CHUNK}, N of block_n={block_n} (≤ {CHUNK}), M of "
                         f"block_m={block_m}")
    if sx_XM.shape != (k // CHUNK, m) or sw_GXY.shape != (g, k // CHUNK, n // CHUNK):
        raise ValueError(f"scales {sx_XM.shape} and {sw_GXY.shape} do not fit rows "
                         f"[{m}, {k}] and weights [{g}, {n}, {k}]")
    if block_group_B.shape != (m // block_m,):
        raise ValueError(f"block_group_B {block_group_B.shape}: one expert per row block "
                         f"({m // block_m}) expected")
    n_per_block = CHUNK // block_n  # output tiles per weight block along N

    def body(group_gmem, sw_gmem, xq_gmem, sx_gmem, wq_gmem, out_gmem):
        mi, ni = lax.axis_index("m"), lax.axis_index("n")
        e = group_gmem[mi]

        def chunk_step(indices, x_smem, w_smem, sx_smem, sum_MN):
            (c,) = indices

            def chunk_product(acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                return acc_ref[...]

            # a fresh FP32 accumulator per chunk, scaled and added in FP32 (promotion)
            partial_MN = pl.run_scoped(chunk_product, plgpu.ACC((block_m, block_n), jnp.float32))
            row_scale_M = plgpu.load(sx_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            weight_scale = sw_gmem[e, c, ni // n_per_block]
            return sum_MN + partial_MN * weight_scale * lax.broadcast_in_dim(
                row_scale_M, (block_m, block_n), [0])

        zeros_MN = plgpu.layout_cast(jnp.zeros((block_m, block_n), jnp.float32),
                                     plgpu.Layout.WGMMA)
        sum_MN = plgpu.emit_pipeline(
            chunk_step, grid=(k // CHUNK,),
            in_specs=[plgpu.BlockSpec((block_m, CHUNK), lambda c: (mi, c)),
                      plgpu.BlockSpec((block_n, CHUNK), lambda c: (ni, c)),
                      plgpu.BlockSpec((1, block_m), lambda c: (c, mi))],
            max_concurrent_steps=max_concurrent_steps, init_carry=zeros_MN,
        )(xq_gmem, wq_gmem.at[e], sx_gmem)

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((block_m, block_n), out_dtype))
        def store(out_smem):
            out_smem[...] = sum_MN.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem, out_gmem.at[pl.ds(mi * block_m, block_m), pl.ds(ni * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
                          grid=(m // block_m, n // block_n), grid_names=("m", "n"))
    return kernel(block_group_B, sw_GXY, xq_MK, sx_XM, wq_GNK)


def fp8_grouped_weight_grad(xq_KM: jax.Array, sx_BK: jax.Array, gq_NM: jax.Array,
                            sg_BN: jax.Array, first_block_G: jax.Array, blocks_G: jax.Array, *,
                            block_k: int = 64, block_n: int = CHUNK) -> jax.Array:
    """float32 [G, K, N]: for each expert, Σ over its 128-row blocks b of
    (x_bᵀ · dy_b in FP32) × sx[b, k] × sg[b, n].

    xq_KM / gq_NM: the rows' activations and output gradients in e4m3, transposed (rows
    contiguous); sx_BK / sg_BN: their float32 scales per 128-row block and column;
    expert e's blocks are first_block_G[e] … + blocks_G[e] (int32). The blocks of a
    program are visited one at a time (a loop with a run-time trip count); the TMA copies
    of a block are not yet overlapped with the previous block's product.
    """
    k, m = xq_KM.shape
    n, m_g = gq_NM.shape
    g = first_block_G.shape[0]
    if xq_KM.dtype != FP8 or gq_NM.dtype != FP8:
        raise ValueError(f"e4m3 operands expected, got {xq_KM.dtype} and {gq_NM.dtype}")
    if m_g != m or m % CHUNK or k % block_k or n % block_n:
        raise ValueError(f"rows xᵀ [{k}, {m}] and dyᵀ [{n}, {m_g}]: the rows must be a "
                         f"multiple of {CHUNK}, K of block_k={block_k}, N of block_n={block_n}")
    if sx_BK.shape != (m // CHUNK, k) or sg_BN.shape != (m // CHUNK, n):
        raise ValueError(f"scales {sx_BK.shape} and {sg_BN.shape} do not fit {m // CHUNK} "
                         f"row blocks of [{k}] and [{n}]")

    def body(first_gmem, blocks_gmem, xq_gmem, sx_gmem, gq_gmem, sg_gmem, out_gmem):
        e, ki, ni = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
        first = first_gmem[e]

        def expert_sum(x_smem, g_smem, sx_smem, sg_smem, barriers):
            def add_block(b, sum_KN):
                rows = pl.ds(b * CHUNK, CHUNK)
                copies = ((xq_gmem.at[pl.ds(ki * block_k, block_k), rows], x_smem),
                          (gq_gmem.at[pl.ds(ni * block_n, block_n), rows], g_smem),
                          (sx_gmem.at[b, pl.ds(ki * block_k, block_k)], sx_smem),
                          (sg_gmem.at[b, pl.ds(ni * block_n, block_n)], sg_smem))
                for i, (src, dst) in enumerate(copies):
                    plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
                for i in range(len(copies)):
                    plgpu.barrier_wait(barriers.at[i])

                def block_product(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem, g_smem.transpose((1, 0)))
                    return acc_ref[...]

                partial_KN = pl.run_scoped(block_product,
                                           plgpu.ACC((block_k, block_n), jnp.float32))
                sx_K = plgpu.load(sx_smem, layout=plgpu.Layout.WGMMA.reduce(1))
                sg_N = plgpu.load(sg_smem, layout=plgpu.Layout.WGMMA.reduce(0))
                return sum_KN + partial_KN * (
                    lax.broadcast_in_dim(sx_K, (block_k, block_n), [0])
                    * lax.broadcast_in_dim(sg_N, (block_k, block_n), [1]))

            zeros_KN = plgpu.layout_cast(jnp.zeros((block_k, block_n), jnp.float32),
                                         plgpu.Layout.WGMMA)
            return lax.fori_loop(first, first + blocks_gmem[e], add_block, zeros_KN)

        sum_KN = pl.run_scoped(expert_sum, plgpu.SMEM((block_k, CHUNK), FP8),
                               plgpu.SMEM((block_n, CHUNK), FP8),
                               plgpu.SMEM((block_k,), jnp.float32),
                               plgpu.SMEM((block_n,), jnp.float32),
                               plgpu.Barrier(num_arrivals=1, num_barriers=4))

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((block_k, block_n), jnp.float32))
        def store(out_smem):
            out_smem[...] = sum_KN
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[
                e, pl.ds(ki * block_k, block_k), pl.ds(ni * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((g, k, n), jnp.float32),
                          grid=(g, k // block_k, n // block_n), grid_names=("g", "k", "n"))
    return kernel(first_block_G, blocks_G, xq_KM, sx_BK, gq_NM, sg_BN)


def grad_input_operands(wq_GKN: jax.Array, sw_GXY: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The weights as dx = dy · wᵀ takes them in `fp8_grouped_matmul`: w [G, K, N] is
    already K-major for a contraction over N (no copy), its block scales transposed."""
    return wq_GKN, jnp.swapaxes(sw_GXY, 1, 2)
