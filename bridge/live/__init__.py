"""Live export / reload inside torch.distributed (torch is imported here only).

    from bridge.live import export_state, Exporter, ExportOptions, reload_state, LocalParam, LiveRun

The names are resolved lazily so that `bridge.live.api` (plain dataclasses) stays cheap to import.
"""

from __future__ import annotations

_EXPORTS = {
    "export_state": "bridge.live.export", "ExportReport": "bridge.live.export",
    "export_state_async": "bridge.live.export", "ExportHandle": "bridge.live.background",
    "ExportOptions": "bridge.live.export", "Exporter": "bridge.live.export",
    "reload_state": "bridge.live.reload",
    "LocalParam": "bridge.live.api", "OptimFragment": "bridge.live.api", "QuantizedWeight": "bridge.live.api",
    "LiveRun": "bridge.live.api", "AdamConfig": "bridge.live.api", "ReloadResult": "bridge.live.api",
    "bind_optimizer_state": "bridge.live.fp8",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bridge.live' has no attribute {name!r}")
