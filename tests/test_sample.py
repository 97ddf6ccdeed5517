"""`europa-jax sample`: greedy decoding with our model equals transformers' greedy `generate`
on the exported model, and the latent-cached decode what the whole-row forward generates;
temperature sampling is seeded; bad input is one line, exit 2."""

import argparse
import json

import numpy as np
import pytest
import torch
import transformers

from europa_jax.data.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE
from europa_jax.interop.export import export
from europa_jax.interop.sample import run, sample, SampleError, Sampler
from europa_jax.job import exit_codes
from test_export_tokenizer import byte_level_run, huggingface_run

PROMPT = "def main():\n    "
NEW = 24
# Prompts of PROMPT's 16 bytes: the cached decoder compiles one program per prompt length
# and cache size (prompt + NEW), so these share PROMPT's two programs (compiled once for
# the module) instead of compiling two more per length.
GREEDY_PROMPTS = (PROMPT, "import os\nimport", "    return self.", "    if x is None")
SHORT = 8  # a second, shorter length (PROMPT + SHORT: one more pair of programs)


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    return byte_level_run(tmp_path_factory)


@pytest.fixture(scope="module")
def sampler(byte_run):
    return Sampler(byte_run)


def args(run, **kw):
    """The Namespace the CLI's `sample` subcommand gives `run` (kw: changed fields)."""
    base = dict(run_dir=str(run), prompt=PROMPT, max_new_tokens=NEW, temperature=0.0, seed=0,
                step=None, json=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.slow
def test_greedy_equals_transformers_generate_on_the_fp32_export(byte_run, sampler, tmp_path):
    out = tmp_path / "hf"
    export(byte_run, out, dtype="fp32")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    seen = set()
    for text in GREEDY_PROMPTS:
        ours = sampler.generate(text, max_new_tokens=NEW)
        assert ours.prompt_ids == list(text.encode()) and ours.step == 100
        prompt = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():  # stops at generation_config's EOS (256), as we do
            theirs = model.generate(prompt, max_new_tokens=NEW, do_sample=False)[
                0, prompt.shape[1]:].tolist()
        assert ours.ids == theirs, text
        assert len(ours.ids) == NEW or ours.ids[-1] == BYTE_EOS_ID
        assert ours.stop == ("eos" if ours.ids[-1] == BYTE_EOS_ID else "max_new_tokens")
        assert ours.text == tok.decode(theirs, skip_special_tokens=True)
        seen.update(ours.ids)
    assert len(seen) >= 3  # continuations that depend on the prompt, not one repeated id
    # the one-call form loads the same checkpoint and decodes the same way
    assert sample(byte_run, PROMPT, max_new_tokens=NEW).ids == sampler.generate(
        PROMPT, max_new_tokens=NEW).ids


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cached_decode_generates_what_the_whole_row_forward_generates(sampler, temperature):
    for text in (PROMPT, "x"):
        cached = sampler.generate(text, max_new_tokens=NEW, temperature=temperature, seed=4)
        reference = sampler.generate(text, max_new_tokens=NEW, temperature=temperature,
                                     seed=4, cached=False)
        assert cached == reference


@pytest.mark.slow
def test_temperature_sampling_is_seeded_and_valid(sampler):
    first = sampler.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=1)
    same = sampler.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=1)
    other = sampler.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=2)
    assert first.ids == same.ids and first.text == same.text
    assert first.ids != other.ids
    for s in (first, other):
        assert all(0 <= i < BYTE_VOCAB_SIZE for i in s.ids)
        assert BYTE_EOS_ID not in s.ids[:-1]  # generation stops at EOS
    # a very low temperature is greedy
    cold = sampler.generate(PROMPT, max_new_tokens=SHORT, temperature=1e-6, seed=3)
    assert cold.ids == sampler.generate(PROMPT, max_new_tokens=SHORT).ids


@pytest.mark.slow
def test_run_prints_the_text_or_with_json_one_json_line_alone(byte_run, capsys):
    assert run(args(byte_run, json=True, max_new_tokens=SHORT)) == exit_codes.OK
    record = json.loads(capsys.readouterr().out)  # stdout is the JSON and nothing else
    assert record["prompt_ids"] == list(PROMPT.encode()) and len(record["ids"]) <= SHORT
    assert record["step"] == 100 and record["stop"] in ("eos", "max_new_tokens")
    assert run(args(byte_run, max_new_tokens=SHORT)) == exit_codes.OK
    assert capsys.readouterr().out == record["text"] + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (dict(run_dir="/nonexistent/run"), "no such run directory"),
    (dict(prompt=""), "--prompt: empty"),
    (dict(max_new_tokens=5000), "> model.max_position_embeddings 4096"),
    (dict(max_new_tokens=0), "--max-new-tokens: 0 must be >= 1"),
    (dict(temperature=-1.0), "--temperature: -1.0 must be >= 0"),
    (dict(step=7), "--step 7: not a checkpoint"),
])
def test_bad_input_is_one_line_and_exit_2(byte_run, capsys, change, message):
    assert run(args(byte_run, **change)) == exit_codes.BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("europa-jax: error: ") and message in err
    assert err.strip().count("\n") == 0


def test_a_run_without_checkpoints_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SampleError, match="no checkpoint to sample from"):
        sample(tmp_path, PROMPT)


@pytest.mark.slow
def test_sampling_a_tokenizer_json_run_uses_its_tokenizer(tmp_path_factory):
    run_dir, tok_path, _ = huggingface_run(tmp_path_factory)
    s = Sampler(run_dir)
    result = s.generate("import os\n", max_new_tokens=8, temperature=1.0, seed=0)
    assert result.prompt_ids == s.tokenizer.encode("import os\n")
    assert len(result.prompt_ids) < len("import os\n")  # merges, not bytes
    assert all(0 <= i < 320 for i in result.ids)
    eos = s.run_tokenizer.eos_id
    assert result.text == s.tokenizer.decode([i for i in result.ids if i != eos])
    assert np.isscalar(eos) and eos == 1
