"""Extension points by config, from files outside the package: a reward and an advantage estimator
named `module:attr`, a data filter and a policy loss registered by name in a custom folder. A short
run through the real controller (Ray, FSDP2 trainer actor, engine) trains with all four: the
controller-side ones count their calls, the loss (inside the trainer actor) reports its own metric."""
from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from loongsage.config import ConfigError, load_config
from loongsage.controller.train import train
from loongsage.metrics import read_metrics

USER_MODULE = '''
import torch

CALLS = {"reward": 0, "advantage": 0}


def digit_reward(text, row):
    """Any row: the share of digits in the answer (a signal even from an untrained model)."""
    CALLS["reward"] += 1
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def doubled_grpo(rewards):
    CALLS["advantage"] += 1
    mean = rewards.mean(dim=1, keepdim=True)
    return 2.0 * (rewards - mean)
'''

CUSTOM_MODULE = '''
from loongsage.algo.losses import policy_loss
from loongsage.extensions import register

KEPT = {"seen": 0, "dropped": 0}


@register("filter", "drop_every_third")
def drop_every_third(group):
    KEPT["seen"] += 1
    if KEPT["seen"] % 3 == 0:
        KEPT["dropped"] += 1
        return False
    return True


@register("policy_loss", "ppo_with_marker")
def ppo_with_marker(inputs, cfg, denominator):
    loss, metrics = policy_loss(inputs, cfg, denominator)
    metrics["custom/loss_marker"] = 1.0
    return loss, metrics
'''


@pytest.fixture
def extension_dirs(tmp_path, monkeypatch):
    ext, custom = tmp_path / "ext", tmp_path / "custom"
    ext.mkdir()
    custom.mkdir()
    (ext / "user_ext.py").write_text(textwrap.dedent(USER_MODULE))
    (custom / "my_custom.py").write_text(textwrap.dedent(CUSTOM_MODULE))
    monkeypatch.syspath_prepend(str(ext))
    yield ext, custom
    for name in ("user_ext", "my_custom"):
        sys.modules.pop(name, None)


def test_a_misnamed_extension_is_a_config_error(extension_dirs):
    _, custom = extension_dirs
    with pytest.raises(ConfigError, match="rollout.filters.0: unknown filter 'drop_every_4th'; expected one of "
                                          "drop_every_third or 'module:attr'"):
        load_config(None, [f"custom_dirs=[{custom}]", "rollout.filters=[drop_every_4th]"])
    with pytest.raises(ConfigError, match="task.reward: 'user_ext:doubled_grpo' cannot be called with 2"):
        load_config(None, ["task.reward=user_ext:doubled_grpo"])


@pytest.mark.slow
def test_a_run_trains_with_a_users_reward_filter_advantage_and_loss(ray_session, tmp_path, extension_dirs):
    _, custom = extension_dirs
    cfg = load_config("recipes/arith_grpo.yaml", [
        f"run_dir={tmp_path / 'run'}", f"custom_dirs=[{custom}]", f"model.cache_dir={tmp_path / 'models'}",
        f"task.data_dir={tmp_path / 'data'}", "bootstrap.enabled=false", "task.train_size=200", "task.eval_size=16",
        "task.reward=user_ext:digit_reward", "algo.advantage=user_ext:doubled_grpo",
        "algo.loss.policy_loss=ppo_with_marker", "rollout.filters=[drop_every_third]",
        "rollout.prompts_per_step=8", "sampling.n=4", "sampling.max_new_tokens=4", "rollout.engine_threads=1",
        "trainer.threads=1", "train.steps=3", "train.eval_every=3", "train.max_minutes=null"])
    asyncio.run(train(cfg))
    import my_custom
    import user_ext

    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(steps) == 3
    assert user_ext.CALLS["reward"] >= 3 * 8 * 4  # every sample scored by the user's reward
    assert user_ext.CALLS["advantage"] >= 1
    assert my_custom.KEPT["dropped"] >= 1 and sum(r["samples/filtered_groups"] for r in steps) >= 1
    trained = [r for r in steps if r["samples/trained"]]
    assert trained and all(r["custom/loss_marker"] == 1.0 for r in trained)  # the loss ran in the trainer actor
