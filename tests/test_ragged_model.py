"""The CPU model of `jax.lax.ragged_all_to_all` (parallel/ragged_model.py) against the op's
documentation: its worked example, and its send/receive pseudocode written out in NumPy
for random offsets and sizes, with groups, several slices per device, peers that send
nothing and rows of `output` that must stay untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from europa_jax.parallel import ragged_model


def run(n_devices, operands, outputs, *offsets_and_sizes, groups=None):
    """The model inside shard_map over the first n_devices CPU devices, each device
    given its own row of every argument; its results, one row per device."""
    mesh = jax.make_mesh((n_devices,), ("expert",), devices=jax.devices()[:n_devices],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def body(operand, output, *args):
        return ragged_model.ragged_all_to_all(operand[0], output[0], *(a[0] for a in args),
                                              axis_name="expert",
                                              axis_index_groups=groups)[None]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    return np.asarray(jax.jit(f)(*map(jnp.asarray, (operands, outputs, *offsets_and_sizes))))


def test_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring, axis of size 2."""
    result = run(2, [[1, 2, 2], [3, 4, 0]], [[0] * 4, [0] * 4],
                 [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def documented(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes,
               groups):
    """The docstring's SEND/RECEIVE pseudocode, every device at once, in NumPy."""
    results = [np.array(o) for o in outputs]
    for group in groups:
        n = len(group)
        per_device = len(input_offsets[group[0]]) // n
        for pos, src in enumerate(group):
            for i in range(len(input_offsets[src])):
                dst = group[i // per_device]
                # where this slice lands: the receiver's all_to_all(output_offsets)[j],
                # i.e. the sender's own output_offsets[i]
                start, size = input_offsets[src][i], send_sizes[src][i]
                sent = operands[src][start:start + size]
                j = pos * per_device + i % per_device  # its index at the receiver
                assert recv_sizes[dst][j] == size  # the contract the caller keeps
                at = output_offsets[src][i]
                results[dst][at:at + size] = sent
    return np.stack(results)


def random_exchange(rng, n_devices, groups, per_device, rows, out_rows):
    """Random slices for each group: each sender's slices packed in its operand with
    gaps, each receiver's slices packed in its output with gaps, some of size 0."""
    n = len(groups[0])
    k = n * per_device
    sizes = rng.integers(0, 4, size=(n_devices, k))  # send_sizes
    sizes[rng.random(sizes.shape) < 0.25] = 0  # peers that send nothing
    input_offsets = np.zeros_like(sizes)
    for d in range(n_devices):
        input_offsets[d] = np.cumsum(sizes[d] + 1) - sizes[d] - 1 + 1  # a gap before each
    recv_sizes = np.zeros_like(sizes)
    output_offsets = np.zeros_like(sizes)
    for group in groups:
        for pos_dst, dst in enumerate(group):
            at = 2  # rows 0-1 of every output are never written
            for pos_src, src in enumerate(group):
                for s in range(per_device):
                    i_src = pos_dst * per_device + s  # the sender's slice aimed at dst
                    j_dst = pos_src * per_device + s
                    size = sizes[src][i_src]
                    recv_sizes[dst][j_dst] = size
                    output_offsets[src][i_src] = at
                    at += size + 1
    assert input_offsets.max() + 4 <= rows and output_offsets.max() + 4 <= out_rows
    operands = rng.normal(size=(n_devices, rows, 3)).astype(np.float32)
    outputs = np.full((n_devices, out_rows, 3), -7.0, np.float32)  # untouched rows stay
    return operands, outputs, input_offsets, sizes, output_offsets, recv_sizes


@pytest.mark.parametrize("groups,per_device", [
    (None, 1), (None, 2), ([[0, 1, 2, 3], [4, 5, 6, 7]], 1), ([[0, 4], [1, 5], [2, 6], [3, 7]], 2),
])
def test_random_slices_land_where_the_documentation_says(groups, per_device):
    rng = np.random.default_rng(len(groups or []) * 10 + per_device)
    every = groups or [list(range(8))]
    args = random_exchange(rng, 8, every, per_device, rows=80, out_rows=120)
    expected = documented(*args, every)
    np.testing.assert_array_equal(run(8, *args, groups=groups), expected)
    assert (expected[:, :2] == -7.0).all()  # rows no one writes keep `output`'s values


def test_its_gradient_is_the_transpose_of_the_exchange():
    """d/d(operand) of Σ c·result: each sent row gets the cotangent of where it landed."""
    rng = np.random.default_rng(3)
    groups = [list(range(8))]
    operands, outputs, *rest = random_exchange(rng, 8, groups, 1, rows=64, out_rows=96)
    c = rng.normal(size=outputs.shape).astype(np.float32)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(operand):
        def body(operand, output, c, *args):
            out = ragged_model.ragged_all_to_all(operand[0], output[0], *(a[0] for a in args),
                                                 axis_name="expert")
            return jax.lax.psum(jnp.sum(out * c[0]), "expert")
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 7, out_specs=P())
        return f(operand, jnp.asarray(outputs), jnp.asarray(c), *map(jnp.asarray, rest))

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(operands)))
    input_offsets, send_sizes, output_offsets, _ = rest
    want = np.zeros_like(operands)
    for src in range(8):
        for i in range(8):  # slice i of src goes to device i
            start, size, at = input_offsets[src][i], send_sizes[src][i], output_offsets[src][i]
            want[src][start:start + size] = c[i][at:at + size]
    np.testing.assert_allclose(grad, want, rtol=1e-6)
