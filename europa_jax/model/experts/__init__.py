"""The MoE: sigmoid router and the layer (moe), the expert-parallel dispatch inside a node
and across nodes, and the routed experts' SwiGLU (blocked loop on CPU, library grouped
matmul in bounded windows on GPU)."""
