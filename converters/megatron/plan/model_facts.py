"""The model facts a conversion needs, from wherever the run recorded them.

A Megatron-LM training loop stores its `args` in `common_state`; libraries calling
`dist_checkpointing.save` store none. Other trainers keep the same facts in their own files:

- Megatron-Bridge: `run_config.yaml` in the iteration directory, section `model` (TransformerConfig /
  GPT provider field names: `gated_linear_unit`, `num_moe_experts`, `vocab_size` +
  `should_pad_vocab` + `make_vocab_size_divisible_by`), `ddp` (bucket size);
- NeMo 2: `context/model.yaml` next to the `weights/` directory (the model config under `config`);
- the user: `--model-config FILE` (YAML or JSON with Megatron argument names, flat or under `model:`)
  and one flag per fact.

Everything is mapped onto Megatron-LM argument names (what `args` holds), so the rest of the
converter reads one dict. Precedence: flags, then `--model-config`, then the checkpoint's `args`,
then the trainer's own files. Each fact not taken from `args` is reported with its source.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError

#: Megatron argument name -> the CLI flag that supplies it (used in "missing fact" errors)
FLAG_OF = {
    "tensor_model_parallel_size": "--tp",
    "gtp_weight_remat_size": "--gtp",
    "expert_model_parallel_size": "--ep",
    "data_parallel_size": "--dp",
    "pipeline_model_parallel_size": "--pp",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels",
    "swiglu": "--swiglu/--no-swiglu",
    "padded_vocab_size": "--vocab-size",
    "num_layers": "--num-layers",
    "num_experts": "--num-experts",
    "gtp_remat_pad_for_alignment": "--pad-for-alignment",
    "ddp_bucket_size": "--bucket-size",
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
}

#: TransformerConfig / provider field -> Megatron argument name (the same name when absent)
CONFIG_RENAMES = {
    "gated_linear_unit": "swiglu",
    "num_moe_experts": "num_experts",
    "bucket_size": "ddp_bucket_size",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",   # TransformerConfig names
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
}

#: Megatron-Bridge's ConfigContainer section holding the model provider's fields
BRIDGE_MODEL_SECTION = "model"  # foreign: Megatron-Bridge run_config.yaml

#: the facts read from config files (Megatron argument names after renaming)
KNOWN = tuple(FLAG_OF) + ("group_query_attention", "context_parallel_size", "expert_tensor_parallel_size",
                          "vocab_size", "make_vocab_size_divisible_by", "should_pad_vocab",
                          "overlap_grad_reduce", "untie_embeddings_and_output_weights")


@dataclass
class Facts:
    """Megatron-named facts and where each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)

    def offer(self, name: str, value: Any, source: str) -> None:
        """Keep `value` unless a fact of higher precedence already set `name` (sources come in order)."""
        if value is not None and name not in self.values:
            self.values[name] = value
            self.source[name] = source

    def notes(self) -> list[str]:
        """What came from somewhere other than the checkpoint's args, for the report."""
        return [f"{n}={self.values[n]} ({s})" for n, s in self.source.items() if s != "args"]


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: `vocab` rounded up to a multiple of `divisible_by * tp`.

    >>> padded_vocab(50257, 128, 2)
    50432
    """
    m = max(1, divisible_by) * max(1, tp)
    return int(math.ceil(vocab / m) * m)


def _plain_scalar(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str)) or v is None else None


def megatron_names(section: dict, where: str) -> dict[str, Any]:
    """A config section's facts under Megatron argument names (plain scalars only, sizes checked).

    >>> megatron_names({"gated_linear_unit": True, "num_moe_experts": 8, "hidden_size": 64, "x": [1]}, "f")
    {'swiglu': True, 'num_experts': 8, 'hidden_size': 64}
    """
    out: dict[str, Any] = {}
    for k, v in section.items():
        name = CONFIG_RENAMES.get(k, k)
        if name not in KNOWN:
            continue
        v = _plain_scalar(v)
        if v is None:
            continue
        if name in FLAG_OF and name != "swiglu" and not (type(v) is int and 0 <= v < 1 << 40):
            raise BridgeError(f"{where}: {k} is {v!r}, not a size; fix the file or pass {FLAG_OF[name]}")
        out[name] = v
    return out


def _vocab_from(d: dict[str, Any], tp: int | None) -> int | None:
    """The embedding's rows from a config: padded_vocab_size, else vocab_size padded as the trainer does."""
    if d.get("padded_vocab_size") is not None:
        return d["padded_vocab_size"]
    v = d.get("vocab_size")
    if type(v) is not int:
        return None
    if d.get("should_pad_vocab") and d.get("make_vocab_size_divisible_by"):
        return padded_vocab(v, int(d["make_vocab_size_divisible_by"]), tp or 1)
    return v


def _load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise BridgeError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or give the file as JSON") from None

    class Loader(yaml.SafeLoader):
        """Safe loading; tags of other tools (OmegaConf, fiddle) read as plain data."""

    def untagged(loader, suffix, node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return loader.construct_scalar(node)

    Loader.add_multi_constructor("", untagged)
    try:
        return yaml.load(path.read_text(errors="replace"), Loader=Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise BridgeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML / JSON model config as Megatron-named facts: top-level keys, or the `model` section
    (Megatron-Bridge's run_config.yaml), or `config` (NeMo 2's model.yaml), `model.config`, and `ddp`."""
    p = Path(path)
    if not p.is_file():
        raise BridgeError(f"{p}: no such model config file")
    if p.stat().st_size > 64 << 20:
        raise BridgeError(f"{p}: {p.stat().st_size} bytes is not a model config")
    if p.suffix.lower() == ".json":
        try:
            doc = json.loads(p.read_text(errors="replace"))
        except json.JSONDecodeError as e:
            raise BridgeError(f"{p}: not valid JSON ({e})") from None
    else:
        doc = _load_yaml(p)
    if not isinstance(doc, dict):
        raise BridgeError(f"{p}: expected a mapping of model facts, found {type(doc).__name__}")
    out: dict[str, Any] = {}
    model = doc.get(BRIDGE_MODEL_SECTION)
    sections = [doc, doc.get("config"), model, model.get("config") if isinstance(model, dict) else None,
                doc.get("ddp")]
    for sec in sections:
        if isinstance(sec, dict):
            for k, v in megatron_names(sec, str(p)).items():
                out.setdefault(k, v)
    if out.get("swiglu") is not None and type(out["swiglu"]) is not bool:
        raise BridgeError(f"{p}: gated_linear_unit / swiglu is {out['swiglu']!r}, not true/false")
    vocab = _vocab_from(out, out.get("tensor_model_parallel_size"))
    if vocab is not None:
        out["padded_vocab_size"] = vocab
    return out


def trainer_config_files(root: Path) -> list[tuple[str, Path]]:
    """Config files a trainer left next to a torch_dist checkpoint directory `root`, best first."""
    cands = [("Megatron-Bridge run_config.yaml", root / "run_config.yaml"),
             ("NeMo context/model.yaml", root / "context" / "model.yaml"),
             ("NeMo context/model.yaml", root.parent / "context" / "model.yaml")]
    return [(what, p) for what, p in cands if p.is_file()]


def gather(root: Path, args: dict, flags: dict[str, Any], model_config: str | None) -> Facts:
    """Every fact, by precedence: flags, --model-config, the checkpoint's args, trainer files."""
    facts = Facts()
    for name, v in flags.items():
        facts.offer(name, v, f"{FLAG_OF.get(name, name)}")
    if model_config:
        for name, v in read_config_file(model_config).items():
            facts.offer(name, v, f"--model-config {Path(model_config).name}")
    for name, v in args.items():
        facts.offer(name, v, "args")
    for what, path in trainer_config_files(root):
        for name, v in read_config_file(path).items():
            facts.offer(name, v, what)
    return facts


def missing(what: str, names: list[str]) -> BridgeError:
    """The error for a fact nobody recorded: says exactly which flag(s) supply it.

    >>> str(missing("decoder.layers.self_attention.linear_qkv.weight rows", ["num_attention_heads", "num_query_groups"]))
    'decoder.layers.self_attention.linear_qkv.weight rows: the checkpoint records no num_attention_heads, num_query_groups (no args, run_config.yaml or NeMo context); pass --num-attention-heads --num-query-groups (or --model-config FILE)'
    """
    flags = " ".join(dict.fromkeys(FLAG_OF.get(n, "--" + n.replace("_", "-")) for n in names))
    return BridgeError(f"{what}: the checkpoint records no {', '.join(names)} (no args, run_config.yaml or NeMo "
                       f"context); pass {flags} (or --model-config FILE)")
