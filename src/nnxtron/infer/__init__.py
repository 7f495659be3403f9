"""Inference: sampling (KV caches come in a later issue)."""
