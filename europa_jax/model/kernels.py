"""Which kernel each op uses on which platform, and the kernel library behind the GPU ones.

Two ops have library kernels on GPU and exact pure-JAX paths elsewhere:
- the MoE grouped matmul (`execution.grouped_matmul`): `auto` = the blocked matmul on CPU
  (moe.grouped_swiglu), tokamax's grouped matmul on GPU;
- attention (`execution.attention`): `auto` = on CPU the whole score matrix at once where it
  fits (attention.dense_attention), else the blockwise online-softmax scan
  (attention.blockwise_attention); tokamax's flash attention on GPU (attention.
  library_attention: Mosaic GPU on Hopper).

The platform is that of the mesh the step is traced for (the SPMD context), then jax's
default backend: a GPU program compiled on a CPU machine gets the GPU's kernels.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from europa_jax.config import ConfigError, ExecutionConfig
from europa_jax.parallel import comm

INSTALL = "pip install -e '.[gpu]'"


def import_tokamax():
    """tokamax (the `gpu` extra), imported only where a config asks for it. (tokamax ≥
    0.0.13 reads only its own `--tokamax_*` arguments from the command line, so `plan`'s
    and pytest's need no guarding any more.)"""
    import logging

    import tokamax

    # Without a tuned-config cache every trace warns, printing every group size: drop those.
    logging.getLogger("absl").addFilter(
        lambda record: not str(record.msg).startswith("Autotuning cache miss"))
    return tokamax


def tokamax_available() -> bool:
    try:
        return importlib.util.find_spec("tokamax") is not None
    except ModuleNotFoundError:
        return False


def current_platform() -> str:
    """The SPMD context's platform, else the default device's (a GPU-target compile sets
    a compile-only GPU as the default device: plan/gpu_target.lowering), else jax's
    default backend."""
    ctx = comm.current()
    if ctx:
        return ctx.platform
    device = jax.config.jax_default_device
    if device is not None and not isinstance(device, str):
        return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    return jax.default_backend()


def _resolve(key: str, configured: str, cpu_default: str, platform: str | None) -> str:
    platform = platform or current_platform()
    impl = configured
    if impl == "auto":
        impl = cpu_default if platform == "cpu" else "tokamax"
    if impl.startswith("tokamax") and not tokamax_available():
        raise ConfigError(f"execution.{key}: {configured!r} on {platform} uses tokamax, which "
                          f"is not installed: {INSTALL} (or set execution.{key}: {cpu_default})")
    return impl


def grouped_matmul_impl(ex: ExecutionConfig, platform: str | None = None) -> str:
    """The configured grouped matmul; `auto` is `blocked` on CPU and tokamax's on GPU."""
    impl = _resolve("grouped_matmul", ex.grouped_matmul, "blocked", platform)
    if impl == "tokamax_triton" and not _importable("jax_triton"):
        raise ConfigError("execution.grouped_matmul: 'tokamax_triton' needs jax_triton, which "
                          f"tokamax's Triton grouped matmul imports: {INSTALL}")
    return impl


# tokamax picks a kernel from an ordered list, passing silently to the next when one
# declines (NotImplementedError): tokamax 0.0.17's Mosaic grouped matmul declines float32,
# then its Triton one is missing without jax_triton, then XLA's dense one would run — E×
# the FLOPs, with nothing said. So every call names exactly one implementation, by this
# rule: on a GPU, `tokamax` is the Mosaic GPU kernel on bf16 inputs (float32 ones are cast,
# accumulation float32, the bf16 result cast back, as for attention) and `tokamax_triton`
# the Triton one; elsewhere tokamax's XLA reference (tests compare the kernels' plumbing
# on CPU with it).
MOSAIC_INPUT_DTYPES = (jnp.bfloat16, jnp.float16)


def tokamax_grouped_matmul(impl: str, platform: str | None = None) -> str:
    """tokamax's implementation for `execution.grouped_matmul` `impl` on `platform`."""
    platform = platform or current_platform()
    if platform != "gpu":
        return "xla"
    return {"tokamax": "mosaic", "tokamax_triton": "triton"}[impl]


def tokamax_ragged(impl: str, general: bool = False, platform: str | None = None):
    """tokamax's `ragged_dot` (`ragged_dot_general` if `general`) for `execution.grouped_matmul`
    `impl`, with exactly one implementation named; on Mosaic GPU float32 operands are
    multiplied in bf16 and the result cast back (the kernel takes bf16/f16 only)."""
    tokamax = import_tokamax()
    implementation = tokamax_grouped_matmul(impl, platform)
    fn = tokamax.ragged_dot_general if general else tokamax.ragged_dot

    def call(lhs, rhs, *args, **kwargs):
        if implementation == "mosaic" and not {lhs.dtype, rhs.dtype} <= set(
                map(jnp.dtype, MOSAIC_INPUT_DTYPES)):
            # bf16 in and out of the kernel (float32 inside), then float32: so that the
            # cotangents tokamax's VJP multiplies are bf16 too (a float32 one would send
            # the weight gradient to XLA's dense matmul)
            wanted = kwargs.get("preferred_element_type") or lhs.dtype
            return fn(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), *args,
                      implementation=implementation, **kwargs).astype(wanted)
        return fn(lhs, rhs, *args, implementation=implementation, **kwargs)

    return call


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# One device's float32 [B, H, S, S] attention scores up to which `auto` on CPU attends
# with the whole score matrix at once: XLA:CPU runs those few large einsums several times
# faster than the blockwise scan's many small ones (and its per-block cond and remat).
DENSE_ATTENTION_MAX_BYTES = 256 * 2**20


def attention_impl(ex: ExecutionConfig, platform: str | None = None,
                   scores_bytes: int | None = None) -> str:
    """The configured attention kernel. `auto` is tokamax's flash attention on GPU; on CPU
    `dense` where one device's scores (`scores_bytes`, when the caller knows them) fit
    DENSE_ATTENTION_MAX_BYTES, else `blockwise`, which never holds them."""
    impl = _resolve("attention", ex.attention, "blockwise", platform)
    if (ex.attention == "auto" and impl == "blockwise" and scores_bytes is not None
            and scores_bytes <= DENSE_ATTENTION_MAX_BYTES):
        return "dense"
    return impl
