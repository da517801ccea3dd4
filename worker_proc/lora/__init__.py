"""LoRA adapters on a worker rank: the adapter slots' tensors (`slots.LoraSlots`) and the product each
linear layer adds for the rows of its step that run under an adapter (`layer.LoraLayer`)."""
