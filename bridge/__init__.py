"""gtp-bridge: Megatron-Core (GTP) training state <-> global logical arrays <-> JAX/optax.

The entry points a user needs, all importable from here:

    import bridge
    bridge.convert("runs/gpt", "logical")                      # Megatron torch_dist -> logical checkpoint
    ck = bridge.open_checkpoint("logical"); ck.read(("params", "embedding", "word_embeddings", "weight"))
    bridge.verify("logical")                                   # every stored byte against its digest
    state = bridge.restore("logical", mesh=mesh, optimizer=abstract_opt_state)    # JAX / optax
    bridge.save("after", params=..., opt_state=..., step=..., manifest=state.manifest, plans=state.plans)
    bridge.to_megatron("after", "runs/gpt_tp2", bridge.MegatronTarget(tp=2))     # -> torch_dist
    bridge.write_maxtext("logical", "mt/run/checkpoints")      # -> a MaxText train state (and read_maxtext back)
    bridge.export_megatron(path, model, optimizer)             # live Megatron run (collective)
    bridge.load_megatron(path, model, optimizer)

Each name is imported when first used, so `import bridge` needs neither torch, nor JAX, nor
TensorStore (only the errors are loaded eagerly). Layers: `bridge.layout` (index math), `bridge.format`
(the tree and manifest), `bridge.store` (TensorStore / Orbax files), `bridge.live` (torch.distributed
export / reload), `bridge.jaxside` (JAX restore / save), `bridge.inspect`; `converters.megatron` builds
Megatron-Core knowledge on top of them. docs/ARCHITECTURE.md maps every module.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from bridge.errors import BridgeError, IntegrityError, MissingExtra

__version__ = "0.1.0"

# public name -> (module, attribute): imported on first access (PEP 562)
_LAZY = {
    "open_checkpoint": ("bridge.store", "open_checkpoint"),
    "Checkpoint": ("bridge.store", "Checkpoint"),
    "verify": ("bridge.store", "verify_checkpoint"),
    "convert": ("converters.megatron.convert_entry", "convert"),
    "ConvertOptions": ("converters.megatron.convert", "ConvertOptions"),
    "to_megatron": ("converters.megatron.write.to_megatron", "to_megatron"),
    "MegatronTarget": ("converters.megatron.write.torch_dist", "MegatronTarget"),
    "export_megatron": ("converters.megatron.live.adapter", "export_megatron"),
    "load_megatron": ("converters.megatron.live.adapter", "load_megatron"),
    "export_megatron_async": ("converters.megatron.live.adapter", "export_megatron_async"),
    "AsyncSave": ("converters.megatron.live.async_save", "AsyncSave"),
    "export_state": ("bridge.live.export", "export_state"),
    "export_state_async": ("bridge.live.export", "export_state_async"),
    "ExportOptions": ("bridge.live.export", "ExportOptions"),
    "Exporter": ("bridge.live.export", "Exporter"),
    "reload_state": ("bridge.live.reload", "reload_state"),
    "LiveRun": ("bridge.live.api", "LiveRun"),
    "LocalParam": ("bridge.live.api", "LocalParam"),
    "restore": ("bridge.jaxside.restore", "restore"),
    "save": ("bridge.jaxside.save", "save"),
    "optimizer_from_manifest": ("bridge.jaxside.manifest_view", "optimizer_from_manifest"),
    "ShardingRules": ("bridge.jaxside.sharding_rules", "ShardingRules"),
    "write_maxtext": ("bridge.jaxside.presets.maxtext_stream", "write_maxtext"),
    "read_maxtext": ("bridge.jaxside.presets.maxtext_stream", "read_maxtext"),
}

__all__ = ["BridgeError", "IntegrityError", "MissingExtra", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'bridge' has no attribute {name!r}") from None
    if module.startswith("bridge.jaxside."):
        import_module("bridge.jaxside")  # its package says in one line which extra is missing
    value = getattr(import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
