"""Inspection of logical checkpoints: open, stats, blocks, streaming reads, diffs, formatting."""
