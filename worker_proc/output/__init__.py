"""What a step's logits become: logit processing, grammar masks, sampling (rank 0)."""
