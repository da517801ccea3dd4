"""One module per model family: each maps its config.json onto `HybridConfig` (shared.model_config)
and the arrangement of the shared blocks, and names itself to the registry as a `Family`. Torch-free."""
