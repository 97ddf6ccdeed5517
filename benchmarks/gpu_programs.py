"""The functions benchmarks/gpu_check.py measures, at europa-952b's per-GPU shapes: one MoE
decoder layer forward+backward, grouped matmuls, attention, pinned_host copies.

Each is a `Program` (a jitted function and the maker of its inputs) so that gpu_check.py
times exactly what it compiles for a GPU that is not here. Imports of jax and the project
stay inside functions: gpu_check.py chooses the platform before jax starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE_MODEL = dict(d_model=64, n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, dense_ffn_dim=128, n_routed_experts=8,
                   expert_ffn_dim=32, top_k=4, n_group=4, topk_group=2,
                   vocab_size=512, vocab_pad_multiple=128)
SMOKE_EXECUTION = dict(attention_block_size=64)
LOCAL_EXPERTS = 96  # europa-952b's 384 experts over the 4 GPUs of a node
OFFLOAD_BYTES = {False: 2**30, True: 2**24}  # by smoke


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted function and the maker of its inputs: run eagerly to time it; only its
    shapes are taken (`jax.eval_shape`) to compile it for a GPU that is not here."""

    fn: Callable
    make_args: Callable[[], tuple]
    host_args: tuple[int, ...] = ()  # positional arguments that live in pinned_host memory


def one_device_mesh(device):
    import numpy as np
    import jax

    return jax.sharding.Mesh(np.array([device]), ("x",))


def arg_sharding(program: Program, mesh, i: int):
    """Positional argument `i` on the mesh's device, in HBM or pinned host memory; on the
    abstract mesh for compile-only GPUs, whose concrete shardings drop the memory kind."""
    from jax.sharding import NamedSharding, PartitionSpec

    from europa_jax.parallel import sharding

    return NamedSharding(sharding.placement_mesh(mesh), PartitionSpec(), memory_kind=(
        "pinned_host" if i in program.host_args else "device"))


def inputs(program: Program, mesh) -> tuple:
    """The program's inputs, made on this device and placed where the program takes them."""
    import jax

    return tuple(jax.device_put(a, arg_sharding(program, mesh, i))
                 for i, a in enumerate(program.make_args()))


def check_config(smoke: bool, tokens: int):
    """europa-952b as one MoE layer on one GPU of an expert-parallel node, fed one document
    of `tokens` (the data and mesh say so, for gpu_program.dense_expert_buffers)."""
    from europa_jax.config import MeshConfig
    from europa_jax.config_loader import load_config

    cfg = load_config(os.path.join(REPO, "configs", "europa-952b.yaml"))
    model = dict(n_routed_experts=LOCAL_EXPERTS, param_dtype="bfloat16")
    execution = {}
    if smoke:
        model.update(SMOKE_MODEL)
        execution.update(SMOKE_EXECUTION)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, n_layers=1, n_dense_layers=0, **model),
        execution=dataclasses.replace(cfg.execution, **execution),
        mesh=MeshConfig(), data=dataclasses.replace(cfg.data, seq_len=tokens,
                                                    global_batch_size=1))


def layer_flops(model, tokens: int) -> float:
    """Forward+backward FLOPs of one MoE layer on one causal document of `tokens`."""
    from europa_jax.model import flops

    pairs = tokens * (tokens + 1) // 2
    head = 6.0 * model.d_model * model.vocab_size * tokens  # train_flops counts the LM head
    return flops.train_flops(model, tokens, pairs) - head


# ----------------------------------------------------------------------------- programs
# Each check's functions, for the device of `mesh` (the GPU here, or a compile-only one).


def layer_programs(model, execution, tokens: int, mesh, smoke: bool) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp

    from europa_jax.parallel import sharding
    from europa_jax.model import kernels
    from europa_jax.model.layers import rope_tables
    from europa_jax.model.block import DecoderBlock

    # the grouped matmul the mesh's platform gets ("auto": blocked on CPU, tokamax on GPU)
    impl = kernels.grouped_matmul_impl(execution, sharding.mesh_platform(mesh))
    if smoke and impl == "tokamax":  # Mosaic GPU does not lower the smoke widths
        impl = "tokamax_triton"
    block = DecoderBlock(model, dataclasses.replace(
        execution, grouped_matmul=impl, attention=attention_kernel(execution, mesh, smoke)),
        is_moe=True)

    def layer_inputs():  # made inside the jitted functions: no eager op on the target
        positions_BS = jnp.arange(tokens, dtype=jnp.int32)[None]
        return (jnp.ones((1, tokens), jnp.int32), *rope_tables(positions_BS, model),
                jnp.zeros((model.n_routed_experts,), jnp.float32),
                jnp.ones((1, tokens), jnp.bool_))

    def make_args():
        x_BSD = jax.random.normal(jax.random.key(0), (1, tokens, model.d_model), jnp.bfloat16)
        # the same parameters whatever the kernels; init traces on this machine's backend
        init_block = DecoderBlock(model, dataclasses.replace(execution, attention="blockwise"),
                                  is_moe=True)
        return jax.jit(lambda x: init_block.init(jax.random.key(1), x, *layer_inputs()))(
            x_BSD), x_BSD

    def loss(params, x_BSD):
        y_BSD, _ = block.apply(params, x_BSD, *layer_inputs())
        return y_BSD.astype(jnp.float32).sum()

    return {"fwd+bwd": Program(jax.jit(jax.grad(loss, argnums=(0, 1))), make_args)}


def grouped_matmul_programs(model, tokens: int) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp

    from europa_jax.model import kernels

    e, d, f = model.n_routed_experts, model.d_model, model.expert_ffn_dim
    rows = tokens * model.top_k

    def make_args():
        sizes_E = jnp.full((e,), rows // e, jnp.int32).at[-1].add(rows % e)  # even routing
        return (jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16),
                jax.random.normal(jax.random.key(1), (e, d, f), jnp.bfloat16), sizes_E)

    fns = {"dense_matmul": lambda x, w, sizes: x @ w[0], "lax.ragged_dot": jax.lax.ragged_dot}
    if kernels.tokamax_available():
        fns["tokamax.ragged_dot"] = kernels.import_tokamax().ragged_dot  # quiet absl logging
    return {name: Program(jax.jit(fn), make_args) for name, fn in fns.items()}


def attention_kernel(execution, mesh, smoke: bool) -> str:
    """The attention kernel the model uses on the mesh's platform (kernels.py: blockwise on
    CPU, tokamax's Mosaic GPU flash attention on GPU; Triton at the smoke widths, below
    what the Mosaic kernel tiles)."""
    from europa_jax.parallel import sharding
    from europa_jax.model import kernels

    impl = kernels.attention_impl(execution, sharding.mesh_platform(mesh))
    return "tokamax_triton" if smoke and impl == "tokamax" else impl


def attention_reference(mesh) -> str:
    """What the model's attention is held against: on GPU the pure-JAX blockwise kernel
    (the CPU path: how much the library kernel buys); elsewhere XLA's plain attention.
    (cuDNN through jax.nn cannot be the reference: in jax 0.10.2 it wants one head width
    for q, k and v and has no document mask.)"""
    from europa_jax.parallel import sharding

    return "blockwise" if sharding.mesh_platform(mesh) == "gpu" else "xla"


def attention_programs(model, execution, tokens: int, mesh, smoke: bool
                       ) -> dict[str, Program]:
    """"model" (the kernel the model runs here) and "reference", forward+backward, on
    one document of `tokens`, q/k 192 wide and v 128 as MLA's."""
    import jax
    import jax.numpy as jnp

    from europa_jax.model.attention import attention_mask, blockwise_attention, library_attention

    h, qk, vd = model.n_heads, model.qk_head_dim, model.v_head_dim
    scale = qk ** -0.5

    def make_args():
        keys = jax.random.split(jax.random.key(0), 3)
        return (jax.random.normal(keys[0], (1, tokens, h, qk), jnp.bfloat16),
                jax.random.normal(keys[1], (1, tokens, h, qk), jnp.bfloat16),
                jax.random.normal(keys[2], (1, tokens, h, vd), jnp.bfloat16))

    def with_kernel(impl):
        def attend(q, k, v):
            segments = jnp.ones((1, tokens), jnp.int32)
            if impl == "blockwise":
                return blockwise_attention(q, k, v, segments, scale=scale,
                                           block_size=execution.attention_block_size)
            if impl == "xla":  # the dense [S, S] reference: only at the smoke size
                mask = attention_mask(jnp.arange(tokens), jnp.arange(tokens), segments,
                                      segments)
                scores = jnp.einsum("bshk,bthk->bhst", q, k).astype(jnp.float32) * scale
                probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
                return jnp.einsum("bhst,bthv->bshv", probs.astype(v.dtype), v)
            return library_attention(q, k, v, segments, scale=scale, impl=impl)

        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))

    return {"model": Program(with_kernel(attention_kernel(execution, mesh, smoke)), make_args),
            "reference": Program(with_kernel(attention_reference(mesh)), make_args)}


def offload_programs(n_bytes: int, mesh) -> dict[str, Program]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from europa_jax.parallel import sharding

    placement = sharding.placement_mesh(mesh)
    to = {kind: NamedSharding(placement, PartitionSpec(), memory_kind=kind)
          for kind in ("pinned_host", "device")}

    def make_args():
        return (jnp.ones((n_bytes // 2,), jnp.bfloat16),)

    return {"device_to_host": Program(jax.jit(lambda a: jax.device_put(a, to["pinned_host"])),
                                      make_args),
            "host_to_device": Program(jax.jit(lambda a: jax.device_put(a, to["device"])),
                                      make_args, host_args=(0,))}


def builders(cfg, tokens: int, smoke: bool) -> dict[str, Callable]:
    """Each check's programs for a mesh: the same for timing and for the GPU compile."""
    model, execution = cfg.model, cfg.execution
    return {"layer": lambda mesh: layer_programs(model, execution, tokens, mesh, smoke),
            "grouped_matmul": lambda mesh: grouped_matmul_programs(model, tokens),
            "attention": lambda mesh: attention_programs(model, execution, tokens, mesh, smoke),
            "offload": lambda mesh: offload_programs(OFFLOAD_BYTES[smoke], mesh)}
