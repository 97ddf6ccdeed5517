"""One tiny run, trained for three steps by what `europa-jax train` runs, in this process, and
read back by every command that takes a run directory: the fast tier's eval, sample and
report tests.

The slow tier checks the same paths against outside references on longer runs (lm-eval's
Hugging Face backend and transformers on the export: tests/test_downstream_eval.py,
tests/test_sample.py); here they are checked against each other, which needs no export and
no trained model: the scores the loop logged at its last step are those `eval` computes
from the checkpoint it saved, and the cached decoder's greedy tokens are those of the whole
row recomputed per token.
"""

import contextlib
import io
import json
import os

# before `datasets` is first imported (it reads this once): the tasks are local files
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402

from europa_jax import cli  # noqa: E402
from europa_jax.config_loader import load_config  # noqa: E402
from conftest import config_path  # noqa: E402

TASKS = ["europa_tiny_choice", "europa_tiny_gen"]
SCORES = {"eval/europa_tiny_choice/acc", "eval/europa_tiny_choice/acc_norm",
          "eval/europa_tiny_gen/exact_match"}
STEPS = 3
# conftest.tiny_cfg's widths, as the CLI's --set; the shipped tasks scored at the last step
RUN = ["model.d_model=32", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
       "model.dense_ffn_dim=64", "model.expert_ffn_dim=16", "execution.attention_block_size=16",
       "execution.remat=none", "data.seq_len=64", "data.global_batch_size=8",
       "data.max_documents=40", "data.validation_fraction=0.1", f"train.eval_every={STEPS}",
       f"train.steps={STEPS}", "train.log_every=1", f"train.eval_tasks=[{','.join(TASKS)}]",
       f"train.eval_tasks_every={STEPS}", "train.eval_tasks_limit=3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, stdout, stderr) of what `europa-jax train` runs (cli.run_training),
    in this process."""
    run = tmp_path_factory.mktemp("tiny-run") / "run"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.run_training(load_config(config_path("tiny-cpu.yaml"), RUN), str(run))
    assert code == 0, err.getvalue()[-3000:]
    return run, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run_dir(trained):
    return trained[0]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line]


def test_the_scores_logged_in_training_are_those_eval_gives_on_its_checkpoint(run_dir):
    from europa_jax.eval import command

    (logged,) = [r for r in records(run_dir) if any(k.startswith("eval/") for k in r)]
    assert logged["step"] == STEPS and SCORES <= set(logged)
    result = command.evaluate_checkpoint(run_dir, TASKS, limit=3)
    assert result["step"] == STEPS and result["documents"] == {task: 3 for task in TASKS}
    # the live train state the loop scored is the one its last checkpoint holds
    assert result["scores"] == {k: logged[k] for k in SCORES}
    assert all(0 <= v <= 1 for v in result["scores"].values())


def test_the_cached_decoder_picks_the_tokens_of_the_whole_row_recomputed(run_dir):
    from europa_jax.interop.sample import Sampler

    sampler = Sampler(run_dir)
    cached = sampler.generate("def main(", max_new_tokens=6)
    recomputed = sampler.generate("def main(", max_new_tokens=6, cached=False)
    assert sampler.step == STEPS and cached.prompt_ids == list(b"def main(")
    assert cached.ids == recomputed.ids and cached.text == recomputed.text
    assert len(cached.ids) == 6 or cached.stop == "eos"
    drawn = [sampler.generate([10, 100], max_new_tokens=4, temperature=1.0, seed=seed, cached=c)
             for seed in (0, 1) for c in (True, False)]
    assert drawn[0].ids == drawn[1].ids and drawn[2].ids == drawn[3].ids  # one draw per seed


def test_the_report_gives_the_runs_last_loss_and_its_task_scores(run_dir, tmp_path):
    from europa_jax.records.report import write_report

    summary = write_report(run_dir, tmp_path / "report")
    last = [r for r in records(run_dir) if "loss" in r][-1]
    assert last["step"] == STEPS and summary["eval_tasks_step"] == STEPS
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert f"downstream tasks (step {STEPS}): europa_tiny_choice/acc " in text
    assert f"last loss: {last['loss']:.4g} (step {STEPS})" in text
    assert "eval_tasks.png" in summary["plots"]


def test_the_run_ends_with_its_validation_loss_and_the_commands_that_read_it(trained):
    run_dir, out, err = trained
    summary = json.loads(out.splitlines()[-1])
    (validation,) = [r for r in records(run_dir) if "val_loss" in r]
    assert summary["run_dir"] == str(run_dir) and summary["steps"] == STEPS
    assert summary["val_loss"] == validation["val_loss"] and summary["val_step"] == STEPS
    assert err.splitlines()[-1] == (
        f"europa-jax: trained to step {STEPS}, validation loss {validation['val_loss']:.4g} at "
        f"step {STEPS}, in {run_dir}; next: europa-jax report {run_dir} | europa-jax sample "
        f"{run_dir} --prompt TEXT | europa-jax export {run_dir} --out DIR")
