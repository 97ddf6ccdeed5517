"""Text to batches: corpus format, `prepare` and its readers, tokenizers, exact packing
with per-rank balancing, mixtures, and the Grain pipeline. Imports only the core."""
