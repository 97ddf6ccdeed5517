"""The step priced per class of kernel (plan/price/step_time.py) at the efficiencies of
plan/price/hardware.py, the overlap model, and the ranges."""

import dataclasses

import pytest

from europa_jax.config import ConfigError
from europa_jax.plan.price import hardware, step_time
from europa_jax.plan.price.hardware import Curve, Efficiency

GH = hardware.GH200_JUPITER


def work(**kw) -> step_time.StepWork:
    base = dict(dense_gemms=(), grouped_gemms=(), attention_forward_flops=0.0,
                attention_backward_flops=0.0, memory_bytes=0.0, update_bytes=0.0,
                to_host_bytes=0.0, to_device_bytes=0.0, nvlink_bytes=0.0, nvlink_peers=3,
                infiniband_bytes=0.0)
    return step_time.StepWork(**{**base, **kw})


def test_each_class_is_priced_at_its_own_efficiency():
    peak, hbm = GH.bf16_flops, GH.hbm_bandwidth
    big = 4096 * 4096 * 4096 * 2.0
    w = work(dense_gemms=(("a", 4096, big, 0.0), ("b", 512, big, 0.0)),
             grouped_gemms=(("w", 4096, big, 0.0),),
             attention_forward_flops=big, attention_backward_flops=2 * big,
             memory_bytes=3e12, update_bytes=1e12, to_host_bytes=2e11, to_device_bytes=1e11,
             nvlink_bytes=9e11, infiniband_bytes=5e11)
    for case in hardware.CASES:
        s = step_time.price(w, GH, case)
        mem = GH.memory_bound.at(case)
        assert s["dense_gemm"] == pytest.approx(
            big / (peak * GH.dense_gemm.at(4096, case)) + big / (peak * GH.dense_gemm.at(512, case)))
        assert s["grouped_gemm"] == pytest.approx(big / (peak * GH.grouped_gemm.at(4096, case)))
        assert s["attention_forward"] == pytest.approx(big / (peak * GH.attention_forward.at(case)))
        assert s["attention_backward"] == pytest.approx(
            2 * big / (peak * GH.attention_backward.at(case)))
        assert s["memory_bound"] == pytest.approx(3e12 / (hbm * mem))
        assert s["optimizer_update"] == pytest.approx(1e12 / (hbm * mem))
        # both directions at once: the larger one
        assert s["host_copy"] == pytest.approx(2e11 / (GH.c2c_bandwidth * GH.host_copy.at(case)))
        assert s["nvlink"] == pytest.approx(9e11 / (3 * GH.nvlink_pair_bandwidth
                                                    * GH.nvlink.at(case)))
        assert s["infiniband"] == pytest.approx(5e11 / (GH.network_bandwidth
                                                        * GH.infiniband.at(case)))
    # a smaller GEMM reaches less of the peak; ends of the range are ordered
    assert GH.dense_gemm.at(512, "expected") < GH.dense_gemm.at(4096, "expected")
    assert GH.grouped_gemm.at(300, "expected") < GH.grouped_gemm.at(5000, "expected")


def test_a_skinny_gemm_is_bound_by_its_bytes():
    """2·M·N·K FLOPs against the bytes of its operands: a [65536, 7168] × [7168, 8] GEMM
    moves ~1 GB for 7.5 GFLOP — the roofline's memory side prices it."""
    m, k, n = 65536, 7168, 8
    flops, moved = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
    s = step_time.price(work(dense_gemms=(("skinny", n, flops, moved),)), GH, "expected")
    assert s["dense_gemm"] == pytest.approx(moved / (GH.hbm_bandwidth * GH.memory_bound.expected))


def test_overlap_model_links_beside_compute_on_the_sms_nccl_leaves():
    keep = 0.88
    # link-bound: compute (4 s) ends while InfiniBand (10 s) is still busy: 4 / 0.88 < 10
    s = dict.fromkeys(step_time.CLASSES, 0.0) | {"dense_gemm": 4.0, "infiniband": 10.0,
                                                  "nvlink": 2.0, "host_copy": 1.0}
    assert step_time.step_seconds(s, keep) == pytest.approx(10.0)
    # compute-bound: 20 s of compute, 10 of it beside the link at 88 % speed
    s |= {"dense_gemm": 12.0, "memory_bound": 8.0}
    assert step_time.step_seconds(s, keep) == pytest.approx(20.0 + 10.0 * (1 - keep))
    # close: 9.5 s of compute does 8.8 s of it beside the link, the rest after it
    s |= {"dense_gemm": 9.5, "memory_bound": 0.0}
    assert step_time.step_seconds(s, keep) == pytest.approx(10.0 + 9.5 - 10.0 * keep)
    # host copies alone may bound it
    s |= {"host_copy": 30.0}
    assert step_time.step_seconds(s, keep) == pytest.approx(30.0)


def test_the_estimate_is_a_range_and_keeps_the_stable_keys():
    w = work(dense_gemms=(("o", 7168, 4e16, 0.0),), memory_bytes=4e13, infiniband_bytes=1e12,
             attention_forward_flops=1e15, attention_backward_flops=2.5e15)
    e = step_time.estimate(w, GH, tokens_per_device=65536.0, model_flops=3e16)
    rng = e["range"]
    assert (rng["low"]["tokens_per_s_per_gpu"] < rng["expected"]["tokens_per_s_per_gpu"]
            < rng["high"]["tokens_per_s_per_gpu"])
    assert rng["expected"]["step_s"] == pytest.approx(e["step_overlapped_s"])
    assert e["tokens_per_s_per_gpu_overlapped"] == pytest.approx(65536.0 / e["step_overlapped_s"])
    by = e["by_class"]
    assert set(by) == set(step_time.CLASSES)
    assert sum(c["share_of_serial"] for c in by.values()) == pytest.approx(1.0)
    assert e["step_serial_s"] == pytest.approx(sum(c["seconds"]["expected"] for c in by.values()))
    assert e["compute_s"] == pytest.approx(sum(by[k]["seconds"]["expected"] for k in (
        "dense_gemm", "grouped_gemm", "attention_forward", "attention_backward")))
    assert e["memory_s"] == by["memory_bound"]["seconds"]["expected"] > 0
    assert by["dense_gemm"]["effective_efficiency"]["expected"] == pytest.approx(
        GH.dense_gemm.at(7168, "expected"))
    assert e["mfu_overlapped"] == pytest.approx(3e16 / e["step_overlapped_s"] / GH.bf16_flops)


def test_the_ceilings_price_the_same_step_with_its_links_free():
    """InfiniBand free takes its bytes off the overlapped link, the in-layer exchanges and
    the serial phases, and leaves NVLink's; both links free leave the compute stream."""
    w = work(dense_gemms=(("o", 7168, 4e16, 0.0),), memory_bytes=4e13, infiniband_bytes=1e13,
             nvlink_bytes=2e12, launches=1e5,
             in_layer_exchange_bytes=(3e11, 5e10), update_exchange_bytes=(1e10, 2e10),
             fill_drain_bytes=(4e10, 6e10))
    e = step_time.estimate(w, GH, tokens_per_device=65536.0, model_flops=3e16)
    for case in hardware.CASES:
        s = step_time.price(w, GH, case)
        compute = (sum(s[k] for k in step_time.COMPUTE) + s["kernel_launches"]
                   + s["loop_trip_syncs"])
        nvlink_pair = GH.nvlink_bandwidth(w.nvlink_peers) * GH.nvlink.at(case)
        keep = GH.overlap_compute.at(case)
        # NVLink's seconds less its serial phases' beside the compute stream, which waits
        # for the in-layer exchange's NVLink part; the serial phases at their NVLink part
        links = (2e12 - 1e10 - 4e10) / nvlink_pair
        chain = compute + 3e11 / nvlink_pair
        stream = chain / keep if chain <= links * keep else chain + links * (1 - keep)
        expected_ib_free = max(stream, links) + (1e10 + 4e10) / nvlink_pair
        ceilings = e["ceilings"]
        assert ceilings["infiniband_free"][case]["step_s"] == pytest.approx(expected_ib_free)
        assert ceilings["links_free"][case]["step_s"] == pytest.approx(compute)
        assert (ceilings["links_free"][case]["tokens_per_s_per_gpu"]
                >= ceilings["infiniband_free"][case]["tokens_per_s_per_gpu"]
                > e["range"][case]["tokens_per_s_per_gpu"])
    # a step with nothing on InfiniBand is its own InfiniBand-free ceiling
    lone = work(dense_gemms=(("o", 7168, 4e16, 0.0),), nvlink_bytes=2e12)
    lone_e = step_time.estimate(lone, GH, tokens_per_device=65536.0, model_flops=3e16)
    assert lone_e["ceilings"]["infiniband_free"]["expected"]["step_s"] == pytest.approx(
        lone_e["range"]["expected"]["step_s"])


def test_a_curve_interpolates_in_log_size_and_is_flat_beyond_its_ends():
    curve = Curve(points=((100, Efficiency(low=0.1, expected=0.2, high=0.3, source="a")),
                          (10000, Efficiency(low=0.5, expected=0.6, high=0.7, source="b"))))
    assert curve.at(1000, "expected") == pytest.approx(0.4)  # halfway in log10
    assert curve.at(10, "low") == 0.1 and curve.at(1e6, "high") == 0.7
    with pytest.raises(ConfigError, match="increasing"):
        Curve(points=((100, curve.points[0][1]), (100, curve.points[1][1])))
    with pytest.raises(ConfigError, match="low ≤ expected ≤ high"):
        Efficiency(low=0.5, expected=0.4, high=0.6, source="x")


def test_every_efficiency_names_its_source():
    for name, e in GH.efficiencies().items():
        sources = [p["source"] for p in e["points"]] if "points" in e else [e["source"]]
        assert all(s.strip() for s in sources), name
        # each cites an entry of hardware.py's source list, or says it is a judgement
        assert all("[" in s or "judgement" in s for s in sources), (name, sources)
    text = hardware.__doc__
    for e in GH.efficiencies().values():
        for s in ([p["source"] for p in e["points"]] if "points" in e else [e["source"]]):
            for key in (k.split("]")[0] for k in s.split("[")[1:]):
                assert f"[{key}]" in text, key


def test_replacing_an_efficiency_changes_only_its_class():
    slower = dataclasses.replace(GH, attention_backward=Efficiency(
        low=0.1, expected=0.2, high=0.3, source="test"))
    w = work(attention_backward_flops=1e15, dense_gemms=(("a", 4096, 1e15, 0.0),))
    a, b = step_time.price(w, GH, "expected"), step_time.price(w, slower, "expected")
    assert b["dense_gemm"] == a["dense_gemm"]
    assert b["attention_backward"] == pytest.approx(a["attention_backward"] * 0.48 / 0.2)
