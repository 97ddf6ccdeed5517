"""Every launch of an optimized GPU program in exactly one class (plan/program/kernel_classes.py),
on HLO written as XLA:GPU prints it; the tiny GH200 program's own are in
test_gpu_target.py."""

import pytest

from europa_jax.plan.program import hlo_program, kernel_classes

# jax 0.12 names a Pallas kernel's call `…/<kernel name>/mpmd_map` (Mosaic GPU)
PALLAS = 'metadata={op_name="jit(f)/transpose(jvp())/layer/%s/mpmd_map"}'
HLO = """HloModule m

%wrapped_dus (p0: bf16[3,8,16], p1: bf16[1,8,16], p2: s32[]) -> bf16[3,8,16] {
  %p0 = bf16[3,8,16]{2,1,0:S(5)} parameter(0)
  %p1 = bf16[1,8,16]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %dus = bf16[3,8,16]{2,1,0:S(5)} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
  ROOT %c = bf16[3,8,16]{2,1,0:S(5)} copy(%dus)
}

%wrapped_ds (q0: bf16[3,8,16], q1: s32[]) -> bf16[1,8,16] {
  %q0 = bf16[3,8,16]{2,1,0:S(5)} parameter(0)
  %q1 = s32[] parameter(1)
  %z.1 = s32[] constant(0)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%q0, %q1, %z.1, %z.1), dynamic_slice_sizes={1,8,16}
}

%addressed (r0: bf16[8,16], r1: bf16[16,4]) -> (bf16[8,4], s8[64]) {
  %r0 = bf16[8,16]{1,0} parameter(0)
  %r1 = bf16[16,4]{1,0} parameter(1)
  ROOT %inner = (bf16[8,4]{1,0}, s8[64]{0}) custom-call(%r0, %r1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}

%fused_add (a0: f32[8,4], a1: f32[8,4]) -> f32[8,4] {
  %a0 = f32[8,4]{1,0} parameter(0)
  %a1 = f32[8,4]{1,0} parameter(1)
  ROOT %add = f32[8,4]{1,0} add(%a0, %a1)
}

%body (p: (s32[], bf16[2,8,16], bf16[2,16,4], f32[8,4])) -> (s32[], bf16[2,8,16], bf16[2,16,4], f32[8,4]) {
  %p = (s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{2,1,0}, f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[2,8,16]{2,1,0} get-tuple-element(%p), index=1
  %w = bf16[2,16,4]{2,1,0} get-tuple-element(%p), index=2
  %acc = f32[8,4]{1,0} get-tuple-element(%p), index=3
  %gemm = (f32[2,8,4]{2,1,0}, s8[64]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  %sum = f32[8,4]{1,0} fusion(%acc, %acc), kind=kLoop, calls=%fused_add
  %ag = bf16[4,8,16]{2,1,0} all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}
  %agd = bf16[4,8,16]{2,1,0} all-gather-done(%ag)
  ROOT %t = (s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{2,1,0}, f32[8,4]{1,0}) tuple(%i, %x, %w, %sum)
}

%cond (pc: (s32[], bf16[2,8,16], bf16[2,16,4], f32[8,4])) -> pred[] {
  %pc = (s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{2,1,0}, f32[8,4]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (e0: bf16[2,8,16], e1: bf16[2,16,4], e2: f32[8,4], e3: bf16[3,8,16], e4: bf16[64,32], e5: bf16[4,32,16], e6: s32[4], e7: f32[64,64], e8: bf16[1,128,4,48], e9: bf16[1,128,4,32], e10: s32[1,128]) -> f32[8,4] {
  %e0 = bf16[2,8,16]{2,1,0} parameter(0)
  %e1 = bf16[2,16,4]{2,1,0} parameter(1)
  %e2 = f32[8,4]{1,0} parameter(2)
  %e3 = bf16[3,8,16]{2,1,0:S(5)} parameter(3)
  %e4 = bf16[64,32]{1,0} parameter(4)
  %e5 = bf16[4,32,16]{2,1,0} parameter(5)
  %e6 = s32[4]{0} parameter(6)
  %e7 = f32[64,64]{1,0} parameter(7)
  %e8 = bf16[1,128,4,48]{3,2,1,0} parameter(8)
  %e9 = bf16[1,128,4,32]{3,2,1,0} parameter(9)
  %e10 = s32[1,128]{1,0} parameter(10)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{2,1,0}, f32[8,4]{1,0}) tuple(%zero, %e0, %e1, %e2)
  %loop = (s32[], bf16[2,8,16]{2,1,0}, bf16[2,16,4]{2,1,0}, f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %x0 = bf16[8,16]{1,0} bitcast(%e0)
  %w0 = bf16[16,4]{1,0} bitcast(%e1)
  %addressed_gemm = (bf16[8,4]{1,0}, s8[64]{0}) fusion(%x0, %w0), kind=kCustom, calls=%addressed
  %rows = bf16[64,16]{1,0} custom-call(%e6, %e4, %e5), custom_call_target="mosaic_gpu_v2", @RAGGED@
  %xt = bf16[32,64]{1,0} bitcast(%e4)
  %wgrad = f32[4,32,16]{2,1,0} custom-call(%e6, %xt, %rows), custom_call_target="mosaic_gpu_v2", @WGRAD@
  %flash = (bf16[1,128,4,32]{3,2,1,0}, f32[1,4,128]{2,1,0}) custom-call(%e8, %e8, %e9, %e10), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={bf16[1,128,4,48]{3,2,1,0}, bf16[1,128,4,48]{3,2,1,0}, bf16[1,128,4,32]{3,2,1,0}, s32[1,128]{1,0}}, api_version=API_VERSION_TYPED_FFI, @FWD@
  %flash_vjp = bf16[1,128,4,48]{3,2,1,0} custom-call(%e8, %e8, %e9, %e10), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={bf16[1,128,4,48]{3,2,1,0}, bf16[1,128,4,48]{3,2,1,0}, bf16[1,128,4,32]{3,2,1,0}, s32[1,128]{1,0}}, api_version=API_VERSION_TYPED_FFI, @VJP@
  %other = bf16[64,32]{1,0} custom-call(%e4), custom_call_target="mosaic_gpu_v2", @OTHER@
  %to_device = (f32[64,64]{1,0}, f32[64,64]{1,0:S(5)}, u32[]) copy-start(%e7)
  %to_device.done = f32[64,64]{1,0} copy-done(%to_device)
  %slice = bf16[1,8,16]{2,1,0} bitcast(%x0)
  %offload = ((bf16[3,8,16]{2,1,0:S(5)}, bf16[1,8,16]{2,1,0}, s32[]), bf16[3,8,16]{2,1,0:S(5)}, u32[]) fusion-start(%e3, %slice, %zero), kind=kCustom, calls=%wrapped_dus
  %offload.done = bf16[3,8,16]{2,1,0:S(5)} fusion-done(%offload)
  %fetch = ((bf16[3,8,16]{2,1,0:S(5)}, s32[]), bf16[1,8,16]{2,1,0}, u32[]) fusion-start(%offload.done, %zero), kind=kCustom, calls=%wrapped_ds
  %fetch.done = bf16[1,8,16]{2,1,0} fusion-done(%fetch)
  %buffer = f32[16]{0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%loop), index=3
}
""".replace("@RAGGED@", PALLAS % "moe/ragged_dot_sm90").replace(
    "@WGRAD@", PALLAS % "moe/ragged_contracting_dim_dot_sm90").replace(
    "@FWD@", PALLAS % "attention/attention_kernel/flash_attention_sm90").replace(
    "@VJP@", PALLAS % "attention/attention_kernel/anonymous").replace(
    "@OTHER@", PALLAS % "norm/anonymous")


@pytest.fixture(scope="module")
def found():
    return {k.launch.name: k for k in kernel_classes.kernels(HLO)}


def test_every_launch_is_in_one_class_and_nothing_else_is_a_launch(found):
    assert {name: k.kind for name, k in found.items()} == {
        "gemm": "dense_gemm", "sum": "memory_bound", "ag": "collective",
        "addressed_gemm": "dense_gemm", "rows": "grouped_gemm", "wgrad": "grouped_gemm",
        "flash": "attention_forward", "flash_vjp": "attention_backward",
        "other": "memory_bound", "to_device": "host_copy", "offload": "host_copy", "fetch": "host_copy"}
    # the loop's kernels run its trip count; the condition's constant is no launch
    assert found["gemm"].runs == found["sum"].runs == found["ag"].runs == 3
    assert found["flash"].runs == 1


def test_gemm_shapes_and_flops_are_read_from_the_dot_dimensions(found):
    batched = found["gemm"]
    assert batched.dims == (2, 8, 4, 16) and batched.flops_per_run == 2 * 2 * 8 * 4 * 16
    assert batched.bytes_per_run == 2 * 8 * 16 * 2 + 2 * 16 * 4 * 2 + 2 * 8 * 4 * 4
    # the GEMM a dynamic-slice fusion wraps, at its own shapes
    assert found["addressed_gemm"].dims == (1, 8, 4, 16)


def test_grouped_matmuls_forward_and_weight_gradient(found):
    """Rows W over G experts, K × N each: [W, K] × [G, K, N], and the weight gradient
    [K, W]ᵀ·[W, N] → [G, K, N]; 2·W·K·N FLOPs either way."""
    for name in ("rows", "wgrad"):
        assert found[name].dims == (64, 4, 32, 16)
        assert found[name].flops_per_run == 2 * 64 * 32 * 16
    s = kernel_classes.summary(list(found.values()), grouped_fill=0.5)
    window = s["grouped_gemm"]["windows"][0]
    assert window["rows_per_expert"] == 64 * 0.5 / 4 and window["runs"] == 2
    assert s["grouped_gemm"]["flops"] == 2 * (2 * 64 * 32 * 16) * 0.5
    # a window handed the layer's whole stack reaches only its group's experts
    reach = kernel_classes.summary(list(found.values()), grouped_fill=0.5, window_experts=2)
    window = reach["grouped_gemm"]["windows"][0]
    assert window["experts"] == 2 and window["rows_per_expert"] == 64 * 0.5 / 2
    assert reach["grouped_gemm"]["flops"] == s["grouped_gemm"]["flops"]


def test_library_kernels_are_named_by_the_call_the_lowering_names():
    """Mosaic GPU calls end `<kernel>/mpmd_map`, Triton ones `<kernel>/pallas_call`; the
    unnamed sm90 flash backward is known by its attention scope, an unnamed kernel
    elsewhere is no library kernel; cuDNN's attention by its target."""
    line = 'custom_call_target="%s", metadata={op_name="jit(f)/%s"}'
    assert kernel_classes.library_kernel(line % ("mosaic_gpu_v2", "a/ragged_dot_sm90/mpmd_map")
                                         ) == ("grouped_gemm", "ragged_dot_sm90")
    assert kernel_classes.library_kernel(line % (
        "__gpu$xla.gpu.triton", "jvp()/pallas_flash_attention_fwd_res/pallas_call")) == (
        "attention_forward", "pallas_flash_attention_fwd_res")
    assert kernel_classes.library_kernel(line % (
        "__gpu$xla.gpu.triton", "transpose(jvp())/pallas_flash_attention_vjp/pallas_call")
    )[0] == "attention_backward"
    assert kernel_classes.library_kernel(line % (
        "mosaic_gpu_v2", "transpose(jvp())/attention_kernel/while/body/anonymous/mpmd_map")
    ) == ("attention_backward", "flash_attention_vjp")
    assert kernel_classes.library_kernel(line % ("mosaic_gpu_v2", "mlp/anonymous/mpmd_map")) is None
    assert kernel_classes.library_kernel(line % ("__cudnn$fmhaSoftmaxBackward", "a/b")) == (
        "attention_backward", "__cudnn$fmhaSoftmaxBackward")
    assert kernel_classes.library_kernel(line % ("__cublas$lt$matmul", "a/dot_general")) is None
    triton = ('custom_call_target="triton_kernel_call_ffi", metadata={op_name="jit(f)/'
              'triton_kernel_call" metadata_payload="tokamax:{\\"op\\":{\\"__type\\":'
              '\\"tokamax._src.ops.ragged_dot.triton.TritonRaggedDot\\"}}"}')
    assert kernel_classes.library_kernel(triton) == ("grouped_gemm", "TritonRaggedDot")


def test_attention_calls_keep_their_shapes_not_flops(found):
    assert found["flash"].dims == (1, 128, 4, 48, 32) == found["flash_vjp"].dims
    assert found["flash"].flops_per_run == 0  # the plan prices the pairs (attention_cost.py)


def test_host_copies_move_their_slice_each_way(found):
    assert not found["to_device"].to_host and found["to_device"].bytes_per_run == 64 * 64 * 4
    assert found["offload"].to_host and found["offload"].bytes_per_run == 8 * 16 * 2
    assert not found["fetch"].to_host and found["fetch"].bytes_per_run == 8 * 16 * 2
    s = kernel_classes.summary(list(found.values()))
    assert s["host_copy"]["to_host_bytes"] == 256
    assert s["host_copy"]["to_device_bytes"] == 64 * 64 * 4 + 256


def test_launches_skip_what_runs_no_kernel():
    names = {launch.name for launch in hlo_program.launches(hlo_program.Module(HLO))}
    assert not names & {"init", "loop", "x0", "out", "zero", "agd", "to_device.done",
                        "offload.done", "lt", "i", "t"}
    assert "buffer" in names  # a custom call: classify() says it is none
    assert "buffer" not in {k.launch.name for k in kernel_classes.kernels(HLO)}


def test_a_dot_xla_left_to_itself_is_a_gemm_of_its_dims():
    hlo = """HloModule d

ENTRY %main (a: f32[3,8,16], b: f32[3,16,4]) -> f32[3,8,4] {
  %a = f32[3,8,16]{2,1,0} parameter(0)
  %b = f32[3,16,4]{2,1,0} parameter(1)
  ROOT %d = f32[3,8,4]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""
    (k,) = kernel_classes.kernels(hlo)
    assert k.kind == "dense_gemm" and k.dims == (3, 8, 4, 16)
    assert k.flops_per_run == 2 * 3 * 8 * 4 * 16


def test_a_gemm_runs_in_the_math_its_operands_and_precision_say():
    """float32 operands at the default precision run on TF32 tensor cores (jax's default
    on GPU), at HIGHEST in plain FP32; bf16 and fp8 operands in their own."""
    line = ('custom-call(a, b), custom_call_target="__cublas$lt$matmul", backend_config='
            '{"gemm_backend_config":{"precision_config":{"operand_precision":[%s],'
            '"algorithm":"ALG_UNSET"}}}')
    f32, bf16, fp8 = "f32[64,64]{1,0}", "bf16[64,64]{1,0}", "f8e4m3fn[64,64]{1,0}"
    assert kernel_classes.gemm_math([f32, f32], line % '"DEFAULT","DEFAULT"') == "tf32"
    assert kernel_classes.gemm_math([f32, f32], line % '"HIGHEST","HIGHEST"') == "fp32"
    assert kernel_classes.gemm_math([bf16, bf16], line % '"DEFAULT","DEFAULT"') == "bf16"
    assert kernel_classes.gemm_math([fp8, fp8], line % '"DEFAULT","DEFAULT"') == "fp8"
    assert kernel_classes.gemm_math([f32, f32], 'x, "algorithm":"ALG_DOT_F32_F32_F32"') == "fp32"
