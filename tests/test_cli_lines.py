"""What the command line says to someone trying it for the first time: its version, the
fix for `--set KEY VALUE`, the configs beside a missing one, the plan's device count taken
from the mesh. Each in the test process (cli.main), one line on stderr, exit 2."""

import pytest

from europa_jax import cli
from conftest import config_path


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_version_names_the_installed_package(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"europa-jax {metadata.version('europa-jax')}"


@pytest.mark.parametrize("args, fix", [
    (["--set", "optim.learning_rate", "0.1"], "e.g. --set optim.learning_rate=0.1"),
    (["--set", "train.steps"], "e.g. --set train.steps=VALUE"),
    (["--set", "train.steps", "--quiet"], "e.g. --set train.steps=VALUE")])
def test_set_without_an_equals_sign_is_one_line_with_the_fix(capsys, args, fix):
    code = cli.main(["train", config_path("tiny-cpu.yaml"), *args])
    (line,) = error_lines(capsys)
    assert code == 2 and line.startswith("europa-jax: error: --set ") and line.endswith(fix)


def test_a_missing_config_lists_the_configs_beside_it(capsys):
    code = cli.main(["count", config_path("tiny_cpu.yaml")])
    (line,) = error_lines(capsys)
    assert code == 2 and "tiny_cpu.yaml: config file not found; the configs in " in line
    assert "tiny-cpu.yaml" in line and "europa-952b.yaml" in line


def test_the_plan_takes_its_device_count_from_the_mesh(capsys):
    # no --devices: tiny-cpu's 2×4 mesh is 8 devices; the GPU target's own refusal follows
    code = cli.main(["plan", config_path("tiny-cpu.yaml"), "--probe-moe-layers", "4,6"])
    (line,) = error_lines(capsys)
    assert code == 2 and "only for --target cpu" in line
    code = cli.main(["plan", config_path("europa-952b.yaml"), "--devices", "8"])
    assert code == 2 and "--devices 8 does not match mesh data×expert = 96×4 = 384" in \
        error_lines(capsys)[-1]


def test_help_names_each_argument_and_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    assert "decoded through the attention's latent cache" not in text  # the command list's
    assert "run_dir the run's directory" in text
    assert "(or at the end-of-text token) (default: 64)" in text
    assert "(with --temperature above 0) (default: 0)" in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    commands = " ".join(capsys.readouterr().out.split())
    assert "decoded through the attention's latent cache" in commands
    assert "no KV cache" not in commands
