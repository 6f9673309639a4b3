"""Serving caches: attention_with_kvcache and the plans of a decode step."""
