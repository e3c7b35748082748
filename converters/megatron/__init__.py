"""Megatron-Core: torch_dist (DCP) reading, format detection, convert, to-megatron, live adapter."""
