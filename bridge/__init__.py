"""gtp-bridge: Megatron-Core GTP training state <-> global logical arrays <-> JAX/optax.

Subpackages:
  bridge.layout   pure index math (numpy only): parallel layouts, GTP padding, fused sections,
                  distributed-optimizer buckets, flat range -> boxes, chunk ownership.
  bridge.store    the logical checkpoint: TensorStore specs, owned-chunk writers, commit, readers.
  bridge.live     torch.distributed side: live export / reload, exchanges, FP8, Megatron adapter.
  bridge.jaxside  JAX side: abstract trees, shardings, optax mapping, save back.
"""

__version__ = "0.1.0"
