"""What the compiled step costs on GH200s: the hardware and its cited efficiencies, the
work per class, the overlap model and critical path, the MoE exchange, attention balance
over document-length models."""
