"""Off-policy safeguards (algo/offpolicy.py), each against numbers worked by hand, and each reached
from the config through the policy loss."""
from __future__ import annotations

import math

import pytest
import torch

from loongsage.algo import advantages as A
from loongsage.algo import offpolicy as O
from loongsage.algo.config import LossConfig
from loongsage.algo.losses import PolicyInputs, policy_loss
from loongsage.config import ConfigError, load_config


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    # ratio 5 on a bad token (A = -1): PPO's loss max(5, 1.2) = 5 is capped at c = 3; A > 0 is untouched
    loss = t([[5.0, 5.0, 0.5]])
    adv = t([[-1.0, 1.0, -1.0]])
    out, frac = O.dual_clip(loss, adv, 3.0, t([[1.0, 1.0, 1.0]]))
    assert out.tolist() == [[3.0, 5.0, 0.5]] and frac == pytest.approx(1 / 3)


def test_sequence_ratio_is_the_geometric_mean_with_the_sequence_gradient():
    lp = t([[-1.0, -2.0, -5.0]]).requires_grad_(True)
    prox = t([[-1.5, -1.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    r = O.sequence_ratio(lp, prox, mask)
    s = math.exp(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)  # exp(mean log-ratio over the two masked tokens)
    assert r[0, :2].tolist() == pytest.approx([s, s])
    (r * mask).sum().div(2).backward()  # seq_mean_token_mean of the ratio: d/d lp_t = s / 2
    assert lp.grad[0, :2].tolist() == pytest.approx([s / 2, s / 2]) and lp.grad[0, 2] == 0


def test_geometric_mean_sequence_is_masks_outside_both_bounds():
    prox = t([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    beh = t([[-2.0, 0.0], [0.0, 0.0], [1.0, 1.0]])  # weights e^1, 1, e^-1
    w, keep, frac = O.geometric_mean_weights(prox, beh, t([[1.0, 1.0]] * 3), 0.5, 2.0)
    assert w.squeeze(1).tolist() == pytest.approx([math.e, 1.0, math.exp(-1)])
    assert keep.squeeze(1).tolist() == [False, True, False] and frac == pytest.approx(2 / 3)


def test_m2po_masks_the_fewest_largest_squared_log_ratios():
    # squared log-ratios 4, 1, 0.01, 0 (mean 1.2525): dropping 4 leaves mean 0.337 <= 0.5
    prox = t([[2.0, 1.0, 0.1, 0.0]])
    beh = t([[0.0, 0.0, 0.0, 0.0]])
    keep, frac = O.m2po_keep(prox, beh, t([[1.0] * 4]), 0.5)
    assert keep.tolist() == [[False, True, True, True]] and frac == 0.25
    keep, frac = O.m2po_keep(prox, beh, t([[1.0] * 4]), 0.1)  # 1 must go as well: mean 0.005
    assert keep.tolist() == [[False, False, True, True]] and frac == 0.5
    keep, _ = O.m2po_keep(prox, beh, t([[1.0] * 4]), 2.0)  # already under: nothing masked
    assert keep.all()


def test_opsm_drops_only_negative_advantage_sequences_that_drifted():
    prox = t([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    beh = t([[0.4, 0.2], [0.4, 0.2], [0.01, 0.01]])  # per-token KL 0.3, 0.3, 0.01
    adv = t([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    keep, frac = O.opsm_keep(prox, beh, t([[1.0, 1.0]] * 3), adv, 0.1)
    assert keep.squeeze(1).tolist() == [False, True, True] and frac == pytest.approx(1 / 3)


def test_lag_mask_and_advantage_normalisations():
    keep, frac = O.lag_keep(t([[0.0, 1.0, 3.0]]), t([[1.0, 1.0, 1.0]]), 1)
    assert keep.tolist() == [[True, True, False]] and frac == pytest.approx(1 / 3)
    r = t([[1.0, 0.0], [1.0, 1.0]])
    assert A.compute("batch_mean", r).tolist() == [[0.25, -0.75], [0.25, 0.25]]
    assert A.compute("batch_zscore", r).mean().item() == pytest.approx(0.0)
    assert A.compute("group_mean", r).tolist() == [[0.5, -0.5], [0.0, 0.0]]
    assert A.compute("none", r).tolist() == r.tolist()


def _inputs(adv, prox, beh, lag=None):
    lp = t(prox).clone().requires_grad_(True)
    return PolicyInputs(lp, t(prox), t(beh), t(adv), t([[1.0] * len(adv[0])] * len(adv)), version_lag=lag)


def test_each_safeguard_acts_through_the_policy_loss_when_configured():
    x = _inputs([[1.0, -1.0, 1.0]], [[0.0, 0.0, 0.0]], [[0.0, -3.0, 0.0]], t([[0.0, 0.0, 2.0]]))
    base, m = policy_loss(x, LossConfig(is_mode="none"))
    assert "offpolicy/m2po_mask_frac" not in m
    _, m = policy_loss(x, LossConfig(is_mode="none", m2po_threshold=1.0))
    assert m["offpolicy/m2po_mask_frac"] == pytest.approx(1 / 3)
    _, m = policy_loss(x, LossConfig(is_mode="none", opsm_delta=0.5))
    assert m["offpolicy/opsm_drop_frac"] == 0.0  # one sequence, mean advantage > 0: kept
    masked, m = policy_loss(x, LossConfig(is_mode="none", max_version_lag=1))
    assert m["offpolicy/lag_mask_frac"] == pytest.approx(1 / 3)
    assert float(masked.detach()) == pytest.approx(float(base.detach()) + 1 / 3)  # the third token's -A r / 3 is gone
    gone, m = policy_loss(x, LossConfig(is_mode="geo_mis", is_low=0.5, is_cap=2.0))
    assert m["is/geo_mask_frac"] == 1.0 and float(gone.detach()) == 0.0  # weight exp((0 + 3 + 0) / 3) = e > 2: masked
    _, m = policy_loss(x, LossConfig(is_mode="none", dual_clip=3.0))
    assert m["loss/dual_clip_frac"] == 0.0  # ratios are 1 at the proximal policy


def test_gspo_needs_its_aggregation():
    with pytest.raises(ConfigError, match="ratio_level=sequence .GSPO. needs aggregation=seq_mean_token_mean"):
        load_config(None, ["algo.loss.ratio_level=sequence"])
    load_config(None, ["algo.loss.ratio_level=sequence", "algo.loss.aggregation=seq_mean_token_mean"])
