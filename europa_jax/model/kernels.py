"""Which kernel each op uses on which platform, and the kernel library behind the GPU ones.

Two ops have library kernels on GPU and exact pure-JAX paths elsewhere:
- the MoE grouped matmul (`model.grouped_matmul`): `auto` = the blocked matmul on CPU
  (moe.grouped_swiglu), tokamax's grouped matmul on GPU;
- attention (`model.attention`): `auto` = on CPU the whole score matrix at once where it
  fits (attention.dense_attention), else the blockwise online-softmax scan
  (attention.blockwise_attention); tokamax's flash attention on GPU (attention.
  library_attention: Mosaic GPU on Hopper).

The platform is that of the mesh the step is traced for (the SPMD context), then jax's
default backend: a GPU program compiled on a CPU machine gets the GPU's kernels.
"""

from __future__ import annotations

import importlib.util

import jax

from europa_jax.config import ConfigError, ModelConfig
from europa_jax.parallel import comm

INSTALL = "pip install -e '.[gpu]'"


def import_tokamax():
    """tokamax (the `gpu` extra), imported only where a config asks for it.

    tokamax reads absl flags, and absl would parse this process's own command line
    (`europa-jax plan --devices …`, pytest's) on first access and reject it: flags are
    marked parsed first, at their defaults.
    """
    import logging

    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
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
    ctx = comm.current()
    return ctx.platform if ctx else jax.default_backend()


def _resolve(key: str, configured: str, cpu_default: str, platform: str | None) -> str:
    platform = platform or current_platform()
    impl = configured
    if impl == "auto":
        impl = cpu_default if platform == "cpu" else "tokamax"
    if impl.startswith("tokamax") and not tokamax_available():
        raise ConfigError(f"model.{key}: {configured!r} on {platform} uses tokamax, which is "
                          f"not installed: {INSTALL} (or set model.{key}: {cpu_default})")
    return impl


def grouped_matmul_impl(cfg: ModelConfig, platform: str | None = None) -> str:
    """The configured grouped matmul; `auto` is `blocked` on CPU and tokamax's on GPU."""
    return _resolve("grouped_matmul", cfg.grouped_matmul, "blocked", platform)


# One device's float32 [B, H, S, S] attention scores up to which `auto` on CPU attends
# with the whole score matrix at once: XLA:CPU runs those few large einsums several times
# faster than the blockwise scan's many small ones (and its per-block cond and remat).
DENSE_ATTENTION_MAX_BYTES = 256 * 2**20


def attention_impl(cfg: ModelConfig, platform: str | None = None,
                   scores_bytes: int | None = None) -> str:
    """The configured attention kernel. `auto` is tokamax's flash attention on GPU; on CPU
    `dense` where one device's scores (`scores_bytes`, when the caller knows them) fit
    DENSE_ATTENTION_MAX_BYTES, else `blockwise`, which never holds them."""
    impl = _resolve("attention", cfg.attention, "blockwise", platform)
    if (cfg.attention == "auto" and impl == "blockwise" and scores_bytes is not None
            and scores_bytes <= DENSE_ATTENTION_MAX_BYTES):
        return "dense"
    return impl
