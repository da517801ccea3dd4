"""Quantized weights: their formats and products, `--quantization` and pre-quantized checkpoints."""
