"""What the step waits for besides its kernels' work (plan/price/critical_path.py): the phase of
each collective of the GPU program, the trips of its data-dependent loops, and the lines
the estimate adds for them (plan/price/step_time.py)."""

import pytest

from europa_jax.plan.price import critical_path, hardware, step_time
from europa_jax.plan.program import hlo_program
from europa_jax.plan.program.hlo_report import Collective
from test_step_time import work

GH = hardware.GH200_JUPITER
FWD = "jit(train_step)/jvp()/shard_map/Transformer"
BWD = "jit(train_step)/transpose(jvp())/shard_map/Transformer"
LAYER = "/Transformer._stack/while/body/eval_jaxpr/"


def col(op, name, axes=("data",), count=1.0):
    return Collective(op, axes, "bf16", 100.0 * count, count, 60.0 * count, name)


@pytest.mark.parametrize("c, expected", [
    # the update's collectives (no jvp in the name), Muon's re-layout: serial
    (col("all-to-all", "jit(train_step)/sharding_constraint"), ("update_exchange", False)),
    (col("all-reduce", "jit(train_step)/optimizer/norm"), ("update_exchange", False)),
    # activations exchanged inside the layers: the MoE's (ragged ones carry no name) and
    # context parallelism's over the node
    (col("ragged-all-to-all", ""), ("in_layer_exchange", False)),
    (col("all-to-all", FWD + LAYER + "moe_layers/moe/expert_matmuls/all_to_all"),
     ("in_layer_exchange", False)),
    (col("all-gather", FWD + LAYER + "moe_layers/attention/all_gather", ("expert",)),
     ("in_layer_exchange", False)),
    (col("reduce-scatter", BWD + LAYER + "checkpoint/dense_layers/attention/reduce_scatter",
         ("expert",)), ("in_layer_exchange", False)),
    # the step's ends: the embedding's gather and reduce-scatter, the first layers' once
    (col("all-gather", FWD + "/all_gather"), ("fill", False)),
    (col("all-gather", FWD + LAYER + "dense_layers/mlp/all_gather", count=2.0), ("fill", True)),
    (col("reduce-scatter", BWD + "/reduce_scatter"), ("drain", False)),
    (col("reduce-scatter", BWD + LAYER + "checkpoint/dense_layers/mlp/reduce_scatter"),
     ("drain", True)),
    # what the overlap model hides: the other layers' weight traffic, the backward's
    # re-gathers, the forward's all-reduces
    (col("all-gather", FWD + LAYER + "moe_layers/moe/all_gather"), None),
    (col("all-gather", BWD + LAYER + "checkpoint/rematted_computation/dense_layers/mlp/"
         "all_gather"), None),
    (col("all-reduce", FWD + "/loss/psum"), None),
])
def test_each_collective_has_the_phase_its_name_and_axes_say(c, expected):
    assert critical_path.phase(c, "dense_layers") == expected


LOOPS = """HloModule m

%cond (c: (s32[], f32[4])) -> pred[] {
  %c = (s32[], f32[4]) parameter(0)
  ROOT %p = pred[] constant(true)
}

%body (b: (s32[], f32[4])) -> (s32[], f32[4]) {
  ROOT %b = (s32[], f32[4]) parameter(0)
}

%outer_body (o: (s32[], f32[4])) -> (s32[], f32[4]) {
  %o = (s32[], f32[4]) parameter(0)
  ROOT %w = (s32[], f32[4]) while(%o), condition=%cond, body=%body, metadata={op_name="jit(f)/attention/while"}
}

ENTRY %main (x: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = (s32[], f32[4]) parameter(0)
  ROOT %layers = (s32[], f32[4]) while(%x), condition=%cond, body=%outer_body, metadata={op_name="jit(f)/while"}, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_a_data_dependent_loop_syncs_with_the_host_every_trip_and_at_its_end():
    """3 known trips of a layer loop, each running a loop of 5 expected data-dependent
    trips: 3 × (5 + 1) predicate copies; the known loop none."""
    mod = hlo_program.Module(LOOPS)
    trips = lambda name: 5.0 if "attention" in name else 1.0
    assert critical_path.loop_trips(mod, trips) == pytest.approx(18.0)


def test_chain_lines_wait_on_the_compute_stream_and_serial_phases_add_to_the_step():
    nvlink_bw = 3 * GH.nvlink_pair_bandwidth * GH.nvlink.expected
    ib_bw = GH.network_bandwidth * GH.infiniband.expected
    big = 2.0 * 4096**3
    w = work(dense_gemms=(("a", 4096, 40 * big, 0.0),), nvlink_bytes=9e11,
             infiniband_bytes=1e12, launches=2e5, loop_trips=1e4,
             in_layer_exchange_bytes=(8e11, 0.0), update_exchange_bytes=(1e9, 2e10),
             fill_drain_bytes=(0.0, 1e10))
    s = step_time.price(w, GH, "expected")
    assert s["kernel_launches"] == pytest.approx(2e5 * GH.launch_gap.expected)
    assert s["loop_trip_syncs"] == pytest.approx(1e4 * GH.loop_trip_sync.expected)
    assert s["in_layer_exchange"] == pytest.approx(8e11 / nvlink_bw)
    assert s["update_exchange"] == pytest.approx(max(1e9 / nvlink_bw, 2e10 / ib_bw))
    assert s["fill_drain"] == pytest.approx(1e10 / ib_bw)
    keep = GH.overlap_compute.expected
    compute = (s["dense_gemm"] + s["kernel_launches"] + s["loop_trip_syncs"]
               + s["in_layer_exchange"])
    links = (1e12 - 3e10) / ib_bw  # the serial bytes leave the overlapped link
    assert links > 9e11 / nvlink_bw
    stream = compute / keep if compute <= links * keep else compute + links * (1 - keep)
    e = step_time.estimate(w, GH, tokens_per_device=65536.0, model_flops=1e16)
    assert e["step_overlapped_s"] == pytest.approx(
        max(stream, links) + s["update_exchange"] + s["fill_drain"])
    lines = e["lines"]
    assert set(lines) == {"tf32_gemms", "mla_backward_ratio", *step_time.LINES}
    assert all(r["source"] and r["seconds"]["low"] >= r["seconds"]["expected"]
               >= r["seconds"]["high"] >= 0 for r in lines.values())
    assert lines["kernel_launches"]["count"] == 2e5
    assert lines["fill_drain"]["infiniband_bytes"] == 1e10


def test_float32_gemms_run_at_the_tf32_or_fp32_peak_and_the_line_says_what_it_costs():
    big = 2.0 * 4096**3
    bf16 = step_time.price(work(dense_gemms=(("a", 4096, big, 0.0),)), GH, "expected")
    tf32_work = work(dense_gemms=(("a", 4096, big, 0.0, "tf32"),))
    tf32 = step_time.price(tf32_work, GH, "expected")
    fp32 = step_time.price(work(dense_gemms=(("a", 4096, big, 0.0, "fp32"),)), GH, "expected")
    assert tf32["dense_gemm"] == pytest.approx(2 * bf16["dense_gemm"])
    assert fp32["dense_gemm"] == pytest.approx(989 / 67 * bf16["dense_gemm"])
    e = step_time.estimate(tf32_work, GH, tokens_per_device=1.0, model_flops=1.0)
    assert e["lines"]["tf32_gemms"]["seconds"]["expected"] == pytest.approx(bf16["dense_gemm"])
    # an FP8 GEMM (execution.fp8_gemms) runs at fp8_per_bf16 × BF16's speed, and its saving is
    # not netted into the float32 GEMMs' line
    both = work(dense_gemms=(("a", 4096, big, 0.0, "tf32"), ("b", 4096, big, 0.0, "fp8")))
    assert step_time.price(both, GH, "expected")["dense_gemm"] == pytest.approx(
        (2 + 1 / GH.fp8_per_bf16) * bf16["dense_gemm"])
    e = step_time.estimate(both, GH, tokens_per_device=1.0, model_flops=1.0)
    assert e["lines"]["tf32_gemms"]["seconds"]["expected"] == pytest.approx(bf16["dense_gemm"])


def test_the_attention_backward_costs_its_five_matmuls_at_the_head_dims():
    assert step_time.backward_per_forward(128, 128) == pytest.approx(2.5)  # FlashAttention's
    assert step_time.backward_per_forward(192, 128) == pytest.approx(2.6)  # MLA's
    w = work(attention_backward_flops=2.6e15, attention_backward_ratio=2.6)
    e = step_time.estimate(w, GH, tokens_per_device=1.0, model_flops=1.0)
    backward = e["by_class"]["attention_backward"]["seconds"]["expected"]
    assert e["lines"]["mla_backward_ratio"]["seconds"]["expected"] == pytest.approx(
        backward * 0.1 / 2.6)


COVERED = """HloModule m

ENTRY %main (x: bf16[64,8]) -> bf16[64,8] {
  %x = bf16[64,8]{1,0} parameter(0)
  %ra = ((bf16[64,8]{1,0}, bf16[64,8]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, s64[4]{0}), bf16[64,8]{1,0}) ragged-all-to-all-start(%x, %x, %o, %s, %o, %s), replica_groups={{0,1,2,3}}
  %shared_gemm = bf16[64,8]{1,0} custom-call(%x, %x), custom_call_target="__cublas$lt$matmul"
  %ra_done = bf16[64,8]{1,0} ragged-all-to-all-done(%ra)
  %cp = ((bf16[64,8]{1,0}), bf16[64,8]{1,0}) all-to-all-start(%x), replica_groups={{0,1,2,3}}, metadata={op_name="jit(f)/jvp()/attention/all_to_all"}
  %cp_done = bf16[64,8]{1,0} all-to-all-done(%cp)
  ROOT %y = bf16[64,8]{1,0} add(%ra_done, %cp_done)
}
"""


@pytest.mark.parametrize("kernel_seconds, share", [(1.0, 0.5), (3.0, 1.0), (0.0, 0.0)])
def test_kernels_scheduled_while_an_exchange_is_in_flight_cover_their_share_of_it(
        kernel_seconds, share):
    """An in-layer exchange (a ragged one: 2 s at its links' peak) with a GEMM between its
    start and done covers min(1, GEMM's seconds / exchange's) of its bytes; the exchange
    with nothing between covers none."""
    mod = hlo_program.Module(COVERED)
    ragged = Collective("ragged-all-to-all", ("expert",), "bf16", 100.0, 1.0, 40.0, "")
    cp = Collective("all-to-all", ("expert",), "bf16", 100.0, 1.0, 0.0,
                    "jit(f)/jvp()/attention/all_to_all")
    of_line = lambda line, times: ([ragged] if "ragged-all-to-all-start" in line else
                                   [cp] if "all-to-all-start" in line else [])
    seconds_of = lambda name: kernel_seconds if name == "shared_gemm" else 0.0
    nvlink, between = critical_path.covered_exchange_bytes(
        mod, of_line, seconds_of, lambda c: 2.0 if c is ragged else 1.0, "dense_layers")
    assert (nvlink, between) == pytest.approx((60.0 * share, 40.0 * share))


def test_covered_exchange_bytes_leave_the_in_layer_line():
    nvlink_bw = 3 * GH.nvlink_pair_bandwidth * GH.nvlink.expected
    w = work(nvlink_bytes=9e11, in_layer_exchange_bytes=(8e11, 0.0))
    covered = work(nvlink_bytes=9e11, in_layer_exchange_bytes=(5e11, 0.0),
                   in_layer_covered_bytes=(3e11, 0.0))
    s, c = (step_time.price(x, GH, "expected") for x in (w, covered))
    assert c["in_layer_exchange"] == pytest.approx(s["in_layer_exchange"] - 3e11 / nvlink_bw)
    e = step_time.estimate(covered, GH, tokens_per_device=1.0, model_flops=1.0)
    assert e["lines"]["in_layer_exchange"]["covered_nvlink_bytes"] == 3e11
