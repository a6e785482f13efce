"""Triton GPU kernels (imported only where CUDA and triton are present)."""
