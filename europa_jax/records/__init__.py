"""What a run writes about itself: metrics and events (run_log), trackers (TensorBoard,
W&B), the timeline of phases, goodput, stragglers, and the report read back from them."""
