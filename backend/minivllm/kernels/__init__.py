"""Compute kernels, one home for all of them: `cpu/` (our C++ AVX2 / AVX-512 kernels and their loader)
and `triton/` (the GPU paged-attention kernel). Quantization formats and the per-weight kernel choice
live in `quant/`; this package knows nothing of them beyond the tensors it is handed."""
