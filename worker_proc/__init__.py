"""Worker process package: model runtime, state pools, kernels, checkpoint loading."""
