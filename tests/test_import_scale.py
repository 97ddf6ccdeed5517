"""`import` at scale: each process reads only its shards' blocks of the HF tensors, and a
two-process import (launch/local.sh) equals the single-process one bitwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from europa_jax.interop import hf_import, hf_layout
from conftest import REPO, config_path, process_env
from test_export import TRAIN, cli, exported_fp32, saved_state, trained  # noqa: F401 (fixtures)

RNG = np.random.default_rng(0)

# (HF shape, Source, our item shape): one of every kind of layout map
CASES = {
    "linear_out_split": ((15, 4), hf_layout.Source("k", (), 1), (4, 3, 5)),
    "linear_in_split": ((5, 6), hf_layout.Source("k", (), 2), (2, 3, 5)),
    "embedding": ((10, 4), hf_layout.Source("k", (), None, "embedding"), (16, 4)),
    "lm_head": ((10, 4), hf_layout.Source("k", (), None, "lm_head"), (4, 16)),
    "vector": ((12,), hf_layout.Source("k", (), None, "vector"), (12,)),
    "storage_padded": ((15, 4), hf_layout.Source("k", (), 1, shape=(4, 3, 5)), (6, 3, 5)),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tensors = {name: RNG.standard_normal(shape).astype(np.float32)
               for name, (shape, _, _) in CASES.items()}
    save_file(tensors, str(root / "model.safetensors"))
    return root, tensors


def boxes(shape, n=20):
    for _ in range(n):
        yield [tuple(sorted(RNG.choice(d + 1, 2, replace=False))) for d in shape]


@pytest.mark.parametrize("name", CASES)
def test_a_region_reads_only_its_block_and_equals_the_whole_mapped(hf_dir, name):
    root, tensors = hf_dir
    shape, source, item_shape = CASES[name]
    t = hf_layout.HFTensor(name, shape, source)
    whole = hf_layout.from_hf(tensors[name], source, item_shape)
    for region in boxes(item_shape):
        weights = hf_import.SafetensorsDir(root)
        got = hf_import.read_region(weights, t, item_shape, region)
        want = whole[tuple(slice(a, b) for a, b in region)]
        if got is None:  # all storage or vocab padding
            assert not want.any()
        else:
            np.testing.assert_array_equal(got, want)
        assert weights.elements_read <= tensors[name].size


def test_a_shard_of_rows_reads_exactly_its_rows(hf_dir):
    # FSDP shards the leading dimension: the block read is the shard, nothing more
    root, tensors = hf_dir
    shape, source, item_shape = CASES["linear_out_split"]
    weights = hf_import.SafetensorsDir(root)
    region = [(1, 3), (0, 3), (0, 5)]  # in rows 1..2, every output
    hf_import.read_region(weights, hf_layout.HFTensor("linear_out_split", shape, source),
                          item_shape, region)
    assert weights.elements_read == 2 * 15


@pytest.mark.slow
def test_two_processes_import_bitwise_like_one(exported_fp32, tmp_path):  # noqa: F811
    sets = [a for item in TRAIN for a in ("--set", item)]
    single = tmp_path / "single"
    done = cli("import", str(exported_fp32), "--config", config_path("tiny-cpu.yaml"), *sets,
               "--out", str(single))
    assert done.returncode == 0, done.stderr[-3000:]
    whole = json.loads(done.stdout.splitlines()[-1])

    two = tmp_path / "two"
    env = process_env()
    env.update(EUROPA_LOG_DIR=str(tmp_path / "logs"), PYTHONPATH=REPO,
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    done = subprocess.run([os.path.join(REPO, "launch", "local.sh"), "2", "import",
                           str(exported_fp32), "--config", config_path("tiny-cpu.yaml"), *sets,
                           "--out", str(two)], env=env, capture_output=True, text=True,
                          timeout=900)
    logs = [(tmp_path / "logs" / f"rank-{i}.log").read_text() for i in range(2)]
    assert done.returncode == 0, done.stderr[-2000:] + logs[1][-2000:]
    ranks = [json.loads(log.splitlines()[-1]) for log in logs]
    assert [r["process"] for r in ranks] == [0, 1] and ranks[0]["processes"] == 2
    for r in ranks:  # each read its half of the sharded tensors, not the model
        assert r["hf_elements_read_by_this_process"] < whole["hf_elements_read_by_this_process"]

    a, b = saved_state(single), saved_state(two)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    assert not list(tmp_path.glob(".two.*"))  # the temporary directory was committed
