"""Fused projections: section tables and the TP-local row order of each kind.

A fused weight's TP-local tensor (what a plain TP run holds on TP rank t) is a row concatenation of
*segments*; each segment is a run of rows of one semantic section (megatron-layout.md §6):

- `concat` (SwiGLU fc1 gate/up, Mamba in_proj z/x/B/C/dt, Mamba conv1d x/B/C, GDN in_proj
  query/key/value/z/beta/alpha, GDN conv1d, and their biases): TP splits every section
  separately, TP-local = [sec_0 rows t·n_0.. | sec_1 rows t·n_1.. | ...], n_k = rows_k / TP.
- `grouped` (attention linear_qkv with GQA): the fused rows are group-major
  [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...] per query group; TP splits whole groups; logically each
  section is stored de-interleaved (query = all query heads in order, key, value).

Logical rows of section k held by TP rank t: [t·n_k, (t+1)·n_k). Logical array of a section:
`section_array(param_name, section)` (Megatron's `<key>.<section>` convention).

>>> spec = FusedSpec.qkv(num_heads=4, num_query_groups=2, head_dim=1)
>>> [(s.section, s.local_row, s.section_row, s.rows) for s in spec.segments(tp=1)]
[('query', 0, 0, 2), ('key', 2, 0, 1), ('value', 3, 0, 1), ('query', 4, 2, 2), ('key', 6, 1, 1), ('value', 7, 1, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from bridge.errors import BridgeError

KINDS = ("concat", "grouped")
FORMAT = 1


def section_array(name: str, section: str) -> str:
    """Logical array name of one section of fused parameter `name`.

    >>> section_array("decoder.layers.mlp.linear_fc1.weight", "gate")
    'decoder.layers.mlp.linear_fc1.weight.gate'
    """
    return f"{name}.{section}"


@dataclass(frozen=True)
class Section:
    """One semantic section: its name and its global logical rows (a TP=1 run)."""

    name: str
    rows: int


@dataclass(frozen=True)
class Segment:
    """A run of TP-local fused rows [local_row, local_row+rows) = rows
    [section_row, section_row+rows) of that TP rank's part of `section` (n_k rows per TP rank)."""

    section: str
    local_row: int
    section_row: int
    rows: int
    section_tp_rows: int  # n_k: rows of this section per TP rank


@dataclass(frozen=True)
class FusedSpec:
    """Section table of a fused projection (JSON-serialisable; stored in the manifest).

    `groups` > 1 means group-major interleaving (`grouped` kind): every section's rows are split
    into `groups` equal units and the fused rows are [unit_0 of each section | unit_1 ...].
    `info` keeps the constructor arguments (e.g. heads, head_dim) for humans and converters.

    >>> FusedSpec.swiglu(6).to_json()["sections"]
    [['gate', 6], ['up', 6]]
    """

    kind: str
    sections: tuple[Section, ...]
    groups: int = 1
    info: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BridgeError(f"fused spec: unknown kind {self.kind!r}; known kinds are {list(KINDS)}")
        if not self.sections:
            raise BridgeError("fused spec: no sections; give at least one (name, rows)")
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names) or any(not n or "." in n or "/" in n for n in names):
            raise BridgeError(f"fused spec: section names {names} must be unique, non-empty, without '.' or '/'")
        if any(s.rows < 0 for s in self.sections):
            raise BridgeError(f"fused spec: negative section rows in {[(s.name, s.rows) for s in self.sections]}")
        if self.groups < 1 or (self.kind == "concat" and self.groups != 1):
            raise BridgeError(f"fused spec: kind {self.kind!r} needs groups {'== 1' if self.kind == 'concat' else '>= 1'}, got {self.groups}")
        bad = [s.name for s in self.sections if s.rows % self.groups]
        if bad:
            raise BridgeError(f"fused spec: sections {bad} have rows not divisible by groups={self.groups}")

    # --- constructors ----------------------------------------------------------------------------
    @classmethod
    def concat(cls, sections: Sequence[tuple[str, int]], **info) -> "FusedSpec":
        """Sections concatenated per TP rank, each TP-split separately."""
        return cls("concat", tuple(Section(n, int(r)) for n, r in sections), 1, dict(info))

    @classmethod
    def swiglu(cls, ffn_hidden: int) -> "FusedSpec":
        """SwiGLU / gated `linear_fc1` (weight or bias): gate then up, `ffn_hidden` rows each."""
        return cls.concat([("gate", ffn_hidden), ("up", ffn_hidden)], ffn_hidden=ffn_hidden, name="swiglu")

    @classmethod
    def qkv(cls, num_heads: int, num_query_groups: int, head_dim: int) -> "FusedSpec":
        """Attention `linear_qkv` (weight or bias) with GQA: per query group [q heads | k | v].

        >>> FusedSpec.qkv(8, 2, 4).to_json()["sections"]
        [['query', 32], ['key', 8], ['value', 8]]
        """
        if num_heads % num_query_groups:
            raise BridgeError(f"fused qkv: num_heads={num_heads} not divisible by num_query_groups={num_query_groups}")
        return cls("grouped", (Section("query", num_heads * head_dim), Section("key", num_query_groups * head_dim),
                               Section("value", num_query_groups * head_dim)), num_query_groups,
                   dict(name="qkv", num_heads=num_heads, num_query_groups=num_query_groups, head_dim=head_dim))

    @classmethod
    def mamba_in_proj(cls, d_inner: int, ngroups: int, d_state: int, nheads: int) -> "FusedSpec":
        """Mamba `in_proj`: z, x (d_inner), B, C (ngroups·d_state), dt (nheads)."""
        gs = ngroups * d_state
        return cls.concat([("z", d_inner), ("x", d_inner), ("B", gs), ("C", gs), ("dt", nheads)], name="mamba_in_proj",
                          d_inner=d_inner, ngroups=ngroups, d_state=d_state, nheads=nheads)

    @classmethod
    def mamba_conv1d(cls, d_inner: int, ngroups: int, d_state: int) -> "FusedSpec":
        """Mamba `conv1d` weight/bias: x (d_inner), B, C (ngroups·d_state)."""
        gs = ngroups * d_state
        return cls.concat([("x", d_inner), ("B", gs), ("C", gs)], name="mamba_conv1d", d_inner=d_inner,
                          ngroups=ngroups, d_state=d_state)

    @classmethod
    def gdn_in_proj(cls, qk_dim: int, v_dim: int, num_value_heads: int) -> "FusedSpec":
        """Gated DeltaNet `in_proj` (weight or bias): query, key (qk_dim), value, z (v_dim), beta, alpha (nv)."""
        return cls.concat([("query", qk_dim), ("key", qk_dim), ("value", v_dim), ("z", v_dim),
                           ("beta", num_value_heads), ("alpha", num_value_heads)], name="gdn_in_proj", qk_dim=qk_dim,
                          v_dim=v_dim, num_value_heads=num_value_heads)

    @classmethod
    def gdn_conv1d(cls, qk_dim: int, v_dim: int) -> "FusedSpec":
        """Gated DeltaNet `conv1d` weight/bias: query, key (qk_dim), value (v_dim)."""
        return cls.concat([("query", qk_dim), ("key", qk_dim), ("value", v_dim)], name="gdn_conv1d", qk_dim=qk_dim,
                          v_dim=v_dim)

    # --- geometry ----------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Global fused rows (sum over sections)."""
        return sum(s.rows for s in self.sections)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sections)

    def check_tp(self, tp: int, param: str = "<fused>") -> None:
        """Raise unless TP splits this spec (sections, or query groups for `grouped`)."""
        if self.kind == "grouped":
            if self.groups % tp:
                raise BridgeError(f"{param}: {self.groups} query groups are not divisible by TP={tp}; "
                                  f"choose a TP that divides the number of groups")
        else:
            bad = [(s.name, s.rows) for s in self.sections if s.rows % tp]
            if bad:
                raise BridgeError(f"{param}: fused sections {bad} are not divisible by TP={tp}; choose a TP that divides every section")

    def tp_rows(self, tp: int) -> int:
        """Rows of the TP-local fused tensor."""
        return self.rows // tp

    def segments(self, tp: int, param: str = "<fused>") -> list[Segment]:
        """TP-local row runs (same for every TP rank) in fused order."""
        memo = self.__dict__.setdefault("_segments_memo", {})  # frozen and pure: cache per TP
        hit = memo.get(tp)
        if hit is None:
            self.check_tp(tp, param)
            hit = memo[tp] = tuple(self._segments(tp))
        return list(hit)

    def _segments(self, tp: int) -> list[Segment]:
        out, row = [], 0
        per_rank_groups = self.groups // tp if self.kind == "grouped" else 1
        for q in range(per_rank_groups):
            for s in self.sections:
                n_k = s.rows // tp
                unit = n_k // per_rank_groups
                if unit:
                    out.append(Segment(s.name, row, q * unit, unit, n_k))
                row += unit
        return out

    # --- JSON ----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """Plain JSON (manifest)."""
        return {"format": FORMAT, "kind": self.kind, "sections": [[s.name, s.rows] for s in self.sections],
                "groups": self.groups, "info": dict(self.info)}

    @classmethod
    def from_json(cls, d: dict) -> "FusedSpec":
        """Inverse of `to_json`; rejects unknown kinds and formats naming them.

        >>> FusedSpec.from_json(FusedSpec.qkv(8, 2, 4).to_json()) == FusedSpec.qkv(8, 2, 4)
        True
        """
        if not isinstance(d, dict) or "kind" not in d or "sections" not in d:
            raise BridgeError(f"fused spec JSON {d!r} lacks 'kind' or 'sections'; write it with FusedSpec.to_json()")
        if d.get("format", FORMAT) != FORMAT:
            raise BridgeError(f"fused spec JSON format {d.get('format')!r} is not supported (expected {FORMAT})")
        try:
            sections = tuple(Section(str(n), int(r)) for n, r in d["sections"])
        except (TypeError, ValueError):
            raise BridgeError(f"fused spec JSON sections {d['sections']!r} must be [[name, rows], ...]") from None
        return cls(str(d["kind"]), sections, int(d.get("groups", 1)), dict(d.get("info", {})))
