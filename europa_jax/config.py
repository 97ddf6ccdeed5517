"""Typed run configuration: one frozen dataclass per concern, loaded from YAML.

Every check that can be made before a compile is made here, so a bad config fails in a
second with a one-line `ConfigError` naming the key and value instead of deep in XLA.
The model's section is config_model.py, how it runs config_execution.py and the train
section config_train.py (all re-exported here), the shared error and checks
config_checks.py; reading YAML into these classes is config_loader.py. None of them
imports jax: the CLI reads a config before it decides how many CPU devices jax should
create.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# re-exported: `from europa_jax.config import ConfigError, ModelConfig` everywhere
from europa_jax.config_checks import ConfigError, positive  # noqa: F401
from europa_jax.config_execution import ExecutionConfig
from europa_jax.config_model import ModelConfig, RopeScalingConfig  # noqa: F401
from europa_jax.config_train import TrainConfig


# A row needs at least one input token and its next-token target.
MIN_SEQ_LEN = 2
# The byte-level tokenizer's vocabulary: 256 bytes and an end-of-document token. The
# default corpus (the Python standard library's sources) is byte-level, so a config that
# trains on it needs at least this many rows.
BYTE_VOCAB_SIZE = 257


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh `(data, expert)`; `expert` is the devices of one node (NVLink)."""

    data: int = 1
    expert: int = 1
    # Expert groups spanning nodes put the MoE all-to-all on InfiniBand: refused unless set.
    allow_cross_node_experts: bool = False
    # Devices of one node (JUPITER: 4 GH200). An expert axis wider than this spans
    # `expert_nodes` nodes: its routing must then be node-limited along node boundaries
    # (Config checks) and attention context parallelism stays inside each node. The plan
    # lays its GPU topology out with this many GPUs per host.
    devices_per_node: int = 4

    def __post_init__(self):
        _positive(self, "data", "expert", "devices_per_node")
        # (whether a group really crosses nodes is known from the processes: sharding.py)
        if self.expert > self.devices_per_node and self.expert % self.devices_per_node:
            raise ConfigError(
                f"mesh.expert: {self.expert} spans nodes but is not a multiple of "
                f"mesh.devices_per_node={self.devices_per_node} (whole nodes per group)")

    @property
    def n_devices(self) -> int:
        return self.data * self.expert

    @property
    def expert_nodes(self) -> int:
        """Nodes one expert group spans (1 while it fits in a node)."""
        return max(1, self.expert // self.devices_per_node)

    @property
    def node_group(self) -> int:
        """Devices of one expert group inside one node: who shares a node's attention."""
        return min(self.expert, self.devices_per_node)


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """Wire dtypes of the FSDP traffic and the MoE exchange implementation (comm.py)."""

    weight_gather_dtype: Literal["fp8", "bf16", "fp32"] = "fp32"
    grad_reduce_dtype: Literal["bf16", "fp32"] = "fp32"
    # ragged_all_to_all on GPU/TPU; dense all_to_all of worst-case buffers elsewhere.
    expert_exchange: Literal["auto", "dense", "ragged"] = "auto"
    # fp8: the dispatch's token rows in e4m3 with a scale per 128 values, the combine and
    # the backward's exchanges in bf16 (DeepSeek-V3's practice; parallel/fp8_rows.py)
    expert_exchange_dtype: Literal["fp8", "bf16", "fp32"] = "fp32"
    # An expert axis across nodes: `direct` sends a token's row to each GPU of its experts
    # (over InfiniBand for GPUs of other nodes); `two_stage` once to each node of its
    # experts, then over the node's NVLink (model/experts/node_dispatch.py).
    expert_dispatch: Literal["direct", "two_stage"] = "direct"


ACTIVATION_PRESETS = ("none", "full_remat", "offload_layer_inputs", "offload_attention_moe",
                      "save_dots")
# The presets that keep each layer's input for the backward (offload.py PRESETS).
PRESETS_KEEPING_LAYER_INPUT = ("offload_layer_inputs", "offload_attention_moe")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What lives in host memory (XLA memory kind `pinned_host`) instead of HBM (offload.py)."""

    optimizer_state: bool = False
    master_params: bool = False
    # Saved-activation policy by name (offload.py PRESETS); `none` keeps execution.remat's choice.
    activations: str = "none"

    def __post_init__(self):
        if self.activations not in ACTIVATION_PRESETS:
            raise ConfigError(f"offload.activations: {self.activations!r} is not one of: "
                              + ", ".join(ACTIVATION_PRESETS))


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Muon (Jordan 2024; Liu et al. 2025, arXiv:2502.16982) for hidden matrices, AdamW for the rest."""

    learning_rate: float = 3e-3
    # Warmup-stable-decay: linear warmup, constant, then linear decay to min_lr_ratio × peak.
    warmup_steps: int = 10
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_grad_norm: float = 1.0
    muon_beta: float = 0.95
    muon_ns_steps: int = 5
    # The dtype Newton–Schulz runs in, and Muon's re-layout moves (muon_sharded.py). The
    # reference Muon (github.com/KellerJordan/Muon) runs it in bfloat16: half the re-layout's
    # bytes, and BF16 GEMMs where float32 ones run in TF32 at half the peak on a GPU.
    muon_ns_dtype: Literal["float32", "bfloat16"] = "float32"
    # Moonlight/Kimi RMS matching: Muon updates scaled to AdamW's RMS so one lr serves both.
    muon_consistent_rms: float = 0.2
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    # MuonClip (Kimi K2, arXiv:2507.20534 §2.1): after each update, heads whose largest
    # attention logit of the step exceeded τ get their q/k projections scaled so that it
    # would be τ (qk_clip.py). K2 used τ = 100; null or 0 = off.
    qk_clip_threshold: float | None = None

    def __post_init__(self):
        _positive(self, "learning_rate", "muon_ns_steps", "adam_eps")
        if self.qk_clip_threshold is not None and not self.qk_clip_threshold >= 0:
            raise ConfigError(f"optim.qk_clip_threshold: {self.qk_clip_threshold} must be "
                              "positive, 0 or null (off)")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps: {self.warmup_steps} must be >= 0")
        for key in ("decay_fraction", "min_lr_ratio", "muon_beta", "adam_b1", "adam_b2"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"optim.{key}: {value} must be in [0, 1]")
        if self.weight_decay < 0 or self.clip_grad_norm < 0:
            raise ConfigError("optim.weight_decay and optim.clip_grad_norm must be >= 0 "
                              f"(got {self.weight_decay}, {self.clip_grad_norm})")


@dataclass(frozen=True, kw_only=True)
class MixtureSource:
    """One prepared corpus of a mixture (data.sources) and its share of every batch."""

    path: str
    weight: float

    def __post_init__(self):
        if not self.weight > 0:
            raise ConfigError(f"data.sources: {self.path}: weight {self.weight} must be > 0")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Input pipeline (europa_jax/data/pipeline.py): which corpus, how rows are packed and balanced."""

    # stdlib: this interpreter's standard library, prepared into a cache on first use;
    # prepared: a directory written by `europa-jax prepare` (data.path).
    source: Literal["stdlib", "prepared"] = "stdlib"
    path: str | None = None
    # A weighted mixture of prepared corpora made with one tokenizer, instead of `path`:
    # [{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]; weights are
    # normalized, and every batch holds each corpus's share of its tokens (data/batch_plan.py).
    sources: tuple[MixtureSource, ...] = ()
    # Expected tokenizer ("bytes" or a tokenizer.json); a corpus prepared with another one
    # is refused.  null: trust the corpus manifest.
    tokenizer: str | None = None
    seq_len: int = 256
    global_batch_size: int = 8
    seed: int = 0
    max_documents: int | None = None
    # Pack and lay out rows so every rank's attention cost (Σ document length²) is even.
    balance: bool = True
    # Batches prepared ahead in a background thread (0: made on demand).
    prefetch: int = 2
    # Batches mix documents: the pieces (at most a row each) of this many stream tokens,
    # rounded down to whole global batches and at least one, are shuffled together
    # (data/batch_plan.py). 0: each batch is the stream's next B·S tokens (runs saved before).
    shuffle_window_tokens: int = 1 << 24
    # Validation documents (train.eval_every): a fraction of this corpus's documents held
    # out of training (chosen by a hash of the document index and data.seed: the same
    # split on every process and every resume), or a prepared corpus of its own.
    validation_fraction: float = 0.0
    validation_path: str | None = None

    def __post_init__(self):
        _positive(self, "seq_len", "global_batch_size")
        if self.seq_len < MIN_SEQ_LEN:
            raise ConfigError(f"data.seq_len: {self.seq_len} is below the minimum {MIN_SEQ_LEN} "
                              "(a row needs an input and a target token)")
        if self.max_documents is not None and self.max_documents <= 0:
            raise ConfigError(f"data.max_documents: {self.max_documents} must be positive or null")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"data.seed: {self.seed} must be in [0, 2**32)")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch: {self.prefetch} must be >= 0")
        if self.shuffle_window_tokens < 0:
            raise ConfigError(f"data.shuffle_window_tokens: {self.shuffle_window_tokens} must "
                              "be >= 0 (0: no shuffle across batches)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"data.validation_fraction: {self.validation_fraction} must be in "
                              "[0, 1)")
        if self.validation_fraction and self.validation_path:
            raise ConfigError(f"data.validation_path: {self.validation_path!r} and "
                              f"data.validation_fraction {self.validation_fraction}: choose one")
        if self.sources and (self.source != "prepared" or self.path):
            raise ConfigError("data.sources: a mixture needs data.source: prepared and no "
                              f"data.path (got source {self.source!r}, path {self.path!r})")
        paths = [s.path for s in self.sources]
        if len(set(paths)) != len(paths):
            raise ConfigError(f"data.sources: a corpus appears twice in {paths}")
        if self.source == "prepared" and not (self.path or self.sources):
            raise ConfigError("data.path: required when data.source is 'prepared' (a directory "
                              "written by `europa-jax prepare`), or data.sources for a mixture")
        if self.source == "stdlib" and self.path is not None:
            raise ConfigError(f"data.path: {self.path!r} is only used with data.source: prepared")
        if self.source == "stdlib" and self.tokenizer not in (None, "bytes"):
            raise ConfigError(f"data.tokenizer: {self.tokenizer!r} but the stdlib corpus is "
                              "byte-level ('bytes' or null)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpoints in `<run_dir>/checkpoints` and what a run does on a non-finite step."""

    # A save every N steps (0: none); a run also saves at its end and when preempted.
    every_steps: int = 100
    keep: int = 3  # the newest K; >= 2 lets a corrupted latest fall back to the one before
    # Device→host copy blocks the loop; the write to disk overlaps the following steps.
    async_save: bool = True
    # A step whose loss or gradient norm is NaN/Inf never changes the state (train.py);
    # "skip" goes on with the next batch, "stop" ends the run keeping the last checkpoint.
    nan_policy: Literal["skip", "stop"] = "skip"
    max_consecutive_skips: int = 10  # then "skip" stops too: the run is not recovering
    # A save that fails (a full disk, a file system error) is reported when the loop learns
    # of it; "stop" ends the run (exit 1) keeping the last good checkpoint, "continue" trains
    # on to the next save. The final and preemption saves end the run either way.
    on_save_error: Literal["stop", "continue"] = "stop"
    # Loss spikes (run/spikes.py): a finite step whose loss exceeds the mean +
    # spike_sigmas·σ of the last spike_window healthy steps (OLMo-core's skip-step rule:
    # 128 steps, 6σ; a gradient norm only with the loss up too, or no clip) rolls the run
    # back to its last checkpoint and goes on with the batches after it (PaLM's remedy);
    # after max_spike_rollbacks rollbacks with no checkpoint settling between them it stops
    # (exit 3). spike_window 0 turns it off.
    spike_window: int = 128
    spike_sigmas: float = 6.0
    max_spike_rollbacks: int = 3

    def __post_init__(self):
        _positive(self, "keep", "max_consecutive_skips", "max_spike_rollbacks")
        if self.spike_window < 0 or not self.spike_sigmas > 0:
            raise ConfigError(f"checkpoint.spike_window: {self.spike_window} and "
                              f"checkpoint.spike_sigmas: {self.spike_sigmas} must be >= 0 "
                              "and > 0 (spike_window 0 turns spike detection off)")
        if self.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps: {self.every_steps} must be >= 0 "
                              "(0 saves only at the end and on preemption)")


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        m, ex, mesh, data = self.model, self.execution, self.mesh, self.data
        if m.n_routed_experts % mesh.expert:
            raise ConfigError(f"model.n_routed_experts: {m.n_routed_experts} is not divisible by "
                              f"mesh.expert={mesh.expert}")
        if data.seq_len % ex.attention_block_size:
            raise ConfigError(f"data.seq_len: {data.seq_len} is not divisible by "
                              f"execution.attention_block_size={ex.attention_block_size}")
        if 0 < ex.loss_chunk_tokens < data.seq_len and data.seq_len % ex.loss_chunk_tokens:
            raise ConfigError(f"execution.loss_chunk_tokens: {ex.loss_chunk_tokens} does not "
                              f"divide data.seq_len={data.seq_len} (0 = the whole sequence at "
                              "once)")
        if 0 < ex.moe_chunk_tokens < data.seq_len and data.seq_len % ex.moe_chunk_tokens:
            raise ConfigError(f"execution.moe_chunk_tokens: {ex.moe_chunk_tokens} does not divide "
                              f"data.seq_len={data.seq_len} (0 = all tokens at once)")
        if ex.attention_context_parallel and m.n_heads % mesh.node_group:
            raise ConfigError(f"execution.attention_context_parallel: model.n_heads={m.n_heads} is "
                              f"not divisible by the {mesh.node_group} GPUs of a node's expert "
                              "group (each takes n_heads / that many heads)")
        if self.comm.expert_dispatch == "two_stage" and mesh.expert_nodes == 1:
            raise ConfigError(f"comm.expert_dispatch: two_stage needs an expert axis across "
                              f"nodes; mesh.expert={mesh.expert} fits in one node of "
                              f"mesh.devices_per_node={mesh.devices_per_node}")
        if mesh.expert_nodes > 1 and m.n_group > 1 and m.n_group % mesh.expert_nodes:
            # route() picks whole groups; groups that straddle nodes would not bound the
            # nodes a token's copies cross the network to (DeepSeek-V3 §2.1.2)
            raise ConfigError(f"model.n_group: {m.n_group} is not a multiple of the "
                              f"{mesh.expert_nodes} nodes the expert axis spans (mesh.expert="
                              f"{mesh.expert}, devices_per_node={mesh.devices_per_node}): "
                              "node-limited routing needs every group inside one node")
        local_experts = m.n_routed_experts // mesh.expert
        if ex.moe_expert_groups and local_experts % ex.moe_expert_groups:
            raise ConfigError(f"execution.moe_expert_groups: {ex.moe_expert_groups} does not "
                              f"divide the {local_experts} experts of each device "
                              f"(n_routed_experts / mesh.expert)")
        if data.global_batch_size % mesh.n_devices:
            raise ConfigError(f"data.global_batch_size: {data.global_batch_size} is not divisible "
                              f"by the mesh's {mesh.n_devices} devices (data×expert)")
        rows = data.global_batch_size // mesh.n_devices
        if rows % self.train.microbatches:
            raise ConfigError(f"train.microbatches: {self.train.microbatches} does not divide "
                              f"the {rows} rows each device holds (data.global_batch_size "
                              f"{data.global_batch_size} over {mesh.n_devices} devices)")
        if data.seq_len > m.max_position_embeddings:
            raise ConfigError(f"data.seq_len: {data.seq_len} > model.max_position_embeddings="
                              f"{m.max_position_embeddings}")
        if self.train.eval_every and not (data.validation_fraction or data.validation_path):
            raise ConfigError(f"train.eval_every: {self.train.eval_every} but there are no "
                              "validation documents (set data.validation_fraction or "
                              "data.validation_path)")
        if ex.layer_input_format != "compute_dtype" and \
                self.offload.activations not in PRESETS_KEEPING_LAYER_INPUT:
            raise ConfigError(f"execution.layer_input_format: {ex.layer_input_format} makes the "
                              "kept layer inputs smaller, but offload.activations="
                              f"{self.offload.activations} keeps none (use one of: "
                              + ", ".join(PRESETS_KEEPING_LAYER_INPUT) + ")")
        if data.source == "stdlib" and m.vocab_size < BYTE_VOCAB_SIZE:
            raise ConfigError(f"model.vocab_size: {m.vocab_size} < {BYTE_VOCAB_SIZE} needed by the "
                              "byte-level stdlib corpus")
        self._check_eval_rows()

    def _check_eval_rows(self) -> None:
        """The downstream evaluation's rows [data.global_batch_size, train.eval_tasks_seq_len]
        must suit the kernels as the training rows do (eval/forward.py)."""
        ex, length = self.execution, self.train.eval_tasks_seq_len
        if not length:
            return
        key = f"train.eval_tasks_seq_len: {length}"
        if length > self.data.seq_len:
            raise ConfigError(f"{key} > data.seq_len={self.data.seq_len} (the rows are never "
                              "longer than the training rows)")
        if length % ex.attention_block_size:
            raise ConfigError(f"{key} is not divisible by execution.attention_block_size="
                              f"{ex.attention_block_size}")
        tokens = self.data.global_batch_size // self.mesh.n_devices * length
        if 0 < ex.moe_chunk_tokens < tokens and tokens % ex.moe_chunk_tokens:
            raise ConfigError(f"{key}: execution.moe_chunk_tokens={ex.moe_chunk_tokens} does not "
                              f"divide the {tokens} tokens each device evaluates at once")


def check_device_count(mesh: MeshConfig, n_devices: int, source: str = "") -> None:
    """The mesh must use every device of the job exactly once; `source` says where the
    count came from (e.g. processes × local devices)."""
    if mesh.n_devices != n_devices:
        raise ConfigError(f"mesh: data×expert = {mesh.data}×{mesh.expert} = {mesh.n_devices} "
                          f"but the job has {n_devices} devices{source}; set "
                          "mesh.data/mesh.expert to match or change the job's size")


def _positive(obj: Any, *keys: str) -> None:
    section = {MeshConfig: "mesh", OptimConfig: "optim", DataConfig: "data",
               CheckpointConfig: "checkpoint"}[type(obj)]
    positive(section, obj, *keys)
