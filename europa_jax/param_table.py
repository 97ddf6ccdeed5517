"""Every parameter of the model, declared once: the one table the rest derives from.

A parameter is named by its *role*: its path inside a decoder block (`attention.w_q_b`,
`moe.w_gate`, `moe.shared.w_up`, `mlp_norm.scale`) or, for the model's own parameters,
inside the model (`embedding`, `final_norm.scale`, `lm_head`). The same role in every
layer is one row, whether the layers are scanned (`moe_layers.attention.w_q_b[L, ...]`)
or unrolled (`moe_layers_3.attention.w_q_b`). A row says:

- `shape`: the shape the model computes with (one layer, without storage padding);
- `axes`: its logical axis names — parallel/sharding.py maps them to mesh axes;
- `init`, and `precision`: how low its FSDP gather may go, whether it is used in float32,
  whether it is exported in float32;
- `optimizer` and, for Muon, which trailing axes form the matrix (the leading `layers`
  and `experts` axes are batch axes: one orthogonalization per layer, per expert);
- `hf`: its Hugging Face `DeepseekV3ForCausalLM` name and how it is transposed;
- `where`: which layers hold it.

From it: the model's `layers.weight` (shape, axes, init, dtypes), the per-mesh layout
(parallel/layout.py), the entry casts and gathers (parallel/comm.py), the optimizer's
groups (train/optim.py), QK-clip's head axes (train/qk_clip.py), the export/import map
(interop/hf_layout.py), parameter counts and FLOPs (model/flops.py). A parameter the
model creates without a row here is an error when the model is first traced.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import jax

from europa_jax.config import ModelConfig

# The layer stacks, in model order: the decoder's, then the multi-token prediction modules
# (model/mtp.py: a MoE block's roles plus the `mtp_layers` rows). Unrolled: `<stack>_<i>`.
STACKS = ("dense_layers", "moe_layers", "mtp_layers")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """How far below float32 a parameter may go, and where (master weights are float32)."""

    wire: Literal["fp8", "bf16", "fp32"]  # the lowest dtype its FSDP all-gather may use
    float32_compute: bool  # computed with (and entering the SPMD step) in float32
    float32_export: bool = False  # written as float32 whatever the export dtype


# Matrices: gathered in the configured wire dtype (fp8 on Jupiter), computed in bf16.
MATRIX = Precision(wire="fp8", float32_compute=False)
# Embedding and LM head: logits are precision-sensitive, so never an fp8 gather.
LOGITS = Precision(wire="bf16", float32_compute=False)
# Norm scales: tiny and replicated; RMSNorm runs in float32 like DeepSeek-V3's reference.
NORM = Precision(wire="fp32", float32_compute=True)
# The router: near-tied sigmoid scores decide discrete choices, so its gate and the
# aux-loss-free bias stay float32 everywhere — in the step, on the wire and on disk
# (transformers, too, keeps both in float32 whatever the model dtype).
ROUTING = Precision(wire="fp32", float32_compute=True, float32_export=True)


@dataclasses.dataclass(frozen=True)
class HF:
    """A Hugging Face tensor: its name (inside `model.layers.<i>.` for block roles; with
    `{expert}` for one expert of a stack) and how our array maps onto it.

    `linear`: ours is `x @ W` with the first `n_in` dims the input, HF's `[out, in]`;
    `expert`: the same, per expert of an `[E, in..., out...]` stack; `vector`: copied;
    `embedding`: `[V, D]` both sides; `lm_head`: ours `[D, V]`, HF `[V, D]`. Vocabulary
    padding rows are dropped on export and zero on import."""

    name: str
    n_in: int | None = None
    kind: Literal["linear", "expert", "vector", "embedding", "lm_head"] = "linear"


# Which stacks hold a row: "every_layer" is every block, the MTP modules' included; a
# "moe_layers" row is in the MTP modules too (their blocks are MoE blocks).
Where = Literal["model", "every_layer", "dense_layers", "moe_layers", "mtp_layers"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Param:
    """One parameter role (see the module docstring)."""

    shape: Callable[[ModelConfig], tuple[int, ...]]
    axes: tuple[str, ...]
    optimizer: Literal["muon", "adamw", "adamw_no_decay"]
    hf: HF
    where: Where = "every_layer"
    init: Literal["normal", "ones"] = "normal"
    precision: Precision = MATRIX
    # Muon: (number of trailing reduction axes, number of trailing output axes)
    muon_axes: tuple[int, int] | None = None

    def __post_init__(self):
        if (self.optimizer == "muon") != (self.muon_axes is not None):
            raise ValueError("muon_axes is required for, and only for, Muon parameters")
        if self.muon_axes and sum(self.muon_axes) > len(self.axes):
            raise ValueError(f"muon_axes {self.muon_axes} exceed axes {self.axes}")


def _norm(width: Callable[[ModelConfig], int], hf: str, where: Where = "every_layer") -> Param:
    return Param(shape=lambda m: (width(m),), axes=("norm",), init="ones", precision=NORM,
                 optimizer="adamw_no_decay", hf=HF(hf, kind="vector"), where=where)


def _matrix(shape, axes, hf: str, n_in: int, n_out: int, where: Where = "every_layer",
            kind: Literal["linear", "expert"] = "linear") -> Param:
    """A Muon matrix: the last `n_in + n_out` axes are one matrix, `n_in` of them its input
    (the same split Hugging Face's Linear flattens, so `n_in` serves both)."""
    return Param(shape=shape, axes=axes, optimizer="muon", muon_axes=(n_in, n_out),
                 hf=HF(hf, n_in, kind), where=where)


# Rows in Hugging Face file order: the embedding, then every layer (its non-expert
# tensors in this order, then the router bias, then each expert's), the final norm, the head.
ROWS: dict[str, Param] = {
    "embedding": Param(shape=lambda m: (m.padded_vocab_size, m.d_model), axes=("vocab", "embed"),
                       precision=LOGITS, optimizer="adamw", where="model",
                       hf=HF("model.embed_tokens.weight", kind="embedding")),
    # --- a multi-token prediction module's own (DeepSeek-V3 §2.2, model/mtp.py): the norms
    # of the next token's embedding and of the previous state, and their projection
    # [embedding; state] (2·D) → D. Its embedding and head are the model's.
    "enorm.scale": _norm(lambda m: m.d_model, "enorm.weight", where="mtp_layers"),
    "hnorm.scale": _norm(lambda m: m.d_model, "hnorm.weight", where="mtp_layers"),
    "eh_proj": _matrix(lambda m: (2 * m.d_model, m.d_model), ("mtp_concat", "embed"),
                       "eh_proj.weight", 1, 1, where="mtp_layers"),
    # --- attention (MLA: low-rank q and kv, decoupled RoPE key shared by the heads)
    "attention.w_q_a": _matrix(lambda m: (m.d_model, m.q_lora_rank), ("embed", "q_lora"),
                               "self_attn.q_a_proj.weight", 1, 1),
    "attention.q_a_norm.scale": _norm(lambda m: m.q_lora_rank, "self_attn.q_a_layernorm.weight"),
    # head_dim: N no-RoPE, then P RoPE dims (QK-clip scales them by head)
    "attention.w_q_b": _matrix(lambda m: (m.q_lora_rank, m.n_heads, m.qk_head_dim),
                               ("q_lora", "heads", "head_dim"), "self_attn.q_b_proj.weight", 1, 2),
    "attention.w_kv_a": _matrix(lambda m: (m.d_model, m.kv_lora_rank + m.qk_rope_head_dim),
                                ("embed", "kv_lora"), "self_attn.kv_a_proj_with_mqa.weight", 1, 1),
    "attention.kv_a_norm.scale": _norm(lambda m: m.kv_lora_rank,
                                       "self_attn.kv_a_layernorm.weight"),
    # head_dim: N no-RoPE key, then O value dims
    "attention.w_kv_b": _matrix(
        lambda m: (m.kv_lora_rank, m.n_heads, m.qk_nope_head_dim + m.v_head_dim),
        ("kv_lora", "heads", "head_dim"), "self_attn.kv_b_proj.weight", 1, 2),
    "attention.w_o": _matrix(lambda m: (m.n_heads, m.v_head_dim, m.d_model),
                             ("heads", "head_dim", "embed"), "self_attn.o_proj.weight", 2, 1),
    "attention_norm.scale": _norm(lambda m: m.d_model, "input_layernorm.weight"),
    "mlp_norm.scale": _norm(lambda m: m.d_model, "post_attention_layernorm.weight"),
    # --- dense layers' MLP
    "mlp.w_gate": _matrix(lambda m: (m.d_model, m.dense_ffn_dim), ("embed", "mlp"),
                          "mlp.gate_proj.weight", 1, 1, where="dense_layers"),
    "mlp.w_up": _matrix(lambda m: (m.d_model, m.dense_ffn_dim), ("embed", "mlp"),
                        "mlp.up_proj.weight", 1, 1, where="dense_layers"),
    "mlp.w_down": _matrix(lambda m: (m.dense_ffn_dim, m.d_model), ("mlp", "embed"),
                          "mlp.down_proj.weight", 1, 1, where="dense_layers"),
    # --- MoE layers. The router gate stays on AdamW: its columns are per-expert classifier
    # directions whose individual scales decide routing (optim.py).
    "moe.w_router": Param(shape=lambda m: (m.d_model, m.n_routed_experts), axes=("embed", "router"),
                          precision=ROUTING, optimizer="adamw", where="moe_layers",
                          hf=HF("mlp.gate.weight", 1)),
    "moe.shared.w_gate": _matrix(lambda m: (m.d_model, m.n_shared_experts * m.expert_ffn_dim),
                                 ("embed", "mlp"), "mlp.shared_experts.gate_proj.weight", 1, 1,
                                 where="moe_layers"),
    "moe.shared.w_up": _matrix(lambda m: (m.d_model, m.n_shared_experts * m.expert_ffn_dim),
                               ("embed", "mlp"), "mlp.shared_experts.up_proj.weight", 1, 1,
                               where="moe_layers"),
    "moe.shared.w_down": _matrix(lambda m: (m.n_shared_experts * m.expert_ffn_dim, m.d_model),
                                 ("mlp", "embed"), "mlp.shared_experts.down_proj.weight", 1, 1,
                                 where="moe_layers"),
    # routed experts [E, in, out]: experts stay inside a node, each matrix FSDP over nodes
    "moe.w_gate": _matrix(lambda m: (m.n_routed_experts, m.d_model, m.expert_ffn_dim),
                          ("experts", "expert_embed", "expert_mlp"),
                          "mlp.experts.{expert}.gate_proj.weight", 1, 1, "moe_layers", "expert"),
    "moe.w_up": _matrix(lambda m: (m.n_routed_experts, m.d_model, m.expert_ffn_dim),
                        ("experts", "expert_embed", "expert_mlp"),
                        "mlp.experts.{expert}.up_proj.weight", 1, 1, "moe_layers", "expert"),
    "moe.w_down": _matrix(lambda m: (m.n_routed_experts, m.expert_ffn_dim, m.d_model),
                          ("experts", "expert_mlp", "expert_embed"),
                          "mlp.experts.{expert}.down_proj.weight", 1, 1, "moe_layers", "expert"),
    "head_norm.scale": _norm(lambda m: m.d_model, "shared_head.norm.weight", where="mtp_layers"),
    # --- the model's head
    "final_norm.scale": _norm(lambda m: m.d_model, "model.norm.weight", where="model"),
    "lm_head": Param(shape=lambda m: (m.d_model, m.padded_vocab_size), axes=("embed", "vocab"),
                     precision=LOGITS, optimizer="adamw", where="model",
                     hf=HF("lm_head.weight", kind="lm_head")),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterBias:
    """The aux-loss-free balancing bias `[L_moe + K, E]` (the MoE layers, then the K MTP
    modules' blocks): train state, not a parameter (no gradient), but read by the router
    and exported beside its gate."""

    key: str = "router_bias_LE"  # in the train state and its checkpoint
    precision: Precision = ROUTING
    hf: HF = HF("mlp.gate.e_score_correction_bias", kind="vector")

    @staticmethod
    def shape(m: ModelConfig) -> tuple[int, int]:
        return (m.n_moe_layers + m.mtp_layers, m.n_routed_experts)


ROUTER_BIAS = RouterBias()


# ----------------------------------------------------------------------------- lookups


def row(role: str) -> Param:
    """The row of a role; an undeclared one is an error that says where to declare it."""
    try:
        return ROWS[role]
    except KeyError:
        raise KeyError(f"parameter role {role!r} is not declared in europa_jax/param_table.py "
                       "(add a row to param_table.ROWS)") from None


def key_names(path) -> tuple[str, ...]:
    """A tree path's keys as strings (dict keys, attribute names, sequence indices)."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return tuple(names)


def stack_key(stack: str, index: int, scanned: bool) -> tuple[str, tuple[int, ...]]:
    """Where layer `index` of `stack` lives: (parameter key, index into it)."""
    return (stack, (index,)) if scanned else (f"{stack}_{index}", ())


def split_path(path) -> tuple[str | None, str]:
    """(the layer stack a parameter path is in, or None; its role), e.g.
    ('moe_layers', 'moe.w_gate') for `moe_layers.moe.w_gate` or `moe_layers_3.moe.w_gate`.
    `path`: a jax tree path or a tuple of names."""
    names = key_names(path)
    for stack in STACKS:
        head = names[0]
        if head == stack or (head.startswith(stack + "_") and head[len(stack) + 1:].isdigit()):
            return stack, ".".join(names[1:])
    return None, ".".join(names)


def row_of_path(path) -> Param:
    return row(split_path(path)[1])


def layer_count(p: Param, m: ModelConfig) -> int:
    """How many copies of the row the main model holds (1 for the model's own parameters;
    the MTP modules' are `mtp_count`)."""
    return {"model": 1, "every_layer": m.n_layers, "dense_layers": m.n_dense_layers,
            "moe_layers": m.n_moe_layers, "mtp_layers": 0}[p.where]


def mtp_count(p: Param, m: ModelConfig) -> int:
    """How many copies of the row the MTP modules hold (each is a MoE block and its own)."""
    return m.mtp_layers if stack_holds("mtp_layers", p) else 0


def stack_holds(stack: str, p: Param) -> bool:
    """Whether the layers of `stack` (one of STACKS) hold the row."""
    return p.where in {"dense_layers": ("every_layer", "dense_layers"),
                       "moe_layers": ("every_layer", "moe_layers"),
                       "mtp_layers": ("every_layer", "moe_layers", "mtp_layers")}[stack]


def model_shapes(abstract_params: Any, m: ModelConfig) -> Any:
    """The tree of shape tuples the model computes with (stacked layers keep their leading
    axis): the stored shapes without storage padding (execution.param_pad_multiple)."""
    def shape(path, leaf):
        own = tuple(row_of_path(path).shape(m))
        return tuple(leaf.shape[:leaf.ndim - len(own)]) + own

    return jax.tree_util.tree_map_with_path(shape, abstract_params)


def size(p: Param, m: ModelConfig) -> int:
    return math.prod(p.shape(m))
