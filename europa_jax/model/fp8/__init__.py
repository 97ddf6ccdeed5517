"""FP8 weight GEMMs: DeepSeek-V3's block-scaled GEMM emulated exactly, its grouped Pallas
Mosaic GPU kernel, and the model's FP8 linear layers (per-tensor or block scales)."""
