"""Config loading (YAML + dotted overrides) and the CLI: clear one-line errors, --help everywhere."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from loongsage.cli import build_parser, main
from loongsage.config import ConfigError, RunConfig, dump_config, load_config


def test_yaml_plus_overrides_are_typed_and_nested(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: x\nengine: {max_running: 8}\nsampling: {temperature: 0.7}\n")
    cfg = load_config(f, ["engine.max_running=4", "sampling.n=8", "task.params.digits=4", "model.tiny.arch=llama"])
    assert cfg.engine.max_running == 4 and cfg.sampling.n == 8 and cfg.sampling.temperature == 0.7
    assert cfg.task.params == {"digits": 4} and cfg.model.tiny.arch == "llama" and cfg.name == "x"
    out = dump_config(cfg, tmp_path / "run" / "config.yaml")
    assert RunConfig.model_validate(yaml.safe_load(out.read_text())) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["engine.prot=3"], "engine.prot: unknown key; expected one of: dtype, device, max_running"),
    (["engine.max_running=0"], "engine.max_running: Input should be greater than or equal to 1 (got 0)"),
    (["sampling.max_new_tokens=abc"], "sampling.max_new_tokens: Input should be a valid integer"),
    (["sampling.n=4", "sampling.temperature=0"], "sampling: n > 1 with temperature 0"),
    (["task.name=chess"], "task.name: unknown task"),
    (["model.tiny.num_heads=3"], "model.tiny: hidden_size 128 must be divisible by num_heads 3"),
    (["engine=3"], "engine: Input should be a valid dictionary"),
    (["engine.max_running=4", "engine.max_running.x=1"], "engine.max_running: is a value, not a section"),
    (["engine.context_length.x=1"], "engine.context_length: Input should be a valid integer"),
    (["noequals"], "expected key=value"),
    (["sampling.max_new_tokens=600"], "must be below the context length"),
    (["task.train_path=a.jsonl"], "train_path and eval_path must be given together"),
    (["agent.kind=blackbox"], "agent: agent.kind=blackbox needs agent.command"),
    (["agent.kind=robot"], "agent.kind: unknown rollout 'robot'; expected one of single_turn, whitebox, blackbox "
                           "or 'module:attr'"),
    (["algo.advantage=nope_pkg:missing"], "algo.advantage: 'nope_pkg:missing': cannot import 'nope_pkg' "
                                          "(ModuleNotFoundError"),
    (["algo.advantage=math:nope"], "algo.advantage: 'math:nope': module 'math' has no attribute 'nope'"),
    (["algo.loss.policy_loss=math:sqrt"], "algo.loss.policy_loss: 'math:sqrt' cannot be called with 3 positional"),
    (["rollout.window=fifo"], "rollout.window: unknown window 'fifo'; expected one of staleness, windowed_fifo"),
    (["custom_dirs=[/nonexistent-dir]", "task.reward=nowhere:reward"], "task.reward: 'nowhere:reward': cannot import"),
    (["agent.kind=blackbox", "agent.command=[node, agent.js]", "agent.preload=[openai]"],
     "agent.preload needs agent.command = ['{python}', 'script.py', ...]"),
    (["agent.limits.max_turns=0"], "agent.limits.max_turns: Input should be greater than or equal to 1"),
    (["sampling.top_p=0.9"], "sampling: top_p=0.9, top_k=-1: the trainer scores each token"),
    (["sampling.top_k=20"], "refused for training; set top_p: 1.0 and top_k: -1"),
    (["data_sources=[{name: a, task: {name: arithmetic}, sampling: {temperature: 0.7}, prompts_per_step: 2, "
      "teachers: {t: 1.0}}]", "teachers=[{name: t, model: /m}]", "algo.loss.distill.gkd_coef=1.0"],
     "distillation with a sampling temperature other than 1 is not supported"),
])
def test_config_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_cli_reports_config_errors_on_stderr_with_exit_2(capsys):
    assert main(["demo", "engine.bogus=1"]) == 2
    assert "config error: engine.bogus: unknown key" in capsys.readouterr().err


def test_help_everywhere():
    parser = build_parser()
    for cmd in ["engine", "demo", "make-model", "data", "serve"]:
        with pytest.raises(SystemExit) as info:
            parser.parse_args([cmd, "--help"])
        assert info.value.code == 0
    out = subprocess.run([sys.executable, "-m", "loongsage.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "engine" in out.stdout and "demo" in out.stdout


def test_make_model_and_data_commands(tmp_path, capsys):
    assert main(["make-model", str(tmp_path / "m"), "arch=llama", "num_layers=1"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert main(["make-model", str(tmp_path / "m2"), "num_heads=5"]) == 2
    assert "config error: model: hidden_size 128 must be divisible by num_heads 5" in capsys.readouterr().err
    assert main(["data", "reverse", f"data_dir={tmp_path / 'd'}", "train_size=20", "eval_size=5"]) == 0
    assert "20 train rows, 5 eval rows" in capsys.readouterr().out



def test_sglang_engines_hold_no_request_across_a_weight_update():
    """SGLang labels a response with one version: a run with SGLang engines aborts requests at an
    update (they continue from their tokens), so no token is passed off as fresher than it is."""
    assert load_config("recipes/arith_grpo.yaml").rollout.pause_mode == "in_place"
    assert load_config("recipes/arith_grpo.yaml", ["rollout.engine=sglang"]).rollout.pause_mode == "abort"
    with pytest.raises(ConfigError, match="pause_mode=in_place with engine=sglang.*pause_mode=abort"):
        load_config("recipes/arith_grpo.yaml", ["rollout.engine=sglang", "rollout.pause_mode=in_place"])
