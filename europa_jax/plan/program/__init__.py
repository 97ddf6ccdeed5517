"""The step as a compiled program: compiling for a GPU target without one, and reading the
optimized HLO back (collectives and their links, kernels and their classes, HBM traffic)."""
