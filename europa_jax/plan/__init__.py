"""`europa-jax plan`: the real step compiled for N CPUs or Hopper GPUs without them, read
back (memory by kind, collectives, FLOPs, kernels) and turned into a GH200 estimate."""
