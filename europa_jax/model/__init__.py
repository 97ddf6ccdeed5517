"""The DeepSeek-V3/Kimi-K2-family model in Flax: building blocks, MLA attention, the MoE,
the decoder stack and LM head; which kernel each op uses; parameter counts and FLOPs.
Model code names logical axes only; it reaches the mesh through `parallel.comm`."""
