"""A resume says which settings changed since its checkpoint, and what that does to the
learning rate at the step it resumes."""

import json

from europa_jax.config_loader import load_config, to_dict
from europa_jax.store import resume_changes
from conftest import config_path


def saved_with(*overrides):
    """A checkpoint's meta["config"]: the config as JSON wrote it (tuples as lists)."""
    return json.loads(json.dumps(to_dict(load_config(config_path("tiny-cpu.yaml"),
                                                     list(overrides)))))


def test_nothing_changed_says_nothing():
    cfg = load_config(config_path("tiny-cpu.yaml"), ["train.steps=50"])
    assert resume_changes.describe(saved_with("train.steps=50"), cfg, 50) == []


def test_more_steps_name_the_key_and_the_learning_rate_before_and_after():
    """50 → 80 steps, resumed at 50: the saved schedule had decayed to its floor there;
    the new one is on its plateau (warm-up 20, decay the last 20 %)."""
    cfg = load_config(config_path("tiny-cpu.yaml"), ["train.steps=80"])
    lines = resume_changes.describe(saved_with("train.steps=50"), cfg, 50)
    peak = cfg.optim.learning_rate
    floor = peak * cfg.optim.min_lr_ratio
    assert lines == ["resuming step 50 with train.steps changed since it was saved: 50 → 80",
                     f"resuming step 50: the learning rate there moves from {floor:.3g} to "
                     f"{peak:.3g} (the schedule follows optim.* and train.steps)"]


def test_every_changed_key_is_listed_and_a_rate_unchanged_is_not_mentioned():
    cfg = load_config(config_path("tiny-cpu.yaml"), ["data.global_batch_size=32",
                                                     "train.eval_every=7"])
    lines = resume_changes.describe(saved_with(), cfg, 30)
    assert lines == [
        "resuming step 30 with data.global_batch_size changed since it was saved: 16 → 32",
        "resuming step 30 with train.eval_every changed since it was saved: 50 → 7"]
    assert [k for k, _, _ in resume_changes.changed_keys(saved_with(), cfg)] == [
        "data.global_batch_size", "train.eval_every"]


def test_settings_of_an_older_version_still_list_their_changes():
    saved = saved_with()
    saved["train"]["retired_key"] = 1
    cfg = load_config(config_path("tiny-cpu.yaml"))
    assert resume_changes.describe(saved, cfg, 10) == [
        "resuming step 10 with train.retired_key changed since it was saved: 1 → None"]
