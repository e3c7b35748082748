"""Pure index math over numpy: no torch, no jax, no I/O."""

from bridge.layout.boxes import Box

__all__ = ["Box"]
