"""europa-jax: a JAX/XLA stack for pretraining DeepSeek-V3/Kimi-K2-family MoE models on
GH200 clusters.

The package is a core (`config` with `config_model`, `config_train` and `config_checks`,
`config_loader`, `param_table`, `cli`) and its wings, each importing only the core and the
wings before it: data, parallel < model < train < plan < job < store, records < interop <
eval < run (docs/architecture.md).

Shape suffixes — one legend for the whole project. A tensor's name ends in the letters of
its dimensions, in order (`x_BSD`, `w_up_EDF`, `cos_BSP2`); einsum strings use the same
letters in lower case where they can.

    A  kv latent (low-rank) width; w_kv_a's output also carries the P RoPE dims
    B  batch rows (the packed rows of a batch)
    C  capacity: slots for each peer in the MoE exchange
    D  model width
    E  routed experts (inside the SPMD step: this device's)
    F  feed-forward width (a dense MLP, one expert, the shared experts)
    G  expert groups (group-limited routing)
    H  attention heads
    I  sources of a data mixture
    J  devices: peers on the expert axis; ranks sharing a global batch
    K  q/k head dims (N + P)
    L  layers
    M  rows sorted by expert: one per (row, chosen expert)
    N  no-RoPE q/k head dims
    O  value head dims
    P  RoPE head dims (P2 = P/2 rotation pairs)
    Q  q latent (low-rank) width
    R  rows received from the expert-axis peers (J·C)
    S  sequence positions (queries and keys alike)
    T  tokens: a batch flattened (B·S), or a stream of token ids
    U  experts chosen per token (top-k)
    V  vocabulary (padded)
    W  documents of a corpus
    X  pieces something is cut into: attention/loss/MoE blocks or chunks, a batch's
       document pieces before packing
    Y  positions in one block or chunk
    Z  document pieces placed in packed rows
    1  a kept singleton dimension (`k_rope_BS1P`)
"""

import time as _time

# When this process began running europa-jax: every import after this one (jax, flax,
# orbax) is the try's start-up (records/timeline.py). Not the kernel's start time: a shell
# runs the last command of `pip install -e . && europa-jax train …` in its own process
# (exec without fork), whose start is the shell's, before the install.
STARTED_AT = _time.time()
