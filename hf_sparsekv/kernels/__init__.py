"""Numerical building blocks of the caches: PyTorch references (the spec) and, on CUDA, Triton kernels."""
