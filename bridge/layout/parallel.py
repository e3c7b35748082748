"""Megatron-Core process-group geometry: rank <-> coordinates and the groups that matter.

Re-implements megatron-core 0.19.2 `RankGenerator` / `generate_masked_orthogonal_rank_groups`
(`parallel_state.py:269-375, 465-557`) and `_inject_gtp_remat_axis` (`:582-597`) as pure math.
Ranks are mixed-radix numbers over the `order` tokens, leftmost token fastest; GTP ("gtp_remat")
is injected after `tp` on the dense grid and after `ep` on the expert grid.

>>> lay = ParallelLayout(tp=2, gtp=2, dp=2)          # megatron-layout.md §1.3, world 8
>>> lay.dense.order
('tp', 'gtp_remat', 'cp', 'ep', 'dp', 'pp')
>>> c = lay.coords(6); (c.t, c.g, c.d)
(0, 1, 1)
>>> lay.gtp_group(1), lay.distopt_group(2), lay.dp_group_idx(6)
([1, 3], [2, 6], 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from bridge.errors import BridgeError

TOKENS = ("tp", "gtp_remat", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
#: beyond any machine Megatron-Core runs on: a typo like --pp 100000000 is refused before any table of ranks
MAX_WORLD = 1 << 20
MEGATRON_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp", "gtp_remat")  # RankGenerator.name_to_size order


def inject_gtp_axis(order: str, after: str) -> str:
    """Megatron's `_inject_gtp_remat_axis`: insert `gtp_remat` after `after` (else after `tp`).

    >>> inject_gtp_axis("tp-cp-ep-dp-pp", "tp"), inject_gtp_axis("tp-cp-ep-dp-pp", "ep")
    ('tp-gtp_remat-cp-ep-dp-pp', 'tp-cp-ep-gtp_remat-dp-pp')
    """
    toks = order.split("-")
    if "gtp_remat" in toks:
        return order
    anchor = after if after in toks else "tp"
    pos = toks.index(anchor) + 1 if anchor in toks else 0
    toks.insert(pos, "gtp_remat")
    return "-".join(toks)


@dataclass(frozen=True)
class RankGrid:
    """One Megatron rank generator: `order` tokens with their sizes, first token fastest.

    >>> g = RankGrid.build("tp-dp-pp", {"tp": 2, "dp": 3, "pp": 4})
    >>> g.group(7, "dp"), g.group_rank(7, "dp"), g.coords(7)["pp"]
    ([7, 9, 11], 0, 1)
    """

    order: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        strides, s = [], 1
        for n in self.sizes:
            strides.append(s)
            s *= n
        object.__setattr__(self, "strides", tuple(strides))

    @classmethod
    def build(cls, order: str, sizes: dict[str, int]) -> "RankGrid":
        """Parse an order string like Megatron's RankGenerator (missing size-1 tokens appended)."""
        toks = order.lower().split("-")
        unknown = [t for t in toks if t not in TOKENS]
        if unknown:
            raise BridgeError(f"parallel order {order!r}: unknown token(s) {unknown}; use tokens from {list(TOKENS)}")
        if len(set(toks)) != len(toks):
            raise BridgeError(f"parallel order {order!r}: a token appears twice; name each of {list(TOKENS)} at most once")
        for name in MEGATRON_APPEND_ORDER:  # Megatron appends missing tokens in this order
            n = sizes.get(name, 1)
            if name not in toks:
                if n != 1:
                    raise BridgeError(f"parallel order {order!r} lacks {name!r} but its size is {n}; add {name!r} to the order")
                toks.append(name)
        return cls(tuple(toks), tuple(int(sizes.get(t, 1)) for t in toks))

    @property
    def world(self) -> int:
        return prod(self.sizes)

    def size(self, token: str) -> int:
        return self.sizes[self.order.index(token)]

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` along every token."""
        return {t: (rank // s) % n for t, s, n in zip(self.order, self.strides, self.sizes)}

    def rank(self, **coords: int) -> int:
        """Rank from token coordinates (missing tokens = 0)."""
        return sum(coords.get(t, 0) * s for t, s in zip(self.order, self.strides))

    def _mask(self, tokens: str) -> list[int]:
        toks = tokens.split("-")
        bad = [t for t in toks if t not in self.order]
        if bad:
            raise BridgeError(f"group {tokens!r}: unknown token(s) {bad}; grid order is {'-'.join(self.order)}")
        return [i for i, t in enumerate(self.order) if t in toks]

    def group(self, rank: int, tokens: str) -> list[int]:
        """Members (ascending; group rank == list index) of `rank`'s group for `tokens` ("dp-cp")."""
        idx = self._mask(tokens)
        base = rank - sum(((rank // self.strides[i]) % self.sizes[i]) * self.strides[i] for i in idx)
        members = [base]
        for i in idx:  # grow the mixed-radix set: first masked token fastest
            members = [m + k * self.strides[i] for k in range(self.sizes[i]) for m in members]
        return members

    def group_rank(self, rank: int, tokens: str) -> int:
        """Rank of `rank` inside its `tokens` group (mixed radix of its masked coordinates)."""
        r, mult = 0, 1
        for i in self._mask(tokens):
            r += ((rank // self.strides[i]) % self.sizes[i]) * mult
            mult *= self.sizes[i]
        return r

    def groups(self, tokens: str) -> list[list[int]]:
        """All groups in Megatron's enumeration order (`generate_masked_orthogonal_rank_groups`)."""
        idx = set(self._mask(tokens))
        un = [i for i in range(len(self.order)) if i not in idx]
        out = []
        for gi in range(self.world // prod(self.sizes[i] for i in idx)):
            base, rem = 0, gi
            for i in un:
                base += (rem % self.sizes[i]) * self.strides[i]
                rem //= self.sizes[i]
            out.append(self.group(base, tokens))
        return out


@dataclass(frozen=True)
class RankCoords:
    """A rank's coordinates on the dense grid (t, g, c, d, p) and the expert grid (et, e, eg, ed)."""

    rank: int
    t: int
    g: int
    c: int
    d: int
    p: int
    et: int
    e: int
    eg: int
    ed: int


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and rank order of a Megatron-Core run (dense grid + expert grid).

    `dp` is the *replicate* degree (GTP divided out): world = tp·gtp·cp·dp·pp. Expert sizes:
    `etp` (defaults to tp), `ep`, `egtp`; `edp` = world / (etp·ep·egtp·pp). `order` is Megatron's
    `order` argument; `gtp_remat` is injected as Megatron does unless already present.

    >>> lay = ParallelLayout(tp=2, dp=4, ep=4, etp=1)
    >>> lay.world, lay.edp, lay.expert.order
    (8, 2, ('tp', 'cp', 'ep', 'gtp_remat', 'dp', 'pp'))
    """

    tp: int = 1
    gtp: int = 1
    dp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    egtp: int = 1
    order: str = DEFAULT_ORDER
    dense: RankGrid = field(init=False, repr=False, compare=False)
    expert: RankGrid = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "gtp", "dp", "cp", "pp", "ep", "etp", "egtp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BridgeError(f"ParallelLayout: {name}={v!r} must be a positive integer")
        world = self.world
        if world > MAX_WORLD:   # before any per-rank table: --pp 10**8 would build one of 10**8 ranks
            raise BridgeError(f"ParallelLayout: world size {world} (= tp·gtp·cp·dp·pp = {self.tp}·{self.gtp}·{self.cp}·"
                              f"{self.dp}·{self.pp}) is more than any run has (at most {MAX_WORLD} ranks)")
        emodel = self.etp * self.ep * self.egtp * self.pp
        if world % emodel:
            raise BridgeError(
                f"ParallelLayout: world size {world} (= tp·gtp·cp·dp·pp = {self.tp}·{self.gtp}·{self.cp}·{self.dp}·{self.pp}) "
                f"is not divisible by etp·ep·egtp·pp = {self.etp}·{self.ep}·{self.egtp}·{self.pp} = {emodel}; "
                f"choose expert sizes whose product divides the world size")
        dense = RankGrid.build(inject_gtp_axis(self.order, "tp"),
                               {"tp": self.tp, "gtp_remat": self.gtp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})
        expert = RankGrid.build(inject_gtp_axis(self.order, "ep"),
                                {"tp": self.etp, "gtp_remat": self.egtp, "cp": 1, "ep": self.ep, "dp": world // emodel,
                                 "pp": self.pp})
        if not (self.order.endswith("pp") or self.pp == 1 or self.edp == self.dp):
            raise BridgeError(f"ParallelLayout: order {self.order!r} does not end with 'pp', so pp=1 or edp == dp is "
                              f"required (got pp={self.pp}, dp={self.dp}, edp={self.edp})")
        if self.pp > 1 and dense.groups("pp") != expert.groups("pp"):
            raise BridgeError(f"ParallelLayout: pipeline groups differ between the dense and expert grids for order "
                              f"{self.order!r}; use an order where pp groups coincide (e.g. pp last)")
        object.__setattr__(self, "dense", dense)
        object.__setattr__(self, "expert", expert)

    @classmethod
    def from_world(cls, world: int, **sizes) -> "ParallelLayout":
        """Derive `dp` from the world size as Megatron does (world / (tp·gtp·cp·pp)).

        >>> ParallelLayout.from_world(8, tp=2, gtp=2).dp
        2
        """
        model = sizes.get("tp", 1) * sizes.get("gtp", 1) * sizes.get("cp", 1) * sizes.get("pp", 1)
        if world < 1 or world % model:
            raise BridgeError(f"ParallelLayout: world size {world} is not divisible by tp·gtp·cp·pp = {model}; "
                              f"pick sizes whose product divides the world size")
        return cls(dp=world // model, **sizes)

    # --- sizes -------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.gtp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert replicate DP degree (the expert DistOpt group size)."""
        return self.world // (self.etp * self.ep * self.egtp * self.pp)

    @property
    def distopt_size(self) -> int:
        """Dense DistOpt sharding group size: DP×CP with GTP excluded."""
        return self.dp * self.cp

    def to_json(self) -> dict:
        """Sizes and order as plain JSON (manifest `source layout`)."""
        return {k: getattr(self, k) for k in ("tp", "gtp", "dp", "cp", "pp", "ep", "etp", "egtp", "order")} | {
            "world": self.world}

    @classmethod
    def from_json(cls, d: dict) -> "ParallelLayout":
        """Inverse of `to_json` (ignores `world`, checks it when present)."""
        lay = cls(**{k: d[k] for k in ("tp", "gtp", "dp", "cp", "pp", "ep", "etp", "egtp", "order") if k in d})
        if "world" in d and d["world"] != lay.world:
            raise BridgeError(f"ParallelLayout: recorded world {d['world']} != product of sizes {lay.world}")
        return lay

    # --- coordinates -------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise BridgeError(f"rank {rank} is outside world size {self.world}")

    def coords(self, rank: int) -> RankCoords:
        """Dense and expert coordinates of `rank`."""
        self._check_rank(rank)
        a, b = self.dense.coords(rank), self.expert.coords(rank)
        return RankCoords(rank, a["tp"], a["gtp_remat"], a["cp"], a["dp"], a["pp"], b["tp"], b["ep"], b["gtp_remat"], b["dp"])

    def rank(self, t: int = 0, g: int = 0, c: int = 0, d: int = 0, p: int = 0) -> int:
        """Rank with dense coordinates (t, g, c, d, p)."""
        return self.dense.rank(tp=t, gtp_remat=g, cp=c, dp=d, pp=p)

    def expert_rank(self, et: int = 0, e: int = 0, eg: int = 0, ed: int = 0, p: int = 0) -> int:
        """Rank with expert coordinates."""
        return self.expert.rank(tp=et, ep=e, gtp_remat=eg, dp=ed, pp=p)

    # --- dense groups --------------------------------------------------------------------------
    def tp_group(self, rank: int) -> list[int]:
        return self.dense.group(rank, "tp")

    def gtp_group(self, rank: int) -> list[int]:
        return self.dense.group(rank, "gtp_remat")

    def distopt_group(self, rank: int) -> list[int]:
        """Dense DistOpt sharding group: DP×CP, GTP excluded (`intra_dp_cp_group`)."""
        return self.dense.group(rank, "dp-cp")

    def distopt_rank(self, rank: int) -> int:
        """Rank inside `distopt_group` (c + CP·d in the default order)."""
        return self.dense.group_rank(rank, "dp-cp")

    def dp_cp_gtp_group(self, rank: int) -> list[int]:
        """DP×CP including GTP (training `dp_cp_group`; writer election for GTP-replicated tensors)."""
        return self.dense.group(rank, "gtp_remat-dp-cp")

    def model_parallel_group(self, rank: int) -> list[int]:
        return self.dense.group(rank, "tp-gtp_remat-pp")

    def dp_group_idx(self, rank: int) -> int:
        """`dp_group_idx` of the dense DistOpt: rank in `tp-gtp_remat-pp`."""
        return self.dense.group_rank(rank, "tp-gtp_remat-pp")

    # --- expert groups -------------------------------------------------------------------------
    def expert_tp_group(self, rank: int) -> list[int]:
        return self.expert.group(rank, "tp")

    def expert_gtp_group(self, rank: int) -> list[int]:
        return self.expert.group(rank, "gtp_remat")

    def ep_group(self, rank: int) -> list[int]:
        return self.expert.group(rank, "ep")

    def expert_distopt_group(self, rank: int) -> list[int]:
        """Expert DistOpt sharding group: expert DP, EGTP excluded."""
        return self.expert.group(rank, "dp")

    def expert_distopt_rank(self, rank: int) -> int:
        return self.expert.group_rank(rank, "dp")

    def expert_dp_group_idx(self, rank: int) -> int:
        """`dp_group_idx` of the expert DistOpt: rank in `tp-ep-gtp_remat-pp` (expert grid)."""
        return self.expert.group_rank(rank, "tp-ep-gtp_remat-pp")

    def dp_group_coords(self, expert: bool = False) -> dict[int, tuple[int, int, int]]:
        """`dp_group_idx` -> (TP, GTP, EP) coordinates of its DP-rank-0 member, dense or expert DistOpt.

        A dp_reshardable checkpoint names its buffers by `dp_group_idx`; these coordinates say which
        weight shards (and, for experts, which local experts) a buffer holds. Every pipeline stage
        is visited; one member per group suffices (O(TP·GTP·EP·PP), not O(world)).

        >>> sorted(ParallelLayout(tp=2, gtp=2, dp=2).dp_group_coords().items())
        [(0, (0, 0, 0)), (1, (1, 0, 0)), (2, (0, 1, 0)), (3, (1, 1, 0))]
        >>> ParallelLayout(tp=1, dp=4, ep=2).dp_group_coords(expert=True)
        {0: (0, 0, 0), 1: (0, 0, 1)}
        """
        out: dict[int, tuple[int, int, int]] = {}
        for p in range(self.pp):
            if expert:
                for et in range(self.etp):
                    for e in range(self.ep):
                        for eg in range(self.egtp):
                            r = self.expert_rank(et=et, e=e, eg=eg, ed=0, p=p)
                            out.setdefault(self.expert_dp_group_idx(r), (et, eg, e))
            else:
                for t in range(self.tp):
                    for g in range(self.gtp):
                        out.setdefault(self.dp_group_idx(self.rank(t=t, g=g, c=0, d=0, p=p)), (t, g, 0))
        return out

    # --- convenience ---------------------------------------------------------------------------
    def shard_coords(self, rank: int, expert: bool = False) -> tuple[int, int]:
        """(TP rank, GTP rank) that decide which weight shard `rank` holds (expert grid if `expert`)."""
        c = self.coords(rank)
        return (c.et, c.eg) if expert else (c.t, c.g)

    def tp_gtp_sizes(self, expert: bool = False) -> tuple[int, int]:
        """(TP, GTP) sizes of the dense or expert grid."""
        return (self.etp, self.egtp) if expert else (self.tp, self.gtp)
