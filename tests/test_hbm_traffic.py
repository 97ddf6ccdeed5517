"""The non-matmul HBM byte count on optimized GPU HLO as XLA:GPU prints it: what a kernel
reads and writes, loops, data-dependent loops and branches, what is left out."""

import pytest

from europa_jax.plan.program import hbm_traffic

MOE = 'metadata={op_name="jit(train_step)/jvp()/shard_map/moe_layers/moe/%s"}'
HLO = """HloModule m

%fused_slice (param_0.1: bf16[64,1024], param_1.1: s32[]) -> bf16[8,1024] {
  %param_0.1 = bf16[64,1024]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %bitcast.1 = bf16[64,1024]{1,0} bitcast(%param_0.1)
  ROOT %ds = bf16[8,1024]{1,0} dynamic-slice(%bitcast.1, %param_1.1, %c), dynamic_slice_sizes={8,1024}
}

%fused_update (param_0.2: f32[64,1024], param_1.2: f32[8,1024], param_2.2: s32[]) -> f32[64,1024] {
  %param_0.2 = f32[64,1024]{1,0} parameter(0)
  %param_1.2 = f32[8,1024]{1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %c.2 = s32[] constant(0)
  ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %c.2)
}

%fused_add (param_0.3: f32[8,1024], param_1.3: f32[8,1024]) -> f32[8,1024] {
  %param_0.3 = f32[8,1024]{1,0} parameter(0)
  %param_1.3 = f32[8,1024]{1,0} parameter(1)
  ROOT %add = f32[8,1024]{1,0} add(%param_0.3, %param_1.3)
}

%body (p: (s32[], f32[64,1024], bf16[64,1024])) -> (s32[], f32[64,1024], bf16[64,1024]) {
  %p = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %acc = f32[64,1024]{1,0} get-tuple-element(%p), index=1
  %x = bf16[64,1024]{1,0} get-tuple-element(%p), index=2
  %piece = bf16[8,1024]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused_slice, @GATHER@
  %gemm = (f32[8,1024]{1,0}, s8[1024]{0}) custom-call(%piece, %piece), custom_call_target="__cublas$lt$matmul"
  %out = f32[8,1024]{1,0} get-tuple-element(%gemm), index=0
  %sum = f32[8,1024]{1,0} fusion(%out, %out), kind=kLoop, calls=%fused_add, @GATHER@
  %acc2 = f32[64,1024]{1,0} fusion(%acc, /*index=1*/%sum, %i), kind=kLoop, calls=%fused_update, @GATHER@
  %ag = bf16[64,1024]{1,0} all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) tuple(%i, %acc2, %x)
}

%cond (p.2: (s32[], f32[64,1024], bf16[64,1024])) -> pred[] {
  %p.2 = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%rare (q: f32[8,1024]) -> f32[8,1024] {
  %q = f32[8,1024]{1,0} parameter(0)
  ROOT %copy.r = f32[8,1024]{1,0} copy(%q), @GATHER@
}

%skip (q.2: f32[8,1024]) -> f32[8,1024] {
  ROOT %q.2 = f32[8,1024]{1,0} parameter(0)
}

ENTRY %main (a: bf16[64,1024], b: f32[64,1024], k: s32[], y: f32[8,1024], pr: pred[]) -> f32[64,1024] {
  %a = bf16[64,1024]{1,0} parameter(0)
  %b = f32[64,1024]{1,0} parameter(1)
  %k = s32[] parameter(2)
  %y = f32[8,1024]{1,0} parameter(3)
  %pr = pred[] parameter(4)
  %init = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) tuple(%k, %b, %a)
  %loop = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) while(%init), condition=%cond, body=%body, @LOOP@, backend_config={"known_trip_count":{"n":"10"}}
  %overflow = (s32[], f32[64,1024]{1,0}, bf16[64,1024]{1,0}) while(%init), condition=%cond, body=%body, @OVERFLOW@
  %c = f32[8,1024]{1,0} conditional(%pr, %y, %y), true_computation=%rare, false_computation=%skip
  %host = f32[64,1024]{1,0:S(5)} copy(%b)
  ROOT %r = f32[64,1024]{1,0} get-tuple-element(%loop), index=1
}
""".replace("@GATHER@", MOE % "gather").replace("@OVERFLOW@", MOE % "overflow/while").replace(
    "@LOOP@", MOE % "while")

PIECE = 8 * 1024


def test_a_kernel_reads_what_it_slices_and_writes_what_it_updates():
    found = {k.name: k for k in hbm_traffic.kernels(HLO)}
    # a slice of a (bitcast) parameter reads the slice, not the whole operand
    assert found["piece"].bytes_per_run == 2 * PIECE * 2 + 4  # and its int32 index
    assert found["sum"].bytes_per_run == 3 * PIECE * 4  # two operands, one output
    # an update in place writes the update and reads it; the buffer is not read or rewritten
    assert found["acc2"].bytes_per_run == 2 * PIECE * 4 + 4
    assert "gemm" not in found and "ag" not in found and "host" not in found  # priced elsewhere


ASYNC = HLO.split("ENTRY")[0] + """ENTRY %main (a: bf16[64,1024], b: f32[64,1024], k: s32[], y: f32[8,1024]) -> f32[64,1024] {
  %a = bf16[64,1024]{1,0} parameter(0)
  %b = f32[64,1024]{1,0} parameter(1)
  %k = s32[] parameter(2)
  %y = f32[8,1024]{1,0} parameter(3)
  %slice-start = ((bf16[64,1024]{1,0}, s32[]), bf16[8,1024]{1,0}, u32[]) fusion-start(%a, %k), kind=kLoop, calls=%fused_slice
  %slice-done = bf16[8,1024]{1,0} fusion-done(%slice-start)
  %update-start = ((f32[64,1024]{1,0}, f32[8,1024]{1,0}, s32[]), f32[64,1024]{1,0}, u32[]) fusion-start(%b, %y, %k), kind=kLoop, calls=%fused_update
  ROOT %update-done = f32[64,1024]{1,0} fusion-done(%update-start)
}
"""


def test_an_async_fusion_moves_what_its_computation_does():
    """XLA:GPU runs some slices and in-place updates as async fusions (`fusion-start`,
    whose result tuple repeats the operands): the bytes are its computation's, not the
    whole buffers of the tuple."""
    found = {k.name: k for k in hbm_traffic.kernels(ASYNC)}
    assert set(found) == {"slice-start", "update-start"}  # -done launches nothing
    assert found["slice-start"].bytes_per_run == 2 * PIECE * 2 + 4
    assert found["update-start"].bytes_per_run == 2 * PIECE * 4 + 4


def test_loops_multiply_and_data_dependent_work_is_counted_apart():
    found = hbm_traffic.kernels(HLO)
    sure = [k for k in found if k.name == "piece" and not k.conditional]
    assert [k.runs for k in sure] == [10]
    maybe = [k for k in found if k.name == "piece" and k.conditional]
    assert [k.runs for k in maybe] == [1]  # a loop whose trip count is data: once per entry
    assert [k.conditional for k in found if k.name == "copy.r"] == [True]
    expected = hbm_traffic.kernels(HLO, lambda op_name: 0.0 if "overflow" in op_name else 3.0)
    assert [k.runs for k in expected if k.name == "piece" and k.conditional] == [0.0]
    summary = hbm_traffic.summary(found)
    piece, total_loop = 2 * PIECE * 2 + 4, 2 * PIECE * 2 + 4 + 3 * PIECE * 4 + 2 * PIECE * 4 + 4
    assert summary["bytes_per_step"] == pytest.approx(10 * total_loop)
    assert summary["by_region"] == {"moe": pytest.approx(10 * total_loop)}
    assert summary["data_dependent_bytes_per_step"] == pytest.approx(total_loop + 2 * PIECE * 4)
    assert summary["moe_loop_bytes_per_step"] == pytest.approx(10 * total_loop)
    assert summary["largest"][0]["kernel"] == "sum" and piece < total_loop
    assert hbm_traffic.priced_bytes(summary) == pytest.approx(11 * total_loop + 2 * PIECE * 4)


@pytest.mark.parametrize("op_name,region", [
    ("jit(train_step)/jvp()/shard_map/Transformer/Transformer._stack/while/body/closed_call/"
     "moe_layers/moe/expert_matmuls/while", "moe"),
    ("jit(train_step)/transpose(jvp())/shard_map/Transformer/Transformer._stack/while/body/"
     "closed_call/checkpoint/moe_layers/attention/attention_kernel/while", "attention"),
    ("jit(train_step)/jvp()/shard_map/Transformer/while/body/closed_call/reduce_max",
     "loss and LM head"),
    ("jit(train_step)/vmap()/closed_call/mul", "optimizer update"), ("", "unnamed")])
def test_regions_by_jax_op_name(op_name, region):
    assert hbm_traffic.region(op_name) == region
