"""search.hlo: collectives of compiled programs, their bytes, groups, mesh axes and loop counts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxtron.tools.search.hlo import MESH_AXES, Collective, collectives, replica_groups, shape_bytes

SIZES = (1, 1, 2, 1, 1, 4)  # fsdp=2, tensor=4: device = 4 * fsdp + tensor
SHAPE = dict(zip(MESH_AXES, SIZES, strict=True))
AUTO = (AxisType.Auto,) * len(MESH_AXES)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return jax.make_mesh(SIZES, MESH_AXES, axis_types=AUTO)


def _arg(mesh: Mesh, spec: P, shape=(8, 16), dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _shard_map_hlo(mesh: Mesh, fn, in_spec: P, out_spec: P, dtype=jnp.float32) -> str:
    """Optimized HLO of ``fn`` under shard_map over an (8, 16) array."""
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    return jax.jit(mapped).lower(_arg(mesh, in_spec, dtype=dtype)).compile().as_text()


def _one(hlo: str, devices_per_node: int = 8) -> Collective:
    (found,) = collectives(hlo, SHAPE, devices_per_node)
    return found


# ----------------------------------------------------------------------------- compiled programs


def test_psum_over_tensor_and_fsdp(mesh):
    hlo = _shard_map_hlo(mesh, lambda a: jax.lax.psum(a, "tensor"), P(None, "tensor"), P())
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo  # device = row-major flat mesh index
    found = _one(hlo, devices_per_node=4)
    assert found == Collective("all-reduce", 8 * 4 * 4, 4, 1, ("tensor",), False)
    assert found.wire_bytes == 2 * 3 / 4 * 128
    assert _one(hlo, devices_per_node=2).spans_nodes

    hlo = _shard_map_hlo(mesh, lambda a: jax.lax.psum(a, "fsdp"), P("fsdp"), P())
    assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}" in hlo
    assert _one(hlo, devices_per_node=4) == Collective("all-reduce", 4 * 16 * 4, 2, 1, ("fsdp",), True)
    assert not _one(hlo, devices_per_node=8).spans_nodes


def test_all_gather_counts_its_output(mesh):
    gather = lambda a: jax.lax.all_gather(a, "fsdp", tiled=True)  # noqa: E731
    found = _one(_shard_map_hlo(mesh, gather, P("fsdp"), P()))
    assert found == Collective("all-gather", 8 * 16 * 4, 2, 1, ("fsdp",), False)
    assert found.wire_bytes == 256  # each device sends its half
    # XLA:CPU widens bf16 collectives to f32 (convert, all-gather, convert): the HLO's bytes are
    # f32's, read at bf16 size unless as_accelerator=False
    hlo = _shard_map_hlo(mesh, gather, P("fsdp"), P(), dtype=jnp.bfloat16)
    assert "f32[8,16]{1,0} all-gather(" in hlo
    assert _one(hlo).array_bytes == 8 * 16 * 2
    assert collectives(hlo, SHAPE, 8, as_accelerator=False)[0].array_bytes == 8 * 16 * 4


def test_psum_scatter_is_a_reduce_scatter_of_its_input(mesh):
    scatter = lambda a: jax.lax.psum_scatter(a, ("fsdp", "tensor"), tiled=True)  # noqa: E731
    found = _one(_shard_map_hlo(mesh, scatter, P(), P(("fsdp", "tensor"))), devices_per_node=4)
    assert found == Collective("reduce-scatter", 8 * 16 * 4, 8, 1, ("fsdp", "tensor"), True)
    assert found.wire_bytes == 7 / 8 * 512


def test_all_to_all_and_ppermute(mesh):
    a2a = lambda a: jax.lax.all_to_all(a, "tensor", 0, 1, tiled=True)  # noqa: E731
    found = _one(_shard_map_hlo(mesh, a2a, P(None, "tensor"), P("tensor")))  # CPU: a tuple of 4 slices
    assert found == Collective("all-to-all", 8 * 4 * 4, 4, 1, ("tensor",), False)
    assert found.wire_bytes == 3 / 4 * 128

    ring = lambda a: jax.lax.ppermute(a, "tensor", [(i, (i + 1) % 4) for i in range(4)])  # noqa: E731
    found = _one(_shard_map_hlo(mesh, ring, P("tensor"), P("tensor")), devices_per_node=4)
    assert found == Collective("collective-permute", 2 * 16 * 4, 2, 1, ("tensor",), False)
    assert found.wire_bytes == 128
    swap = lambda a: jax.lax.ppermute(a, "fsdp", [(0, 1), (1, 0)])  # noqa: E731
    assert _one(_shard_map_hlo(mesh, swap, P("fsdp"), P("fsdp")), devices_per_node=4).spans_nodes


def test_scan_multiplies_counts(mesh):
    def body(c, _):
        return jax.lax.psum(c, "tensor"), None

    def outer(c, _):
        return jax.lax.scan(body, c, None, length=3)[0], None

    once = _one(_shard_map_hlo(mesh, lambda a: jax.lax.scan(body, a, None, length=5)[0], P(None, "tensor"), P()))
    assert (once.kind, once.count, once.axes) == ("all-reduce", 5, ("tensor",))
    nested = _one(_shard_map_hlo(mesh, lambda a: jax.lax.scan(outer, a, None, length=4)[0], P(None, "tensor"), P()))
    assert nested.count == 12


def _jit_hlo(mesh: Mesh, fn, *args, out: P) -> str:
    return jax.jit(fn, out_shardings=NamedSharding(mesh, out)).lower(*args).compile().as_text()


def _read(hlo: str, as_accelerator: bool = True) -> list[tuple]:
    return [(c.kind, c.array_bytes, c.group_size, c.axes) for c in collectives(hlo, SHAPE, 8, as_accelerator)]


def test_gspmd_programs(mesh):
    """jit with shardings: XLA's mesh-axes replica groups; on CPU no reduce-scatter is formed."""
    x, w = _arg(mesh, P(None, "tensor")), _arg(mesh, P("tensor", None), shape=(16, 8))
    matmul = lambda x, w: x @ w  # noqa: E731
    hlo = _jit_hlo(mesh, matmul, x, w, out=P())
    assert "replica_groups=mesh[" in hlo
    assert _one(hlo) == Collective("all-reduce", 8 * 8 * 4, 4, 1, ("tensor",), False)
    hlo = _jit_hlo(mesh, matmul, x, w, out=P("tensor"))  # all-reduce, then a fusion dynamic-slices a quarter
    assert "reduce-scatter" not in hlo
    assert _read(hlo, as_accelerator=False) == [("all-reduce", 8 * 8 * 4, 4, ("tensor",))]
    assert _read(hlo) == [("reduce-scatter", 8 * 8 * 4, 4, ("tensor",))]

    gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
    found = _one(gather.lower(_arg(mesh, P(("tensor", "fsdp")))).compile().as_text(), devices_per_node=4)
    assert found == Collective("all-gather", 8 * 16 * 4, 8, 1, ("fsdp", "tensor"), True)


def test_combined_all_reduce_splits(mesh):
    """XLA:CPU combines all-reduces into a tuple one (as for the gradients of a train step): the
    elements sliced per device count as a reduce-scatter, the others stay an all-reduce."""
    total = lambda a: (a.sum(0), a.sum(0))  # noqa: E731
    sharded = jax.jit(total, out_shardings=(NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())))
    hlo = sharded.lower(_arg(mesh, P("fsdp"), (8, 16))).compile().as_text()
    assert "(f32[16]{0}, f32[16]{0}) all-reduce(" in hlo
    assert _read(hlo, as_accelerator=False) == [("all-reduce", 2 * 16 * 4, 2, ("fsdp",))]
    assert _read(hlo) == [("reduce-scatter", 16 * 4, 2, ("fsdp",)), ("all-reduce", 16 * 4, 2, ("fsdp",))]


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _mixed_loss(w, x):  # f32 parameters, bf16 compute
    return jnp.sum(jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)


FSDP = ("fsdp", "tensor")  # the 8 devices as one data-parallel axis


@pytest.mark.parametrize(
    ("loss", "dtype", "accelerator_bytes"),
    [(_loss, jnp.float32, 4), (_loss, jnp.bfloat16, 2), (_mixed_loss, jnp.float32, 2)],
)
def test_fsdp_gradient(mesh, loss, dtype, accelerator_bytes):
    """An FSDP step's collectives: parameters gathered, gradients all-reduced and dynamic-sliced
    (a reduce-scatter on GPU/TPU); bf16 ones widened to f32 by XLA:CPU."""
    w, x = _arg(mesh, P(FSDP, None), (16, 32), dtype), _arg(mesh, P(FSDP, None), (16, 16), dtype)
    hlo = _jit_hlo(mesh, jax.grad(loss), w, x, out=P(FSDP, None))
    # a bf16 gradient's all-reduce: XLA:CPU's AllReducePromotion made it f32, naming its reducer *_promoted
    assert ("_promoted" in hlo) == (accelerator_bytes == 2)
    raw = [("all-gather", 16 * 32 * 4, 8, FSDP), ("all-reduce", 16 * 32 * 4, 8, FSDP)]
    assert _read(hlo, as_accelerator=False) == raw
    n = accelerator_bytes
    assert _read(hlo) == [("all-gather", 16 * 32 * n, 8, FSDP), ("reduce-scatter", 16 * 32 * n, 8, FSDP)]


def test_gspmd_reduce_scatter_needs_a_slice_per_group_member(mesh):
    """x.sum(0) over a batch sharded on fsdp: the all-reduce over fsdp is sliced in halves (a
    reduce-scatter), or in eighths for an output sharded on fsdp and tensor (stays an all-reduce,
    as XLA's reduce-scatter matcher would leave it). A bf16 sum reduces in f32 (jax upcasts it):
    its all-reduce is f32 on accelerators too."""
    total = lambda a: a.sum(0)  # noqa: E731
    hlo = _jit_hlo(mesh, total, _arg(mesh, P("fsdp"), (8, 16)), out=P("fsdp"))
    assert _read(hlo) == [("reduce-scatter", 16 * 4, 2, ("fsdp",))]
    assert _read(hlo, as_accelerator=False) == [("all-reduce", 16 * 4, 2, ("fsdp",))]
    hlo = _jit_hlo(mesh, total, _arg(mesh, P("fsdp"), (8, 64)), out=P(FSDP))
    assert "f32[8]{0} dynamic-slice(" in hlo
    assert _read(hlo) == [("all-reduce", 64 * 4, 2, ("fsdp",))]
    hlo = _jit_hlo(mesh, total, _arg(mesh, P("fsdp"), (8, 16), jnp.bfloat16), out=P("fsdp"))
    assert "f32[16]{0} all-reduce(" in hlo and "_promoted" not in hlo
    assert _read(hlo) == [("reduce-scatter", 16 * 4, 2, ("fsdp",))]


@pytest.mark.parametrize(
    ("fn", "in_spec", "out_spec", "raw", "accelerator"),
    [
        (lambda a: jax.lax.psum(a, "tensor"), P(None, "tensor"), P(), ("all-reduce", 128), ("all-reduce", 64)),
        # an explicit f32 psum of bf16 data reads the same (convert, all-reduce, convert) but for
        # the reducer XLA's AllReducePromotion names <reducer>_promoted: kept f32
        (
            lambda a: jax.lax.psum(a.astype(jnp.float32), "tensor").astype(jnp.bfloat16),
            P(None, "tensor"),
            P(),
            ("all-reduce", 128),
            ("all-reduce", 128),
        ),
        (lambda a: jax.lax.psum_scatter(a, FSDP, tiled=True), P(), P(FSDP), ("reduce-scatter", 512), ("reduce-scatter", 256)),
        (
            lambda a: jax.lax.all_to_all(a, "tensor", 0, 1, tiled=True),
            P(None, "tensor"),
            P("tensor"),
            ("all-to-all", 128),
            ("all-to-all", 64),
        ),
        (
            lambda a: jax.lax.ppermute(a, "tensor", [(i, (i + 1) % 4) for i in range(4)]),
            P("tensor"),
            P("tensor"),
            ("collective-permute", 128),
            ("collective-permute", 64),
        ),
        # gathered from bf16 but returned as f32: the accelerator moves f32 too
        (
            lambda a: jax.lax.all_gather(a.astype(jnp.float32), "fsdp", tiled=True),
            P("fsdp"),
            P(),
            ("all-gather", 512),
            ("all-gather", 512),
        ),
    ],
    ids=["psum", "f32-psum", "psum-scatter", "all-to-all", "ppermute", "f32-all-gather"],
)
def test_bf16_collectives_widened_by_xla_cpu(mesh, fn, in_spec, out_spec, raw, accelerator):
    hlo = _shard_map_hlo(mesh, fn, in_spec, out_spec, dtype=jnp.bfloat16)
    kind = raw[0]
    assert re.search(rf"= f32\[[\d,]*\]\S* {kind}\(|= \(f32\[[^=]*\) {kind}\(", hlo)  # widened on CPU
    assert [(c.kind, c.array_bytes) for c in collectives(hlo, SHAPE, 8, as_accelerator=False)] == [raw]
    assert [(c.kind, c.array_bytes) for c in collectives(hlo, SHAPE, 8)] == [accelerator]


def test_gspmd_sub_axis_groups(mesh):
    """A reshard whose all-to-all groups a sub-axis (tensor pairs {0,1},{2,3},...)."""
    reshard = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P("tensor", "fsdp")))
    found = collectives(reshard.lower(_arg(mesh, P("fsdp", "tensor"))).compile().as_text(), SHAPE, 4)
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert [(c.group_size, c.axes, c.array_bytes, c.spans_nodes) for c in a2a] == [(2, ("tensor",), 4 * 4 * 4, False)]


def test_device_ids_are_flat_mesh_indices_not_device_ids():
    devices = np.array(jax.devices())[[7, 2, 5, 0, 3, 6, 1, 4]].reshape(SIZES)
    mesh = Mesh(devices, MESH_AXES, axis_types=AUTO)
    hlo = _shard_map_hlo(mesh, lambda a: jax.lax.psum(a, "tensor"), P(None, "tensor"), P())
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in hlo
    assert _one(hlo).axes == ("tensor",)


# ----------------------------------------------------------------------------- hand-written HLO


def _module(body: str, extra: str = "") -> str:
    return (
        "HloModule m, num_partitions=8\n"
        f"{extra}"
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n  %y = f32[] parameter(1)\n"
        "  ROOT %s = f32[] add(%x, %y)\n}\n"
        f"ENTRY %main (p: f32[8,4]) -> f32[8,4] {{\n  %p = f32[8,4]{{1,0}} parameter(0)\n{body}\n}}\n"
    )


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("{}", [list(range(8))]),
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[4,2]<=[2,2,2]T(2,1,0)", [[0, 4], [2, 6], [1, 5], [3, 7]]),
        ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0':(2)2}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ],
)
def test_replica_group_syntaxes(groups, expected):
    assert replica_groups(f"channel_id=1, replica_groups={groups}, use_global_device_ids=true", 8).tolist() == expected


def test_iota_transpose_groups_give_axes():
    hlo = _module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add")
    assert _one(hlo, devices_per_node=4) == Collective("all-reduce", 128, 2, 1, ("fsdp",), True)


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[]", 4),
        ("bf16[8,128]{1,0}", 2048),
        ("(f32[4], bf16[2,2])", 24),
        ("(f32[], /*index=5*/s64[2]{0}, pred[3])", 4 + 16 + 3),
        ("f8e4m3fn[4,4]", 16),
        ("s4[3]", 2),
        ("u16[2]", 4),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_tuple_operands_add_up():
    body = (
        "  %q = bf16[2,2]{1,0} convert(%p)\n"
        "  %ar = (f32[8,4]{1,0}, bf16[2,2]{1,0}) all-reduce(%p, %q), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add\n"
        "  %ag = (f32[16,4]{1,0}, bf16[4,2]{1,0}) all-gather(%p, %q), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}\n"
        "  ROOT %g = f32[8,4]{1,0} get-tuple-element(%ar), index=0"
    )
    ar, ag = collectives(_module(body), SHAPE, 8)
    assert (ar.kind, ar.array_bytes, ar.group_size, ar.axes) == ("all-reduce", 128 + 8, 8, ("fsdp", "tensor"))
    assert (ag.kind, ag.array_bytes, ag.group_size, ag.axes) == ("all-gather", 2 * (128 + 8), 2, ("tensor",))


def test_async_starts_count_once():
    wrapped = (
        "%wrapped_rs (w: f32[8,4]) -> f32[2,4] {\n  %w = f32[8,4]{1,0} parameter(0)\n"
        "  ROOT %rs = f32[2,4]{1,0} reduce-scatter(%w), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, "
        "dimensions={0}, to_apply=%add\n}\n"
    )
    body = (
        "  %ags = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
        "dimensions={0}, use_global_device_ids=true\n"
        "  %agd = f32[16,4]{1,0} all-gather-done(%ags)\n"
        "  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=2, "
        "source_target_pairs={{0,0},{1,5},{5,1}}\n"
        "  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)\n"
        "  %rss = ((f32[8,4]{1,0}), f32[2,4]{1,0}, s32[]) async-start(%p), calls=%wrapped_rs\n"
        "  %rsd = f32[2,4]{1,0} async-done(%rss), calls=%wrapped_rs\n"
        "  ROOT %r = f32[8,4]{1,0} copy(%cpd)"
    )
    rs, ag, cp = collectives(_module(body, extra=wrapped), SHAPE, 4)  # in text order: %wrapped_rs first
    assert ag == Collective("all-gather", 256, 2, 1, ("fsdp",), True)
    assert cp == Collective("collective-permute", 128, 2, 1, ("fsdp",), True)  # the self-send {0,0} moves nothing
    assert rs == Collective("reduce-scatter", 128, 4, 1, ("tensor",), False)


def test_loop_multiplicity_and_dropped_collectives():
    """Trip counts multiply, call sites add up; unknown trip counts count once; 1-device groups and self-sends drop."""
    extra = (
        "%inner (a: f32[8,4]) -> f32[8,4] {\n  %a = f32[8,4]{1,0} parameter(0)\n"
        "  %one = f32[8,4]{1,0} all-reduce(%a), channel_id=1, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add\n"
        "  %self = f32[8,4]{1,0} collective-permute(%one), channel_id=3, source_target_pairs={{0,0},{1,1}}\n"
        "  ROOT %ar = f32[8,4]{1,0} all-reduce(%self), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add\n}\n"
        "%body (b: f32[8,4]) -> f32[8,4] {\n  %b = f32[8,4]{1,0} parameter(0)\n"
        "  %c1 = f32[8,4]{1,0} call(%b), to_apply=%inner\n  ROOT %c2 = f32[8,4]{1,0} call(%c1), to_apply=%inner\n}\n"
        "%cond (c: f32[8,4]) -> pred[] {\n  %c = f32[8,4]{1,0} parameter(0)\n  ROOT %t = pred[] constant(true)\n}\n"
    )
    body = (
        '  %w1 = f32[8,4]{1,0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"80"}}\n'
        "  %w2 = f32[8,4]{1,0} while(%w1), condition=%cond, body=%body\n"
        "  ROOT %c3 = f32[8,4]{1,0} call(%w2), to_apply=%inner"
    )
    (found,) = collectives(_module(body, extra=extra), SHAPE, 8)
    assert found == Collective("all-reduce", 128, 2, 2 * 80 + 2 * 1 + 1, ("tensor",), False)


def test_mismatched_mesh_is_an_error():
    hlo = _module("  ROOT %ar = f32[8,4]{1,0} all-reduce(%p), channel_id=1, replica_groups={}, to_apply=%add")
    with pytest.raises(ValueError, match="partitions"):
        collectives(hlo, dict(zip(MESH_AXES, (1, 1, 1, 1, 1, 4), strict=True)), 4)
