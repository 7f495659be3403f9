"""Meshes, logical sharding rules and the layer-stacking (scan) primitive."""
