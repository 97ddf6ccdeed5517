"""The plan's step estimate as text: seconds by class of kernel at each end of the
efficiency ranges, the lines the overlap model leaves out, the step's range and ceilings."""

from __future__ import annotations

from typing import Any

from europa_jax.plan.report_units import _flop, _s, size


def _estimate(e: dict[str, float], label: str) -> list[str]:
    return [f"  {label}:",
            f"    compute {_s(e['compute_s'])} + memory {_s(e['memory_s'])} + update "
            f"{_s(e['update_s'])} | NVLink "
            f"{_s(e['nvlink_s'])} | InfiniBand {_s(e['infiniband_s'])} | C2C {_s(e['c2c_s'])}",
            f"    step {_s(e['step_overlapped_s'])} overlapped → "
            f"{e['tokens_per_s_per_gpu_overlapped']:,.0f} tokens/s/GPU (MFU "
            f"{e['mfu_overlapped']:.1%}); {_s(e['step_serial_s'])} serial → "
            f"{e['tokens_per_s_per_gpu_serial']:,.0f} tokens/s/GPU"]


CLASS_LABELS = {"dense_gemm": "dense GEMMs", "grouped_gemm": "grouped GEMMs (experts)",
                "attention_forward": "flash attention forward",
                "attention_backward": "flash attention backward",
                "memory_bound": "memory-bound kernels", "optimizer_update": "optimizer update",
                "host_copy": "host copies (C2C)", "nvlink": "NVLink collectives",
                "infiniband": "InfiniBand collectives"}


def _amount(kind: str, row: dict) -> str:
    """What a class moves or computes per GPU per step."""
    if row["flops"]:
        return _flop(row["flops"]).strip()
    return size(row["bytes"]) + (" both ways" if kind == "host_copy" else "")


def _step_table(r: dict[str, Any]) -> list[str]:
    """The step by class of kernel: seconds at each end of the efficiency ranges, the
    share of the serial sum, and the step as a range under the overlap model."""
    e, hw = r["estimate"], r["machine"]
    lines = [f"estimate on {hw['name']} (hardware.py): {e['calibration']}",
             "  seconds per GPU per step at the low, expected and high end of every "
             "efficiency range; share of the serial sum",
             f"  {'class':<28}{'work':>18}{'low':>10}{'expected':>10}{'high':>10}"
             f"{'share':>8}  efficiency (expected)"]
    for kind, row in e["by_class"].items():
        sec = row["seconds"]
        eff = row.get("effective_efficiency", {}).get("expected")
        if eff:  # what the class reached of the FLOP peak, whatever bound it
            note = f"{eff:.0%} of the FLOP peak"
        elif kind in _EFFICIENCY_OF:
            note = (f"{e['efficiencies'][_EFFICIENCY_OF[kind]]['expected']:.0%} of "
                    f"{_PEAK_OF[kind]}")
        else:
            note = ""
        lines.append(f"  {CLASS_LABELS[kind]:<28}{_amount(kind, row):>18}{_s(sec['low']):>10}"
                     f"{_s(sec['expected']):>10}{_s(sec['high']):>10}"
                     f"{row['share_of_serial']:>8.1%}  {note}")
    for kind in ("dense_gemm", "grouped_gemm"):
        rows = e.get("gemms", {}).get(kind, [])
        if rows:
            lines.append(f"  longest {CLASS_LABELS[kind]} (expected):")
            lines += [f"    {_s(g['seconds']):>9}  {g['shape']:<44} {_flop(g['flops']).strip():>16}"
                      f"  {g['efficiency']:.0%} at {g['size']:,.0f}"
                      + (", bound by its bytes" if g["bound"] == "HBM" else "") for g in rows[:4]]
    lines += _lines(e.get("lines") or {})
    rng = e["range"]
    lines += [f"  {'step (overlap model + the lines above)':<46}"
              + "".join(f"{_s(rng[c]['step_s']):>10}" for c in ("low", "expected", "high")),
              f"  tokens/s/GPU {rng['low']['tokens_per_s_per_gpu']:,.0f} – "
              f"{rng['high']['tokens_per_s_per_gpu']:,.0f}, expected "
              f"{rng['expected']['tokens_per_s_per_gpu']:,.0f} (MFU "
              f"{rng['low']['mfu']:.1%} – {rng['high']['mfu']:.1%})",
              f"  overlap model: {e['overlap_model']}"]
    lines += _ceilings(e.get("ceilings"))
    return lines


def _ceilings(ceilings: dict | None) -> list[str]:
    """The step with InfiniBand, or both links, free (step_time.ceilings)."""
    if not ceilings:
        return []
    label = {"infiniband_free": "InfiniBand free", "links_free": "NVLink and InfiniBand free"}
    return [f"  tokens/s/GPU with {label[name]}: {c['low']['tokens_per_s_per_gpu']:,.0f} – "
            f"{c['high']['tokens_per_s_per_gpu']:,.0f}, expected "
            f"{c['expected']['tokens_per_s_per_gpu']:,.0f} (fewer bytes cannot pass this)"
            for name, c in ceilings.items()]


LINE_LABELS = {"tf32_gemms": "float32 GEMMs in TF32 (in dense)",
               "mla_backward_ratio": "MLA backward ratio (in attention)",
               "kernel_launches": "kernel launches (chain)",
               "loop_trip_syncs": "data-dependent loop trips (chain)",
               "in_layer_exchange": "in-layer exchanges (chain)",
               "update_exchange": "optimizer collectives (serial)",
               "fill_drain": "first gathers, last reduce-scatters (serial)"}


def _lines(lines: dict) -> list[str]:
    """The named lines the overlap model leaves out (step_time.py), with their sources."""
    if not lines:
        return []
    out = ["  what the overlap model leaves out (included in the step below):"]
    for name, row in lines.items():
        sec = row["seconds"]
        amount = (f"{row['count']:,.0f}" if "count" in row else
                  size(row["nvlink_bytes"] + row["infiniband_bytes"])
                  if "nvlink_bytes" in row else "")
        out.append(f"    {LINE_LABELS.get(name, name):<44}{amount:>12}{_s(sec['low']):>10}"
                   f"{_s(sec['expected']):>10}{_s(sec['high']):>10}")
        out.append(f"      {row['source']}")
    return out


# The efficiency (hardware.py) and the peak each byte-priced class is read against.
_EFFICIENCY_OF = {"memory_bound": "memory_bound", "optimizer_update": "memory_bound",
                  "host_copy": "host_copy", "nvlink": "nvlink", "infiniband": "infiniband"}
_PEAK_OF = {"memory_bound": "HBM", "optimizer_update": "HBM", "host_copy": "C2C",
            "nvlink": "NVLink", "infiniband": "InfiniBand"}
