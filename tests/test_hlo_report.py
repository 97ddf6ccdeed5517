"""The collective report against a program whose communication we know by construction."""

import jax
import pytest
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from europa_jax.config import MeshConfig
from europa_jax.parallel import sharding
from europa_jax.plan.program import hlo_report


def test_report_counts_loop_iterations_axes_dtypes_and_bytes():
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))

    def body(w_LDF, x_TD):
        def layer(x, w_DF):  # per layer: fp8 gather over data, f32 all-to-all over expert
            w = jax.lax.all_gather(w_DF.astype(jnp.float8_e4m3fn), "data", axis=0, tiled=True)
            x = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)
            return jnp.tanh(x @ w.astype(jnp.float32)), None

        x, _ = jax.lax.scan(layer, x_TD, w_LDF)
        g = jax.lax.psum_scatter(x.astype(jnp.bfloat16), ("data", "expert"), tiled=True)
        return jax.lax.psum(g.astype(jnp.float32).sum(), ("data", "expert"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "data"), P(("data", "expert"))),
                              out_specs=P()))
    hlo = f.lower(jnp.ones((3, 16, 16)), jnp.ones((64, 16))).compiler_ir("hlo").as_hlo_text()
    rows = {(r["op"], r["axes"], r["dtype"]): r for r in
            hlo_report.summarize(hlo_report.collectives(hlo, mesh))}

    gather = rows[("all-gather", "data", "f8e4m3fn")]
    assert gather["count"] == 3  # once per scanned layer
    assert gather["bytes_per_device"] == 3 * 16 * 16 * 1 / 2  # result × (n−1)/n, 3 layers
    a2a = rows[("all-to-all", "expert", "f32")]
    assert a2a["count"] == 3 and a2a["bytes_per_device"] == 3 * 8 * 16 * 4 * 3 / 4
    rs = rows[("reduce-scatter", "data+expert", "bf16")]
    assert rs["count"] == 1 and rs["bytes_per_device"] == 1 * 16 * 2 * 7  # result × (n−1)
    assert rows[("all-reduce", "data+expert", "f32")]["count"] == 1
    # the optimized program (known_trip_count, named replica groups) reads the same
    optimized = {(r["op"], r["axes"]): r for r in hlo_report.summarize(
        hlo_report.collectives(f.lower(jnp.ones((3, 16, 16)), jnp.ones((64, 16))).compile()
                               .as_text(), mesh))}
    assert optimized[("all-to-all", "expert")]["bytes_per_device"] == a2a["bytes_per_device"]


def test_axes_of_groups_recognises_each_mesh_axis():
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    assert hlo_report.axes_of_groups([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == ("expert",)
    assert hlo_report.axes_of_groups([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == ("data",)
    assert hlo_report.axes_of_groups([list(range(8))], mesh) == ("data", "expert")
    # parts of an axis's groups (axis_index_groups): the axis and the part's size
    assert hlo_report.axes_of_groups([[0, 1], [2, 3], [4, 5], [6, 7]], mesh) == ("expert:2",)


def test_dot_flops_apply_trip_counts_in_lowered_and_optimized_hlo():
    def loss(w_LDD, x_TD):
        def layer(x, w_DD):
            return jnp.tanh(x @ w_DD), None
        return jax.lax.scan(layer, x_TD, w_LDD)[0].sum()

    lowered = jax.jit(jax.grad(loss)).lower(jnp.ones((3, 256, 256)), jnp.ones((64, 256)))
    # forward x·w, backward dx and dw: three 64×256×256 matmuls per layer, 3 layers
    expected = 3 * 3 * 2 * 64 * 256 * 256
    assert hlo_report.dot_flops(lowered.compiler_ir("hlo").as_hlo_text()) == expected
    assert hlo_report.dot_flops(lowered.compile().as_text()) == expected


# A loop as the GH200 program of `execution.row_loop` has it: no known_trip_count, its
# `i < 59` fused into the condition (`@BOUND@` a constant, or a loop value: data).
FUSED_CONDITION = """
%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(59)
  ROOT %lt = pred[] compare(%p, @BOUND@), direction=LT
}

%cond (c: (s32[], s32[])) -> pred[] {
  %c = (s32[], s32[]) parameter(0)
  ROOT %fusion = pred[] fusion(%c), kind=kLoop, calls=%fused_compare
}

%body (b: (s32[], s32[])) -> (s32[], s32[]) {
  %b = (s32[], s32[]) parameter(0)
  ROOT %same = (s32[], s32[]) copy(%b)
}

ENTRY %main (x: (s32[], s32[])) -> (s32[], s32[]) {
  %x = (s32[], s32[]) parameter(0)
  ROOT %loop = (s32[], s32[]) while(%x), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"}}
}
"""


@pytest.mark.parametrize("bound, trips", [("%bound", 59), ("%p", None)])
def test_a_trip_count_fused_into_the_loop_condition_is_read(bound, trips):
    comps, entry = hlo_report._computations(FUSED_CONDITION.replace("@BOUND@", bound))
    (loop,) = [line for line in comps[entry] if " while(" in line]
    assert hlo_report._trip_count(loop, comps) == trips
    assert hlo_report.execution_counts(comps, entry)["body"] == (trips or 1)


def test_partitioner_collectives_show_in_optimized_hlo_and_can_be_selected():
    """GSPMD's own collectives exist only after partitioning; `keep` tells them apart."""
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))

    def step(w_DF, x_TD):
        inner = jax.shard_map(lambda x: jax.lax.psum(x, "expert"), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data"))
        return inner(x_TD) @ w_DF  # w sharded on its contracted dim: GSPMD adds a reduction

    w = jax.ShapeDtypeStruct((16, 8), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P(("data", "expert"))))
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(w, x).compile()
    text = compiled.as_text()
    explicit = hlo_report.collectives(text, mesh, keep=lambda line: "shard_map" in line)
    added = hlo_report.collectives(text, mesh, keep=lambda line: "shard_map" not in line)
    assert [(c.op, c.axes) for c in explicit] == [("all-reduce", ("expert",))]
    assert [(c.op, c.axes) for c in added] == [("all-gather", ("data", "expert"))]
    biggest = hlo_report.largest_buffers(text, n=1)[0]
    assert biggest["bytes"] == max(b["bytes"] for b in hlo_report.largest_buffers(text, n=50))


def test_named_replica_groups_follow_their_device_order():
    """GSPMD's all-to-alls name a reshaped mesh with a transposed device order."""
    mesh = sharding.make_mesh(MeshConfig(data=2, expert=4))
    groups = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0))"
    hlo = "\n".join([
        "ENTRY main {",
        "  a = f32[8] parameter(0)",
        f"  b = f32[8] all-to-all(a), {groups} {{'axis_1'}}, dimensions={{0}}",
        f"  ROOT c = f32[32] all-gather(b), {groups} {{'axis_0'}}, dimensions={{0}}",
        "}"])
    # device order 0,4,1,5,2,6,3,7 as [4, 2]: axis_1 pairs {0,4} (data), axis_0 {0,1,2,3}
    assert [(c.op, c.axes, c.bytes_per_device) for c in hlo_report.collectives(hlo, mesh)] == [
        ("all-to-all", ("data",), 8 * 4 / 2), ("all-gather", ("expert",), 32 * 4 * 3 / 4)]
