"""The CUDA kernels of the model, written in Triton, and their `KernelOps` form."""
