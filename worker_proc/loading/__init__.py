"""Reading a checkpoint into a built model (config, safetensors, the built-in model)."""
