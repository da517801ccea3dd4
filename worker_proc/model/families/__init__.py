"""One module per model family (see shared/architectures.py): each maps its config.json onto
`HybridConfig` and the arrangement of the shared blocks. Torch-free."""
