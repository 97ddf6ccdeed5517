"""How the step is laid out on the mesh: the `(data, expert)` mesh and the logical→mesh
rules (sharding), each parameter's resolved layout (layout), the explicit collectives of
the SPMD step (comm), and host-memory placement (offload). Imports only the core."""
