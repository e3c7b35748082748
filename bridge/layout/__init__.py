"""Pure index math over numpy: no torch, no jax, no I/O.

parallel (rank <-> coords, groups), params (ParamGeometry, GTP split), fused (section tables),
distopt (DistOpt buffers, DP ranges), rectangles (flat range -> boxes, Piece), assemble (reload
direction), legacy (0.19.2 padded grid), ownership (chunk owners + transfers).
"""

from bridge.layout.boxes import Box
from bridge.layout.distopt import BufferLayout, BufferParam, DistOptParam, buffer_layout, owned_ranges
from bridge.layout.fused import FusedSpec, section_array
from bridge.layout.parallel import ParallelLayout, RankGrid
from bridge.layout.params import GtpSplit, ParamGeometry, gtp_shard_dim0
from bridge.layout.rectangles import Piece, flat_run_boxes

__all__ = ["Box", "BufferLayout", "BufferParam", "DistOptParam", "FusedSpec", "GtpSplit", "ParallelLayout",
           "ParamGeometry", "Piece", "RankGrid", "buffer_layout", "flat_run_boxes", "gtp_shard_dim0",
           "owned_ranges", "section_array"]
