"""Model facts and layout flags checked against what a torch_dist save shows, before any work.

A flag, a `--model-config` or a damaged `args` can claim what the save contradicts: 10^8 layers
where the model entries stack 2, 4 pipeline stages for 2 layers.
Convert would record those claims in the logical checkpoint (and to-megatron write them into the
next run's `args`). What the save shows:

- decoder layers: the stacked axis of the `decoder.layers.*` model entries (per-layer keys
  `decoder.layers.<i>.*` in hybrid models: the highest index + 1);
- pipeline stages: the pipeline size must split those layers as megatron-core would (the split the
  run recorded, or, when none is, some split it accepts). The files' rank numbers are no evidence:
  to-megatron names them by writer thread.

Each refusal is one line naming the flag (or `args` entry), its value, the save's value and the fix.
"""

from __future__ import annotations

import re
from bridge.errors import BridgeError
from converters.megatron.plan.fact_sources import split_source
from converters.megatron.plan.format import Hints, SourceCheckpoint, _as_dict
from converters.megatron.plan.model_facts import FLAG_OF
from converters.megatron.plan.convert_plan import PipelineSplit, stage_placement

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d{1,9})\.")


def given_as(src: SourceCheckpoint, hints: Hints, name: str) -> str:
    """Who claimed fact `name`: its flag, the checkpoint's args or the model config."""
    flag = FLAG_OF.get(name, "--" + name.replace("_", "-"))
    if hints.as_facts().get(name) is not None:
        return flag
    if name in _as_dict(src.common.get("args")):
        return f"args.{name} (the checkpoint's)"
    return f"{name} (--model-config or the run's config files)"


def saved_layers(src: SourceCheckpoint) -> int | None:
    """Decoder layers the model entries hold: the stacked axis, or per-layer keys' highest index + 1."""
    stacked = {m.geom.prepend[0] for m in src.models.values() if m.name.startswith("decoder.layers.") and m.geom.prepend}
    if stacked:
        return max(stacked)
    idx = [int(x.group(1)) for x in map(_LAYER_KEY.match, src.models) if x]
    return max(idx) + 1 if idx else None


def check_against_save(src: SourceCheckpoint, hints: Hints) -> None:
    """Refuse a layer count or pipeline size that the save's decoder layers contradict (see the module doc)."""
    root, lay = src.ck.root, src.layout
    layers = saved_layers(src)
    if layers is None:
        return
    claimed = src.args.get("num_layers")
    if claimed is not None and claimed != layers:
        raise BridgeError(f"{root}: {given_as(src, hints, 'num_layers')} {claimed} contradicts the save, whose "
                          f"decoder.layers.* model entries hold {layers} layers; pass --num-layers {layers} (or "
                          f"leave it out)")
    if lay.pp == 1:
        return
    pp = f"{given_as(src, hints, 'pipeline_model_parallel_size')} {lay.pp}"
    if split_source(src, hints) is not None:
        try:
            stage_placement(src.split, layers)
        except BridgeError as e:
            raise BridgeError(f"{root}: {pp} does not fit the save's {layers} decoder layers ({e}); pass the run's "
                              f"--pp") from None
        return
    # nothing recorded the split: some split megatron-core accepts must place the layers
    kinds = ({"embedding_in_split": True}, {"loss_in_split": True}, {"embedding_in_split": True, "loss_in_split": True})
    if lay.pp > layers and not any(_places(PipelineSplit(pp=lay.pp, **kw), layers) for kw in kinds):
        raise BridgeError(f"{root}: {pp} stages cannot hold the save's {layers} decoder layers (megatron-core "
                          f"gives every stage at least one layer, or the embedding / loss); pass the run's --pp")


def _places(split: PipelineSplit, layers: int) -> bool:
    try:
        stage_placement(split, layers)
        return True
    except BridgeError:
        return False
