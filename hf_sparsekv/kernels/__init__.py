"""Numerical building blocks of the caches. Each has a PyTorch reference here (the spec); CUDA Triton kernels
that must match them are added beside their references."""
