"""What the layers keep: their KV cache and torch state dicts."""
