"""megatron-core 0.19.2's pipeline layer placement, written out line by line as an independent
reference for `converters.megatron.plan.convert_plan.PipelineSplit` (the tests never use the product's code here).

Transliterated from the 0.19.2 wheel: `TransformerConfig.__post_init__`'s checks of uneven / virtual
pipeline splits (transformer/transformer_config.py), `get_num_layers_to_build`
(transformer/transformer_block.py) and `get_transformer_layer_offset` (transformer/transformer_layer.py),
with `pipeline_model_parallel_layout` unset. `Config` carries the fields those read.

`wheel_functions()` loads the two placement functions from the wheel itself (the repository's
`.whl/megatron_core-0.19.2-*.whl`, git-ignored: None without it), so a test can check this
transliteration against Megatron's own code: importing megatron.core needs CUDA libraries (triton),
so the functions' source is taken out of the wheel with `ast` and run on plain Python objects.
"""

from __future__ import annotations

import ast
import glob
import os
import zipfile
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class Config:
    num_layers: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: None = None


def is_vp_first_stage(vp_stage, vp_size):
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == 0


def is_vp_last_stage(vp_stage, vp_size):
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == (vp_size - 1)


def post_init_check(config: Config) -> None:
    """TransformerConfig.__post_init__'s pipeline-split checks: ValueError where 0.19.2 raises one."""
    if (
        config.num_layers_in_first_pipeline_stage is not None
        or config.num_layers_in_last_pipeline_stage is not None
    ) and (config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split):
        raise ValueError("uneven stages cannot be set with account_for_embedding/loss_in_pipeline_split")
    vpp = config.virtual_pipeline_model_parallel_size
    if config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None:
        pipeline_parallel_size = config.pipeline_model_parallel_size
        num_layers = config.num_layers
        for n in (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage):
            if n is not None:
                if n <= 0:
                    raise ValueError("num_layers_in_first/last_pipeline_stage must be larger than 0")
                if vpp is not None and n % vpp != 0:
                    raise ValueError("layers at first/last stage must be divisible by virtual pipeline degree")
                num_layers -= n
                pipeline_parallel_size -= 1
        if bool(num_layers) != bool(pipeline_parallel_size):
            raise ValueError("Mismatch: middle layers remaining but no middle PP stages (or the reverse)")
        if pipeline_parallel_size and not num_layers % pipeline_parallel_size == 0:
            raise ValueError("number of layers at middle stage must be divisible by the middle PP size")
        if pipeline_parallel_size and vpp is not None:
            if not (num_layers // pipeline_parallel_size) % vpp == 0:
                raise ValueError("layers on each middle pipeline rank must be divisible by the VPP degree")
    elif config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split:
        num_layers = config.num_layers + int(config.account_for_embedding_in_pipeline_split) \
            + int(config.account_for_loss_in_pipeline_split)
        if not num_layers % config.pipeline_model_parallel_size == 0:
            raise ValueError("num_layers (with embedding / loss) must be divisible by PP")
        if vpp is not None and not (num_layers // config.pipeline_model_parallel_size) % vpp == 0:
            raise ValueError("layers on each pipeline rank must be divisible by VPP")


def get_num_layers_to_build(config: Config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    is_first_pp_stage = pp_rank == 0
    is_last_pp_stage = pp_rank == config.pipeline_model_parallel_size - 1
    if config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None:
        assert not (config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split)
        layers_to_distribute = config.num_layers
        pipeline_stages_left = config.pipeline_model_parallel_size
        if config.num_layers_in_first_pipeline_stage is not None:
            layers_to_distribute -= config.num_layers_in_first_pipeline_stage
            pipeline_stages_left -= 1
        if config.num_layers_in_last_pipeline_stage is not None:
            layers_to_distribute -= config.num_layers_in_last_pipeline_stage
            pipeline_stages_left -= 1
        if pipeline_stages_left > 0:
            assert layers_to_distribute % pipeline_stages_left == 0
            num_layers_per_pipeline_rank = layers_to_distribute // pipeline_stages_left
        else:
            num_layers_per_pipeline_rank = 0
        if is_first_pp_stage and config.num_layers_in_first_pipeline_stage is not None:
            num_layers_per_pipeline_rank = config.num_layers_in_first_pipeline_stage
        if is_last_pp_stage and config.num_layers_in_last_pipeline_stage is not None:
            num_layers_per_pipeline_rank = config.num_layers_in_last_pipeline_stage
    else:
        num_layers = config.num_layers
        if config.account_for_embedding_in_pipeline_split:
            num_layers += 1
        if config.account_for_loss_in_pipeline_split:
            num_layers += 1
        assert num_layers % config.pipeline_model_parallel_size == 0
        num_layers_per_pipeline_rank = num_layers // config.pipeline_model_parallel_size
    vp_size = config.virtual_pipeline_model_parallel_size
    if vp_size is not None and config.pipeline_model_parallel_size > 1:
        assert num_layers_per_pipeline_rank % vp_size == 0
        num_layers_to_build = num_layers_per_pipeline_rank // vp_size
    else:
        num_layers_to_build = num_layers_per_pipeline_rank
    if config.account_for_embedding_in_pipeline_split:
        if is_vp_first_stage(vp_stage, vp_size) and is_first_pp_stage:
            num_layers_to_build -= 1
            assert num_layers_to_build >= 0
    if config.account_for_loss_in_pipeline_split:
        if is_vp_last_stage(vp_stage, vp_size) and is_last_pp_stage:
            num_layers_to_build -= 1
            assert num_layers_to_build >= 0
    return num_layers_to_build


def get_transformer_layer_offset(config: Config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    is_first_pp_stage = pp_rank == 0
    if config.pipeline_model_parallel_size == 1:
        return 0
    if config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None:
        middle_pipeline_stages = config.pipeline_model_parallel_size - sum(
            1 if x is not None else 0
            for x in (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage))
        first = config.num_layers_in_first_pipeline_stage or 0
        last = config.num_layers_in_last_pipeline_stage or 0
        middle_num_layers = config.num_layers - first - last
        middle_pipeline_rank = pp_rank if config.num_layers_in_first_pipeline_stage is None else pp_rank - 1
        if (vp_size := config.virtual_pipeline_model_parallel_size) is not None:
            first_v = 0 if config.num_layers_in_first_pipeline_stage is None else first // vp_size
            last_v = 0 if config.num_layers_in_last_pipeline_stage is None else last // vp_size
            middle_v = middle_num_layers // vp_size
            total_virtual_chunks = first_v + middle_v + last_v
            if pp_rank == 0:
                return vp_stage * total_virtual_chunks
            # (ZeroDivisionError with no middle stage: megatron-core fails there)
            return vp_stage * total_virtual_chunks + first_v + middle_pipeline_rank * (middle_v // middle_pipeline_stages)
        per_rank = middle_num_layers // middle_pipeline_stages if middle_pipeline_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_pipeline_rank * per_rank + first
    num_layers = config.num_layers + int(config.account_for_embedding_in_pipeline_split) \
        + int(config.account_for_loss_in_pipeline_split)
    num_layers_per_pipeline_rank = num_layers // config.pipeline_model_parallel_size
    if (vp_size := config.virtual_pipeline_model_parallel_size) is not None:
        offset = vp_stage * (num_layers // vp_size) + pp_rank * (num_layers_per_pipeline_rank // vp_size)
    else:
        offset = pp_rank * num_layers_per_pipeline_rank
    if config.account_for_embedding_in_pipeline_split and not (is_vp_first_stage(vp_stage, vp_size) and is_first_pp_stage):
        offset -= 1
    return offset


def placement(config: Config) -> dict[tuple[int, int], range] | str:
    """(stage, virtual chunk) -> its global layers, as megatron-core builds them; or why it refuses
    (its error's type name) the split."""
    try:
        post_init_check(config)
        vpp = config.virtual_pipeline_model_parallel_size or 1
        out = {}
        for p in range(config.pipeline_model_parallel_size):
            for v in range(vpp):
                vs = v if config.virtual_pipeline_model_parallel_size else None
                n = get_num_layers_to_build(config, vs, p)
                off = get_transformer_layer_offset(config, vs, p)
                out[(p, v)] = range(off, off + n)
        return out
    except (ValueError, AssertionError, ZeroDivisionError) as e:
        return type(e).__name__


def wheel_functions(root: str) -> Optional[dict[str, Callable]]:
    """`get_num_layers_to_build` and `get_transformer_layer_offset` from the megatron-core 0.19.2
    wheel under `root/.whl/`, compiled on their own (imports inside them resolved to the helpers of
    the same wheel's pipeline_parallel/utils.py); None when the wheel is not there."""
    wheels = sorted(glob.glob(os.path.join(root, ".whl", "megatron_core-0.19.2-*.whl")))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as z:
        sources = {f: z.read(f"megatron/core/{f}").decode() for f in
                   ("transformer/transformer_block.py", "transformer/transformer_layer.py",
                    "pipeline_parallel/utils.py")}
    wanted = {"transformer/transformer_block.py": ["get_num_layers_to_build"],
              "transformer/transformer_layer.py": ["get_transformer_layer_offset"],
              "pipeline_parallel/utils.py": ["is_vp_first_stage", "is_vp_last_stage"]}
    env: dict = {"Optional": Optional, "parallel_state": None, "LayerType": None}
    for f in ("pipeline_parallel/utils.py", "transformer/transformer_block.py", "transformer/transformer_layer.py"):
        tree = ast.parse(sources[f])
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted[f]:
                # the function's own local imports name helpers already in env
                node.body = [b for b in node.body if not isinstance(b, (ast.Import, ast.ImportFrom))]
                _strip_imports(node)
                node.returns = None
                for a in node.args.args:
                    a.annotation = None
                module = ast.fix_missing_locations(ast.Module([node], []))
                exec(compile(module, f"megatron/core/{f}", "exec"), env)
    return {k: env[k] for k in ("get_num_layers_to_build", "get_transformer_layer_offset")}


def _strip_imports(fn: ast.FunctionDef) -> None:
    for node in ast.walk(fn):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                kept = [b for b in block if not isinstance(b, (ast.Import, ast.ImportFrom))]
                setattr(node, field, kept or [ast.Pass()])
