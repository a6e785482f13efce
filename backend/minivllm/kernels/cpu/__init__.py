"""Our CPU kernels: C++ sources in this folder, built and loaded as torch operators by `native.py`."""
