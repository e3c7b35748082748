"""`gtp-bridge demo [--workdir W]`: the main job end to end on an embedded real checkpoint.

embedded Megatron-Core 0.19.2 GTP=2 checkpoint -> convert -> plain Orbax restore onto an
8-device CPU mesh with another sharding (bit-exact against TensorStore reads) -> to-megatron at
TP=2 x DP=2 (dp_reshardable) -> convert again (identical arrays). Prints what moved and the checks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bridge.store import Storage

DEMO_SRC = Path(__file__).resolve().parent.parent / "demo_data" / "gtp2_local"
DEVICES = 8


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the main job end to end on an embedded real Megatron checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  gtp-bridge demo --workdir /tmp/gtp-demo")
    p.add_argument("--workdir", help="directory for the demo's outputs (default: a new temporary directory)")
    p.set_defaults(func=run)


def _force_host_devices() -> None:
    """8 CPU devices for JAX; must happen before jax is first imported."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _bits_equal(a, b) -> bool:
    import numpy as np

    from bridge.dtypes import uint_view

    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(uint_view(a), uint_view(b))


def orbax_restore_check(path: str) -> tuple[int, int, str]:
    """Restore with nothing but `ocp.StandardCheckpointer` onto a 2x4 mesh; compare every leaf to TensorStore."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from bridge.errors import BridgeError
    from bridge.format.schema import ADAM_INDEX, OPT_STATE
    from bridge.jaxside.keypaths import nested_from_paths
    from bridge.store import open_checkpoint, open_storage
    from bridge.dtypes import numpy_dtype

    devs = jax.devices()
    if len(devs) < DEVICES:
        raise BridgeError(f"demo needs {DEVICES} JAX devices, found {len(devs)}; unset XLA_FLAGS/JAX_PLATFORMS or run "
                          f"with XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
    mesh = Mesh(np.array(devs[:DEVICES]).reshape(2, 4), ("data", "model"))  # foreign: mesh axis names
    ck = open_checkpoint(path)
    arrays = ck.arrays()

    def sharding(shape):
        spec = [None] * len(shape)
        if shape and shape[-1] % 4 == 0:
            spec[-1] = "model"            # foreign: mesh axis; torch [out, in]: shard the input dim 4 ways
        if len(shape) >= 2 and shape[0] % 2 == 0:
            spec[0] = "data"              # and the leading (layer / row) dim 2 ways
        return NamedSharding(mesh, P(*spec))

    abstract = {p: jax.ShapeDtypeStruct(tuple(info.shape), numpy_dtype(info.dtype), sharding=sharding(tuple(info.shape)))
                for p, info in arrays.items()}
    if not open_storage(path).orbax_can_open:  # e.g. s3://: the bridge's own restore read
        from bridge.jaxside.restore_io import read_arrays

        restored = nested_from_paths(read_arrays(path, abstract))
    else:
        nested = nested_from_paths(abstract)
        opt = nested.pop(OPT_STATE)
        nested[OPT_STATE] = [opt[ADAM_INDEX], None, None]   # optax.adamw(...).init(params): (ScaleByAdamState, Empty, Empty)
        restored = ocp.StandardCheckpointer().restore(os.path.abspath(path), nested)
        restored[OPT_STATE] = {ADAM_INDEX: restored[OPT_STATE][0]}
    n = nbytes = 0
    sample = ""
    for p in arrays:
        node = restored
        for k in p:
            node = node[k]
        if not _bits_equal(np.asarray(node), ck.read(p)):
            raise BridgeError(f"demo: Orbax restore of {'/'.join(p)} differs from the stored bytes")
        if not sample and node.ndim >= 2 and all(x is not None for x in node.sharding.spec[:2]):
            sample = f"{'/'.join(p)} {tuple(node.shape)} as {node.sharding.spec}"
        n += 1
        nbytes += node.nbytes
    return n, nbytes, sample


def same_checkpoints(a: str, b: str) -> int:
    """Number of arrays compared; raises on any difference."""
    from bridge.errors import BridgeError
    from bridge.store import open_checkpoint

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    if set(ca.arrays()) != set(cb.arrays()):
        raise BridgeError("demo: the round trip changed the set of arrays")
    for p in ca.arrays():
        if not _bits_equal(ca.read(p), cb.read(p)):
            raise BridgeError(f"demo: round trip changed {'/'.join(p)}")
    return len(ca.arrays())


def run(args: argparse.Namespace) -> int:
    _force_host_devices()
    from bridge.errors import BridgeError, require
    from bridge.store import open_storage

    require("demo", "torch", "jax", "orbax.checkpoint", "optax")
    if not (DEMO_SRC / ".metadata").is_file():
        raise BridgeError(f"embedded demo checkpoint missing at {DEMO_SRC}; reinstall gtp-bridge from the repository")
    if args.workdir is not None:
        work = open_storage(args.workdir, "--workdir")   # a directory, or a bucket prefix every step uses
        work.make_dirs()
        return run_in(work, keep=True)
    work = Path(tempfile.mkdtemp(prefix="gtp-bridge-demo-"))
    try:
        return run_in(open_storage(str(work)), keep=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the outputs were only there to be checked


def run_in(work: "Storage", keep: bool) -> int:
    """The demo's steps with their outputs under `work` (a directory, or an s3:// / gs:// prefix; kept
    there when `keep`)."""
    from bridge.errors import BridgeError
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    names = ("logical", "megatron_tp2_dp2", "logical_again")
    outs = {k: work.at(k) for k in names}
    taken = [str(o) for o in outs.values() if o.occupied()]
    if taken:
        raise BridgeError(f"demo outputs already exist ({taken[0]}); choose an empty --workdir")
    rows = []

    def timed(fn):
        t0 = time.perf_counter()
        r = fn()
        return r, time.perf_counter() - t0

    r1, t1 = timed(lambda: convert(str(DEMO_SRC), str(outs["logical"]), ConvertOptions(workers=1)))
    lay = r1.layout
    rows.append(("convert", f"Megatron {r1.source_format} TP={lay['tp']} GTP={lay['gtp']} DP={lay['dp']}",
                 f"logical ({r1.arrays} arrays)", r1.bytes, t1,
                 "padding dropped, SwiGLU halves unscrambled; bf16 weight == bf16(fp32 master) for every param"))
    (n, nb, sample), t2 = timed(lambda: orbax_restore_check(str(outs["logical"])))
    rows.append(("Orbax restore" if work.orbax_can_open else "restore", "logical", f"JAX 2x4 CPU mesh ({n} leaves)", nb, t2,
                 f"bit-exact vs TensorStore; e.g. {sample}"))
    r3, t3 = timed(lambda: to_megatron(str(outs["logical"]), str(outs["megatron_tp2_dp2"]),
                                       MegatronTarget(tp=2, dp=2, fmt="dp_reshardable", bucket_size=4000)))
    rows.append(("to-megatron", "logical", "Megatron dp_reshardable TP=2 DP=2 (bucket 4000)", r3["bytes"], t3,
                 "DistOpt buffers rebuilt for the new layout"))
    r4, t4 = timed(lambda: convert(str(outs["megatron_tp2_dp2"]), str(outs["logical_again"]), ConvertOptions(workers=1)))
    n_same = same_checkpoints(str(outs["logical"]), str(outs["logical_again"]))
    rows.append(("convert", "Megatron dp_reshardable TP=2 DP=2", "logical", r4.bytes, t4,
                 f"identical to the first conversion ({n_same} arrays, bit for bit)"))
    print(f"gtp-bridge demo (outputs in {work})" if keep else "gtp-bridge demo (temporary outputs, removed at the end; "
          "--workdir DIR keeps them)")
    print(f"{'step':<14} {'from':<42} {'to':<44} {'MiB':>6} {'s':>5}  check")  # foreign: a column header
    for step, a, b, nbytes, secs, check in rows:
        print(f"{step:<14} {a:<42} {b:<44} {nbytes / 2**20:>6.2f} {secs:>5.1f}  {check}")
    print("all checks passed")
    return 0
