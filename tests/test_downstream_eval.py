"""Downstream evaluation (europa_jax/eval/): lm-eval's own Hugging Face backend on the
exported model gives the same log-likelihoods (within 1e-4), the same greedy generations
and the same task scores as our model on the run's mesh; `train.eval_tasks` logs the
scores during training and `report` draws them; local task directories load from any
working directory with no internet; bad input is one line, exit 2."""

import argparse
import json
import math
import os
import re
import sys

# before `datasets` is first imported (it reads this once): the tasks are local files
os.environ["HF_DATASETS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from europa_jax.config import ConfigError  # noqa: E402
from europa_jax.config_loader import load_config  # noqa: E402
from europa_jax.eval import command, harness, packing  # noqa: E402
from europa_jax.eval.task_files import absolute_paths, load_tasks, TaskError  # noqa: E402
from europa_jax.job import exit_codes  # noqa: E402
from europa_jax.job.watchdog import HangWatchdog  # noqa: E402
from conftest import config_path  # noqa: E402
from test_export_tokenizer import cli, TINY, train_run  # noqa: E402

TASKS = ["europa_tiny_choice", "europa_tiny_gen"]
SEQ_LEN = 64  # TINY's rows: our LM's max_length, given to lm-eval's HF backend too
# enough steps that greedy continuations differ by prompt (test_export_tokenizer.BYTE_RUN);
# with the rest of DeepSeek-V3's objective on (an MTP module, the sequence-wise balance
# loss), which evaluation and the export's transformers model leave aside
RUN = TINY + ["train.steps=100", "optim.warmup_steps=5", "optim.learning_rate=0.01",
              "train.log_every=20", f"train.eval_tasks=[{','.join(TASKS)}]",
              "train.eval_tasks_every=50", "model.mtp_layers=1",
              "model.seq_aux_loss_weight=0.001"]
SCORES = {"eval/europa_tiny_choice/acc", "eval/europa_tiny_choice/acc_norm",
          "eval/europa_tiny_gen/exact_match"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Trained 100 steps with the shipped tasks scored at steps 50 and 100."""
    run = tmp_path_factory.mktemp("downstream") / "run"
    train_run(run, RUN)
    return run


@pytest.fixture(scope="module")
def hflm(run_dir, tmp_path_factory):
    """lm-eval's Hugging Face backend on the float32 export (transformers' DeepseekV3)."""
    from lm_eval.models.huggingface import HFLM

    from europa_jax.interop.export import export

    out = tmp_path_factory.mktemp("downstream-hf") / "hf"
    export(run_dir, out, dtype="fp32")
    return HFLM(pretrained=str(out), dtype="float32", device="cpu", max_length=SEQ_LEN,
                batch_size=1)


@pytest.fixture(scope="module")
def ours(run_dir):
    """Our LM on the final checkpoint, on the run's 2×4 mesh."""
    from europa_jax.eval.forward import EvalForward
    from europa_jax.eval.lm import EuropaLM
    from europa_jax.eval.weights import read_weights
    from europa_jax.interop.hf_tokenizer_files import run_tokenizer
    from europa_jax.parallel import sharding
    from europa_jax.train.train import build_trainer

    step_dir, meta, cfg = command.checkpoint_config(run_dir, None, [])
    trainer = build_trainer(cfg, sharding.make_mesh(cfg.mesh))
    params, router_bias_LE = read_weights(step_dir, trainer, meta)
    tok, _ = run_tokenizer(cfg)
    return EuropaLM(EvalForward(trainer, tok.vocab_size).use(params, router_bias_LE), tok)


@pytest.fixture(scope="module")
def cli_result(run_dir, tmp_path_factory):
    """`europa-jax eval RUN --tasks ... --output FILE`: (its JSON, the file's, stderr)."""
    out = tmp_path_factory.mktemp("downstream-cli") / "scores.json"
    result = cli("eval", str(run_dir), "--tasks", ",".join(TASKS), "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), json.loads(out.read_text()), result.stderr


def instances(kind, arguments):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


def task_instances(kind):
    """What lm-eval asks of a model for the shipped tasks' documents."""
    found = []
    for task in load_tasks(TASKS).task_dict["tasks"].values():
        task.build_all_requests(limit=None, rank=0, world_size=1)
        found += [i for i in task.instances if i.request_type == kind]
    assert found
    return found


def greedy_request(hflm):
    """A (context, continuation) whose one token is the HF model's greedy choice."""
    import torch

    for context in ("def main():\n    ", "import os\nimport sys\n", "    return self."):
        with torch.no_grad():
            logits = hflm.model(torch.tensor([hflm.tok_encode(context)])).logits[0, -1]
        token = int(logits.argmax())
        if 32 <= token < 127:
            return context, chr(token)
    pytest.skip("no printable greedy byte after the probe contexts")


@pytest.mark.slow
def test_loglikelihoods_equal_lm_eval_hf_backend_request_by_request(ours, hflm):
    extra = [("def f(x):\n    ", "return x"),  # trailing spaces go to the continuation
             ("", "import os\n"),  # no context: the prefix token (EOS, no BOS)
             ("x = 1\n" * 20, "pass"),  # longer than a row: cut from the left
             ("s = '", "café — naïve'"),  # multi-byte UTF-8
             greedy_request(hflm)]
    requests = task_instances("loglikelihood") + instances("loglikelihood", extra)
    theirs = hflm.loglikelihood(requests, disable_tqdm=True)
    before = ours.forwards
    mine = ours.loglikelihood(requests)
    # packed: many requests to a row, 8 rows a forward
    assert ours.forwards - before <= math.ceil(len(requests) / 8)
    for request, (a, greedy_a), (b, greedy_b) in zip(requests, mine, theirs):
        assert a == pytest.approx(b, abs=1e-4), request.args
        assert greedy_a == greedy_b, request.args
    assert mine[-1][1] and not all(g for _, g in mine)
    assert len({round(a, 3) for a, _ in mine}) > len(mine) // 2  # not one repeated value


@pytest.mark.slow
def test_rolling_loglikelihoods_equal_lm_eval_hf_backend(ours, hflm):
    with open(config_path("tiny-cpu.yaml")) as f:
        long_text = f.read()[:300]  # five rows' worth of rolling windows
    requests = instances("loglikelihood_rolling", [("import os\n",), (long_text,)])
    theirs = hflm.loglikelihood_rolling(requests, disable_tqdm=True)
    mine = ours.loglikelihood_rolling(requests)
    assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-4)
    assert mine[1] < mine[0] < 0


@pytest.mark.slow
def test_greedy_generation_equals_lm_eval_hf_backend(ours, hflm):
    extra = [("def ", {"until": ["("], "max_gen_toks": 10}),
             ("import", {"until": [], "max_gen_toks": 5, "do_sample": False}),
             ("class A:\n", {"until": ["\n\n", "or"], "max_gen_toks": 20})]
    requests = task_instances("generate_until") + instances("generate_until", extra)
    theirs = hflm.generate_until(requests, disable_tqdm=True)
    mine = ours.generate_until(requests)
    assert mine == theirs
    assert len(set(mine)) >= 3  # continuations that depend on the prompt


@pytest.mark.slow
def test_cli_scores_equal_lm_eval_simple_evaluate_on_the_export(cli_result, hflm):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from europa_jax.eval.task_files import SHIPPED_DIR

    printed, written, _ = cli_result
    assert printed == written
    assert written["step"] == 100 and written["tasks"] == TASKS
    assert written["documents"] == {task: 8 for task in TASKS}
    tasks = list(load_tasks(TASKS).task_dict["tasks"].values())
    # The tasks are given built; without a manager simple_evaluate would make its default
    # one, which indexes every built-in lm-eval task's YAML (tens of seconds) to find none.
    local = TaskManager(include_path=[str(SHIPPED_DIR)], include_defaults=False)
    theirs = harness.flat_scores(simple_evaluate(model=hflm, tasks=tasks, bootstrap_iters=0,
                                                 log_samples=False, task_manager=local))
    assert set(written["scores"]) == set(theirs) == SCORES
    for key, value in theirs.items():
        assert written["scores"][key] == pytest.approx(value, abs=1e-9), key


@pytest.mark.slow
def test_training_with_all_of_it_logged_the_scores_and_report_draws_them(run_dir, cli_result):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from europa_jax.records.report import write_report

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")
               if line]
    evaluated = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evaluated] == [50, 100]
    trained = [r for r in records if "loss" in r]
    assert trained and all(r["mtp_loss"] > 0 and r["seq_aux_loss"] > 0 for r in trained)
    assert trained[-1]["mtp_loss"] < trained[0]["mtp_loss"]  # the module learns too
    assert all(SCORES <= set(r) and r["eval_tasks_time_s"] > 0 for r in evaluated)
    # step 100's evaluation scored the live train state the final checkpoint holds
    assert {k: evaluated[-1][k] for k in SCORES} == cli_result[1]["scores"]
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/europa_tiny_choice/acc")] == [50, 100]
    summary = write_report(run_dir)
    assert "eval_tasks.png" in summary["plots"] and summary["eval_tasks_step"] == 100
    text = (run_dir / "report" / "summary.txt").read_text()
    assert "downstream tasks (step 100): europa_tiny_choice/acc " in text
    assert f", MTP loss {trained[-1]['mtp_loss']:.4g}" in text


@pytest.mark.slow
def test_limit_scores_the_first_documents(ours):
    scores, documents = harness.evaluate_tasks(ours, load_tasks(TASKS), limit=3)
    assert documents == {task: 3 for task in TASKS} and set(scores) == SCORES


@pytest.mark.slow
def test_a_task_directory_loads_from_anywhere_and_wins_over_the_shipped(ours, tmp_path,
                                                                        monkeypatch):
    tasks = tmp_path / "my-tasks" / "code"
    (tasks / "data").mkdir(parents=True)
    docs = [{"query": "import os\nimport", "choices": [" sys", " Sys"], "gold": 0},
            {"query": "    return", "choices": [" None", " none"], "gold": 0}]
    (tasks / "data" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name in ("my_choice", "europa_tiny_choice"):  # the second shadows the shipped task
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            "dataset_kwargs: {data_files: {test: data/docs.jsonl}}\ntest_split: test\n"
            "output_type: multiple_choice\ndoc_to_text: '{{query}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\ntarget_delimiter: ''\n"
            "metric_list: [{metric: acc}]\n")
    monkeypatch.chdir(tmp_path)  # relative paths are the YAML's, not the working directory's
    loaded = load_tasks(["my_choice", "europa_tiny_choice"], "my-tasks")
    assert loaded.sources["europa_tiny_choice"] == str(
        (tasks / "europa_tiny_choice.yaml").resolve())
    scores, documents = harness.evaluate_tasks(ours, loaded)
    assert documents == {"my_choice": 2, "europa_tiny_choice": 2}
    assert scores["eval/my_choice/acc"] == scores["eval/europa_tiny_choice/acc"]
    (tasks / "data" / "docs.jsonl").unlink()
    with pytest.raises(TaskError, match=r"^train\.eval_tasks: my_choice \(.*my_choice\.yaml\) "
                                        r"could not be loaded: "):
        load_tasks(["my_choice"], tasks)


@pytest.mark.slow
def test_an_unknown_task_stops_train_before_the_run_directory(tmp_path):
    run = tmp_path / "run"
    result = cli("train", config_path("tiny-cpu.yaml"), "--run-dir", str(run),
                 *[a for item in TINY + ["train.eval_tasks=[europa_tiny_choice,no_such_task]",
                                         "train.eval_tasks_every=5"] for a in ("--set", item)])
    assert result.returncode == exit_codes.BAD_INPUT
    lines = [line for line in result.stderr.splitlines() if line.startswith("europa-jax:")]
    assert len(lines) == 1 and lines[0].startswith(
        "europa-jax: error: train.eval_tasks: 'no_such_task' is not an lm-eval task (local "
        "tasks: europa_tiny_choice, europa_tiny_gen; no train.eval_tasks_dir")
    assert not run.exists()


@pytest.mark.parametrize("sets, message", [
    (["train.eval_tasks=[europa_tiny_choice]"], "train.eval_tasks_every is 0"),
    (["train.eval_tasks_every=5"], "train.eval_tasks is empty"),
    (["train.eval_tasks=[a,a]", "train.eval_tasks_every=5"], "a name repeated"),
    (["train.eval_tasks=['a,b']", "train.eval_tasks_every=5"], "'a,b' is not a task name"),
    (["train.eval_tasks_every=-1"], "train.eval_tasks_every: -1 must be >= 0"),
    (["train.eval_tasks_limit=0"], "train.eval_tasks_limit: 0 must be positive"),
    (["train.eval_tasks_seq_len=96"], "train.eval_tasks_seq_len: 96 is not divisible by "
                                      "execution.attention_block_size=128"),
    (["train.eval_tasks_seq_len=512"], "train.eval_tasks_seq_len: 512 > data.seq_len=256"),
    (["execution.attention_block_size=16", "execution.moe_chunk_tokens=64",
      "train.eval_tasks_seq_len=48"], "train.eval_tasks_seq_len: 48: execution.moe_chunk_tokens=64 "
                                      "does not divide the 96 tokens each device evaluates"),
])
def test_config_errors_name_the_key_and_value(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config_path("tiny-cpu.yaml"), sets)


def eval_args(run, **changes):
    base = dict(run_dir=str(run), tasks=",".join(TASKS), step=None, tasks_dir=None,
                limit=None, output=None, tokenizer=None, set=[])
    return argparse.Namespace(**{**base, **changes})


@pytest.mark.slow
@pytest.mark.parametrize("changes, message", [
    (dict(run_dir="/nonexistent/run"), "/nonexistent/run: no such run directory"),
    (dict(tasks="europa_tiny_choice,,x"), "--tasks 'europa_tiny_choice,,x': expected"),
    (dict(step=7), "--step 7: not a checkpoint of"),
    (dict(limit=0), "--limit 0: must be >= 1"),
    (dict(set=["model.d_model=8"]), "--set model.d_model=8: only the layout may change"),
    (dict(tasks_dir="/nonexistent/tasks"), "--tasks-dir: /nonexistent/tasks: no such directory"),
    (dict(tasks="no_such_task"), "--tasks: 'no_such_task' is not an lm-eval task"),
])
def test_eval_bad_input_is_one_line_and_exit_2(run_dir, capsys, changes, message):
    assert command.run(eval_args(run_dir, **changes)) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("europa-jax: error: ") and message in err, err
    assert err.strip().count("\n") == 0


def test_packing_places_every_request_once_in_its_own_segment():
    rng = np.random.default_rng(0)
    requests = [packing.scoring(list(rng.integers(0, 256, int(c))),
                                list(rng.integers(0, 256, int(n))), 32)
                for c, n in rng.integers(1, 13, (50, 2))]
    requests.append(packing.scoring([1] * 40, [2, 3], 32))  # a whole row
    batches = packing.pack(requests, rows=4, length=32)
    seen, rows = [], set()
    for k, batch in enumerate(batches):
        for i, b, start, stop in batch.spans:
            r = requests[i]
            n = len(r.inputs)
            first = stop - n  # where the request begins
            assert start == stop - r.scored
            rows.add((k, b))
            assert batch.tokens_BS[b, first:stop].tolist() == r.inputs.tolist()
            assert batch.targets_BS[b, first:stop].tolist() == r.targets.tolist()
            assert batch.positions_BS[b, first:stop].tolist() == list(range(n))
            assert len(set(batch.segments_BS[b, first:stop].tolist())) == 1
            seen.append(i)
        # documents of a row have distinct segment ids, in order; padding is 0 at the end
        for row in batch.segments_BS:
            used = row[row > 0]
            assert (np.diff(used) >= 0).all() and (row[len(used):] == 0).all()
    assert sorted(seen) == list(range(len(requests)))
    assert len(rows) < len(requests) / 2  # several requests a row
    # lm-eval's cut: (context + continuation)[-(L + 1):][:-1], the continuation scored
    r = packing.scoring(list(range(50)), [50, 51, 52], 32)
    assert (r.inputs.tolist(), r.targets.tolist(), r.scored) == (
        list(range(20, 52)), list(range(21, 53)), 3)


def test_flat_scores_and_absolute_paths(tmp_path):
    results = {"results": {"t": {"alias": "t", "sample_len": 8, "acc,none": 0.5,
                                 "acc_stderr,none": "N/A", "exact_match,strict": 1,
                                 "flag,none": True}}}
    assert harness.flat_scores(results) == {"eval/t/acc": 0.5, "eval/t/exact_match/strict": 1.0}
    (tmp_path / "d.jsonl").write_text("{}\n")
    cfg = {"dataset_path": "json", "dataset_kwargs": {
        "data_files": {"test": "d.jsonl", "train": ["*.jsonl", "/abs/x.jsonl", "gone.jsonl"]}}}
    fixed = absolute_paths(cfg, tmp_path)["dataset_kwargs"]["data_files"]
    assert fixed == {"test": str(tmp_path / "d.jsonl"),
                     "train": [str(tmp_path / "*.jsonl"), "/abs/x.jsonl", "gone.jsonl"]}


@pytest.mark.slow
def test_a_tokenizer_json_run_encodes_as_the_exported_tokenizer_does(tmp_path):
    """Merges and a BOS: our ids and prefix token are those lm-eval's HF backend gets from
    the export's tokenizer files (TemplateLM's pair splitting is shared code)."""
    import transformers

    from europa_jax.eval.lm import EuropaLM
    from europa_jax.interop.hf_tokenizer_files import RunTokenizer, write_tokenizer_files
    from test_export_tokenizer import build_tokenizer, SPECIALS

    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    build_tokenizer(path, ["def main():\n    return self.value\n", "import os\nimport sys\n"] * 20)
    run_tok = RunTokenizer(kind="huggingface", path=path, vocab_size=320, eos_id=1,
                           eos_token=SPECIALS[1], bos_token=SPECIALS[0], bos_id=0)
    (tmp_path / "export").mkdir()
    write_tokenizer_files(tmp_path / "export", run_tok, SEQ_LEN)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ours = EuropaLM(forward=None, run_tokenizer=run_tok)
    assert ours.prefix_token_id == theirs.bos_token_id == 0 and ours.eot_token_id == 1
    for text in ("def main():\n    return self.value", "  import os", "é<|endoftext|>x", ""):
        assert ours.tok_encode(text) == theirs.encode(text), text
    context, continuation = ours._encode_pair("def main():\n    ", "return self.value")
    assert len(context) < len("def main():\n") and continuation  # merged tokens, split


def test_without_lm_eval_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # as if not installed
    with pytest.raises(ConfigError, match=re.escape(
            "train.eval_tasks: downstream evaluation needs the lm_eval package: "
            "pip install 'europa-jax[eval]'")):
        load_tasks(TASKS)


def test_watchdog_progress_restarts_the_phase_clock():
    now = [0.0]
    dog = HangWatchdog(10, process_index=0, process_count=1, clock=lambda: now[0])
    dog.on_phase("validation", 5)
    now[0] = 8.0
    dog.progress()
    now[0] = 17.0
    assert dog.overdue() is None  # 9 s since the last forward
    now[0] = 19.0
    assert dog.overdue() == pytest.approx(1.0)
