"""The machine the plan estimates for: one GH200 of a JUPITER Booster node, with sources.

Every number is per GPU and per direction unless it says otherwise. Sources:
[jsc]   JSC, "JUPITER configuration", apps.fz-juelich.de/jsc/hps/jupiter/configuration.html:
        4× GH200 per node; Hopper with 96 GB HBM3 at 4 TB/s; NVLink-C2C CPU↔GPU at 900 GB/s;
        NVLink 4 between every pair of GPUs, 300 GB/s per pair (150 GB/s per direction);
        4× InfiniBand NDR200 (ConnectX-7) per node; GH200 TDP 680 W.
[h100]  NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOP/s dense BF16 (1,979 with
        2:4 sparsity); the GH200 datasheet lists the same Hopper GPU.
[fa3]   Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608): ~75 % of H100 BF16 peak in
        the attention forward; large cuBLAS BF16 GEMMs reach a similar fraction.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    bf16_flops: float  # dense peak
    hbm_bytes: float
    hbm_bandwidth: float
    # Host memory the plan may fill per GPU (optimizer state, offloaded activations).
    host_bytes: float
    c2c_bandwidth: float  # host ↔ device over NVLink-C2C
    nvlink_pair_bandwidth: float  # to one other GPU of the node
    gpus_per_node: int
    network_bandwidth: float  # InfiniBand, one HCA per GPU
    # What a tuned step reaches of those peaks (assumptions, stated in every plan).
    compute_efficiency: float
    link_efficiency: float

    def nvlink_bandwidth(self, peers: int) -> float:
        """A GPU's NVLink bandwidth to `peers` GPUs of its node at once.

        The quad is fully connected, one link bundle per pair [jsc], so an exchange with
        every peer (all-to-all; NCCL rings run a channel per link) uses them all together.
        """
        return self.nvlink_pair_bandwidth * max(1, min(peers, self.gpus_per_node - 1))


HOST_BYTES_STRICT = 30e9

GH200_JUPITER = Hardware(
    name="GH200 (JUPITER Booster)",
    bf16_flops=989e12,  # [h100]; JUPITER caps the superchip at 680 W [jsc], so sustained
    #                     clocks may sit below NVIDIA's 900 W-class figures
    hbm_bytes=96e9,  # [jsc]
    hbm_bandwidth=4.0e12,  # [jsc]
    # Each GH200 superchip has its own Grace CPU with 120 GB of LPDDR5X [jsc]; launch/env.sh
    # caps XLA's pinned host pool per GPU at 96 GB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB),
    # leaving 24 GB for the OS, the process and its input pipeline. (A stricter reading,
    # 120 GB per node = 30 GB per GPU, is HOST_BYTES_STRICT: the plan says if a run fits it.)
    host_bytes=96e9,
    c2c_bandwidth=450e9,  # 900 GB/s both directions together [jsc]
    nvlink_pair_bandwidth=150e9,  # [jsc]
    gpus_per_node=4,  # [jsc]
    network_bandwidth=25e9,  # NDR200 = 200 Gb/s, one HCA per GPU [jsc]
    compute_efficiency=0.6,  # below [fa3]'s ~75 %: a whole step mixes in smaller kernels
    link_efficiency=0.8,  # NCCL reaches ~80–90 % of line rate on large messages
)
