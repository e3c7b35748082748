"""Where each fact of a conversion came from: a flag the user passed, the save itself, or a default.

`convert --dry-run` shows every fact with its source, and `convert`'s summary keeps the facts the
user gave (flags, `--model-config`) apart from those inferred from the save. Pure: reads the
`SourceCheckpoint` that `describe` built and the notes it left, nothing on disk but the model
config files `model_facts.gather` reads again (the same precedence, so the same answer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from converters.megatron.plan import model_facts
from converters.megatron.plan.format import Hints, SourceCheckpoint, _as_dict, checked_args

FLAG, SAVE, DEFAULT = "flag", "save", "default"

#: (short name used in reports and notes, Megatron argument name)
LAYOUT_FACTS = (("tp", "tensor_model_parallel_size"), ("gtp", "gtp_weight_remat_size"),
                ("dp", "data_parallel_size"), ("ep", "expert_model_parallel_size"),
                ("pp", "pipeline_model_parallel_size"))
MODEL_FACTS = ("num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "swiglu", "padded_vocab_size", "num_experts")

_NOTE = re.compile(r"^(?P<name>\w+)=(?P<value>\S+) \((?P<why>.*)\)$")


@dataclass(frozen=True)
class Fact:
    """One fact of the conversion: its value, `source` (flag / save / default) and how it was found."""

    name: str
    value: Any
    source: str
    detail: str

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "source": self.source, "detail": self.detail}


def is_given(note: str) -> bool:
    """A note of `SourceCheckpoint.inferred` that records what the user passed (a flag), not an inference.

    >>> is_given("num_attention_heads=32 (--num-attention-heads)"), is_given("tp=2 (chunk offsets)")
    (True, False)
    >>> is_given("model_only: optimizer state (none) left out (--model-only)")
    True
    """
    return re.search(r"\(--[\w-]+[^()]*\)$", note) is not None


def split_notes(notes: list[str]) -> tuple[list[str], list[str]]:
    """(given by the user, inferred from the save) from a conversion's notes, order kept."""
    return [n for n in notes if is_given(n)], [n for n in notes if not is_given(n)]


def fact_sources(src: SourceCheckpoint, hints: Hints) -> list[Fact]:
    """Every fact the conversion rests on, with its source: the layout, GTP padding, optimizer format,
    and the model sizes that are known (recorded, given or inferred)."""
    saved = checked_args(_as_dict(src.common.get("args")), src.ck.root)
    gathered = model_facts.gather(src.ck.root, saved, hints.as_facts(), hints.model_config)
    notes = {m["name"]: m for m in (_NOTE.match(n) for n in src.inferred) if m}

    def source_of(short: str, long: str) -> tuple[str, str] | None:
        how = gathered.source.get(long)
        if how is not None:
            return (FLAG if how.startswith("--") else SAVE), ("checkpoint args" if how == "args" else how)
        note = notes.get(short) or notes.get(long)
        if note is not None:
            return (FLAG if note["why"].startswith("--") else SAVE), note["why"]
        return None

    out: list[Fact] = []
    for short, long in LAYOUT_FACTS:
        found = source_of(short, long)
        if found is None and short == "gtp" and "tensor_parallel_num_weight_shards" in gathered.source:
            found = (SAVE, "checkpoint args (tensor_parallel_num_weight_shards / tp)")
        out.append(Fact(short, getattr(src.layout, short), *(found or (DEFAULT, "not recorded: Megatron's default"))))
    if src.layout.gtp > 1 or hints.pad_for_alignment is not None:
        found = source_of("pad_for_alignment", "gtp_remat_pad_for_alignment")
        if found is None:
            found = (SAVE, "the padded rows stored") if src.legacy else (DEFAULT, "not recorded: 16")
        out.append(Fact("pad_for_alignment", src.pad_for_alignment, *found))
    out.append(Fact("optimizer_format", src.fmt, *((FLAG, "--model-only") if hints.model_only else
                                                   (SAVE, "common state and the entries present"))))
    if src.legacy:
        out.append(Fact("gtp_grid", "0.19.2 padded", SAVE, "stored shapes of the GTP-sharded weights"))
    for name in MODEL_FACTS:
        found = source_of(name, name)
        value = src.args.get(name)
        if value is None and name in notes:
            text = notes[name]["value"]
            value = int(text) if text.isdigit() else text
        if found is not None and value is not None:
            out.append(Fact(name, value, *found))
    return out


#: the run's arguments that set the pipeline split (Megatron-LM names)
SPLIT_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
              "virtual_pipeline_model_parallel_size")


def split_source(src: SourceCheckpoint, hints: Hints) -> str | None:
    """Where the planned pipeline split came from (None: nowhere, Megatron's defaults were assumed)."""
    if any(v is not None for v in (hints.pp_first, hints.pp_last, hints.embedding_in_split, hints.loss_in_split)):
        return "the flags"
    saved = _as_dict(src.common.get("args"))
    if any(k in saved for k in SPLIT_ARGS):
        return "the checkpoint's args"
    if any(src.args.get(k) is not None for k in SPLIT_ARGS):
        return "the run's config"
    return None
