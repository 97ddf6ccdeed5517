"""The train step: state built shape-first, the pure `train_step`, Muon/AdamW (with
Newton–Schulz spread over the mesh) and MuonClip's QK-clip."""
