"""k rows per device in one step (`data.global_batch_size` = k × devices): every weight is
gathered once per layer for all k rows, so gathered bytes per token fall k-fold, and the
step computes what k = 1 on k times the devices computes at the same global batch — the
rows through each layer together, or one at a time (`execution.row_loop`, model/row_loop.py).

(The tiny default runs 2 rows per device; its resume is bitwise in tests/test_checkpoint.py.
`train.microbatches` is the other trade: pieces of a device's rows, a gather per piece,
tests/test_microbatches.py.)"""

import dataclasses

import jax
import numpy as np
import pytest

from conftest import assert_trees_close

from europa_jax.parallel import sharding
from europa_jax.plan.program import hlo_report
from europa_jax.run import loop
from europa_jax.train import train
from test_comm import lowered_step_hlo, with_comm
from test_microbatches import gradients_of

ROWS = 8


def with_layout(cfg, data: int, rows: int):
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, data=data),
        data=dataclasses.replace(cfg.data, global_batch_size=rows))


def trainer_on(cfg, n_devices: int):
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:n_devices])
    return train.build_trainer(cfg, mesh)


def with_row_loop(cfg, on: bool):
    return dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, row_loop=on))


@pytest.fixture(scope="module")
def one_and_two_rows(tiny_cfg):
    """The same 8 rows and initial weights on 8 devices (1 row each) and on 4 (2 each),
    the 2 rows together or one at a time through each layer (`execution.row_loop`)."""
    trainers = {"one": trainer_on(with_layout(tiny_cfg, 2, ROWS), 8),
                "two": trainer_on(with_layout(tiny_cfg, 1, ROWS), 4),
                "two, row loop": trainer_on(with_row_loop(with_layout(tiny_cfg, 1, ROWS), True),
                                            4)}
    host_batch = next(iter(loop.host_batch_iterator(trainers["one"].cfg)))
    out = {}
    for name, trainer in trainers.items():
        state = train.init_state(trainer, seed=0)
        batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in host_batch.items()}
        out[name] = (trainer, state, batch)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("two", ["two", "two, row loop"])
def test_two_rows_per_device_compute_what_one_row_on_twice_the_devices_computes(
        one_and_two_rows, two):
    (loss_1, stats_1), grads_1 = gradients_of(*one_and_two_rows["one"])
    (loss_2, stats_2), grads_2 = gradients_of(*one_and_two_rows[two])
    np.testing.assert_allclose(loss_2, loss_1, rtol=1e-5)
    assert_trees_close(grads_2, grads_1, rtol=2e-5, atol=1e-7)
    # the routing is the same decision per token, whichever device holds the row
    for key in ("expert_counts_E", "routed_copies", "processed_copies"):
        np.testing.assert_array_equal(stats_2[key], stats_1[key], err_msg=key)
    np.testing.assert_allclose(stats_2["attention_logit_max_LH"],
                               stats_1["attention_logit_max_LH"], rtol=1e-5)
    if two == "two, row loop":  # a dispatch per row, as on twice the devices
        np.testing.assert_array_equal(stats_2["dispatches"], stats_1["dispatches"])


@pytest.mark.slow
@pytest.mark.parametrize("row_loop", [False, True])
def test_the_step_gathers_each_weight_once_for_all_of_a_device_s_rows(tiny_cfg, row_loop):
    """On the same 2 × 4 mesh, 2 rows per device move exactly the weight gathers and
    gradient reduce-scatters of 1 row (count per step, dtype, axis and bytes), while the
    MoE exchange inside a node carries twice the rows: in exchanges twice the size, or
    with the row loop twice as many exchanges of the same size."""
    cfg = with_comm(with_row_loop(tiny_cfg, row_loop), weight_gather_dtype="fp8",
                    grad_reduce_dtype="bf16", expert_exchange_dtype="bf16")
    mesh = sharding.make_mesh(cfg.mesh)

    def by_op(rows):
        found = hlo_report.collectives(lowered_step_hlo(with_layout(cfg, 2, rows), mesh), mesh)
        table = {}
        for c in found:
            key = (c.op, c.axes, c.dtype)
            count, nbytes = table.get(key, (0, 0))
            table[key] = (count + c.count, nbytes + c.bytes_per_device)
        return table

    one, two = by_op(8), by_op(16)
    weights = [k for k in one if k[0] in ("all-gather", "reduce-scatter") and k[1] == ("data",)]
    assert ("all-gather", ("data",), "f8e4m3fn") in weights
    assert ("reduce-scatter", ("data",), "bf16") in weights
    for key in weights:
        assert two[key] == one[key], key
    exchange = ("all-to-all", ("expert",), "bf16")
    assert two[exchange][0] == (2 if row_loop else 1) * one[exchange][0]
    assert two[exchange][1] == pytest.approx(2 * one[exchange][1], rel=0.05)


@pytest.mark.slow
def test_the_row_loop_s_gathers_carry_their_layers_name_for_the_plan(tiny_cfg):
    """The plan tells the step's fill and drain (the first layers' gathers and last
    reduce-scatters, which nothing hides: critical_path.py) by the layers' name in the ops'
    names. The row loop gathers a layer's weights on entry, outside the layer's modules,
    so it names them itself: at 2 rows per device the fill and drain move the same bytes
    with the loop as without (before, the loop's were unnamed and the plan priced its
    europa-952b fill and drain at 0.25 s instead of 1.03)."""
    from europa_jax.plan.price import critical_path

    cfg = with_comm(tiny_cfg, weight_gather_dtype="fp8", grad_reduce_dtype="bf16",
                    expert_exchange_dtype="bf16")
    mesh = sharding.make_mesh(cfg.mesh)

    def phases(row_loop):
        looped = with_layout(with_row_loop(cfg, row_loop), 2, 2 * ROWS)
        trainer = train.build_trainer(looped, mesh)
        with jax.set_mesh(mesh):  # compiled: the op names the plan reads are its metadata
            text = train.jit_train_step(trainer).lower(
                trainer.abstract_state, train.abstract_batch(trainer)).compile().as_text()
        first = "dense_layers" if looped.model.n_dense_layers else "moe_layers"
        return critical_path.phase_bytes(hlo_report.collectives(text, mesh), first)

    without, looped = phases(False), phases(True)
    for phase in ("fill", "drain"):
        assert sum(without[phase].values()) > 0, phase
        assert looped[phase] == pytest.approx(without[phase]), phase


def test_the_plan_counts_a_row_loop_s_dispatches_and_attention_passes_per_row(tiny_cfg):
    """Under the row loop a layer's MoE dispatches one row's tokens, and its attention
    kernel runs once per row per pass: the plan must neither price the dispatch at both
    rows nor count each row's kernel call as another pass over the device's rows."""
    from europa_jax.model.experts import moe
    from europa_jax.plan.price import step_work

    two = with_layout(tiny_cfg, 1, ROWS)  # 2 rows on each of 4 devices
    looped = with_row_loop(two, True)
    assert moe.dispatch_tokens(two) == 2 * two.data.seq_len
    assert moe.dispatch_tokens(looped) == looped.data.seq_len
    layers = step_work.attention_layers(two.model)
    forward_and_recompute = {"attention_forward": {"runs": 2 * layers}}
    assert step_work.forward_passes(two, forward_and_recompute) == 2
    per_row = {"attention_forward": {"runs": 2 * 2 * layers}}
    assert step_work.forward_passes(looped, per_row) == 2


@pytest.mark.slow
def test_the_row_loop_gives_each_trip_the_node_s_rows_under_context_parallelism(tiny_cfg):
    """With attention over the node's GPUs a trip takes row r of each of them (its
    segment ids and positions come gathered in device order): the same loss and
    gradients as the rows taken together. Every row gets its own document boundary, so
    that a trip given another row's segments would attend differently."""
    cp = dataclasses.replace(tiny_cfg, execution=dataclasses.replace(
        tiny_cfg.execution, attention_context_parallel=True))
    host_batch = dict(next(iter(loop.host_batch_iterator(with_layout(cp, 1, ROWS)))))
    seq = host_batch["tokens"].shape[1]
    at_S = np.arange(seq)
    cuts = [8 * (i + 1) for i in range(ROWS)]
    host_batch["segment_ids"] = np.stack([np.where(at_S < c, 1, 2) for c in cuts]).astype(np.int32)
    host_batch["positions"] = np.stack([np.where(at_S < c, at_S, at_S - c)
                                        for c in cuts]).astype(np.int32)
    results = []
    for on in (False, True):
        trainer = trainer_on(with_row_loop(with_layout(cp, 1, ROWS), on), 4)
        batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in host_batch.items()}
        results.append(gradients_of(trainer, train.init_state(trainer, seed=0), batch))
    ((loss_0, stats_0), grads_0), ((loss_1, stats_1), grads_1) = results
    np.testing.assert_allclose(loss_1, loss_0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_0), jax.tree.leaves(grads_1), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(stats_1["expert_counts_E"], stats_0["expert_counts_E"])


def test_the_row_loop_changes_no_parameter_path_or_shape(tiny_cfg):
    """The loop is a way of running a layer, not another model: a checkpoint written with
    it on restores with it off and back."""
    plain = train.abstract_params(tiny_cfg)
    looped = train.abstract_params(with_row_loop(tiny_cfg, True))
    assert jax.tree.structure(looped) == jax.tree.structure(plain)
    assert [x.shape for x in jax.tree.leaves(looped)] == [x.shape for x in jax.tree.leaves(plain)]
