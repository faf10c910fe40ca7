"""Algorithm math against values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from loongsage.algo import advantages as A
from loongsage.algo.config import LossConfig
from loongsage.algo.losses import PolicyInputs, aggregate, kl_penalty, policy_loss, sft_loss


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_grpo_dr_grpo_rloo_by_hand():
    r = t([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, sample std sqrt(1/3) = 0.57735
    g = A.grpo(r, eps=0.0)
    assert torch.allclose(g[0], t([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    assert torch.allclose(A.grpo(r)[1], t([0.0] * 4))  # equal rewards: no signal, no NaN
    assert torch.allclose(A.dr_grpo(r)[0], t([0.5, -0.5, -0.5, 0.5]))
    # RLOO: r_i - mean(others): 1 - 1/3 = 0.6667, 0 - 2/3 = -0.6667
    assert torch.allclose(A.rloo(r)[0], t([2 / 3, -2 / 3, -2 / 3, 2 / 3]), atol=1e-6)
    assert A.keep_informative_groups(r).tolist() == [True, False]
    with pytest.raises(ValueError, match="'ppo' is neither a registered advantage"):
        A.compute("ppo", r)


def test_aggregation_modes_by_hand():
    v = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = t([[1, 1, 1], [1, 0, 0]])
    assert aggregate(v, m, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, m, "seq_mean_token_sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    # a global denominator makes micro-batches add up to the full-batch loss
    a = aggregate(v[:1], m[:1], "token_mean", denominator=4) + aggregate(v[1:], m[1:], "token_mean", denominator=4)
    assert a.item() == pytest.approx(aggregate(v, m, "token_mean").item())


def test_kl_estimators_by_hand():
    lp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    d = math.log(0.25) - math.log(0.5)  # log(ref/pi) = -log 2
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-d)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(d) - d - 1)


def _inputs(logp, prox, beh, adv, mask=None):
    logp = t(logp).requires_grad_(True)
    return PolicyInputs(logp, t(prox), t(beh), t(adv), t(mask or [[1.0] * len(logp[0])]))


def test_ppo_clip_higher_by_hand():
    # ratios e^{0.5}=1.6487 and e^{-0.5}=0.6065, advantages +1 and -1
    x = _inputs([[0.5, -0.5]], [[0.0, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, is_mode="none")
    loss, m = policy_loss(x, cfg)
    # token 1: max(-1.6487, -1.28) = -1.28 (clipped at 1 + 0.28); token 2: max(0.6065, 0.8) = 0.8
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2, abs=1e-5)
    assert m["loss/clip_frac"] == 1.0
    loss.backward()
    assert torch.allclose(x.logprobs.grad, t([[0.0, 0.0]]))  # both clipped: no gradient


def test_unclipped_gradient_is_minus_advantage_times_ratio():
    x = _inputs([[0.1]], [[0.0]], [[0.0]], [[2.0]])
    loss, _ = policy_loss(x, LossConfig(is_mode="none"))
    loss.backward()
    assert x.logprobs.grad.item() == pytest.approx(-2.0 * math.exp(0.1), rel=1e-5)


def test_decoupled_truncated_and_masked_is_by_hand():
    # proximal - behaviour = log 3 on token 0 (w = 3), log 0.25 on token 1 (w = 0.25); ratio 1
    prox = [[math.log(0.3), math.log(0.1)]]
    beh = [[math.log(0.1), math.log(0.4)]]
    adv = [[1.0, 1.0]]
    tis = LossConfig(is_mode="tis", is_cap=2.0)
    loss, m = policy_loss(_inputs(prox, prox, beh, adv), tis)
    assert loss.item() == pytest.approx(-(2.0 + 0.25) / 2, abs=1e-5)  # w truncated at C = 2
    assert m["is/clip_frac"] == 0.5 and m["is/weight_mean"] == pytest.approx((3 + 0.25) / 2, rel=1e-5)
    mis = LossConfig(is_mode="mis", is_low=0.5, is_cap=2.0)
    loss, m = policy_loss(_inputs(prox, prox, beh, adv), mis)
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and m["is/mask_frac"] == 1.0  # both outside [0.5, 2]
    seq = LossConfig(is_mode="tis", is_level="sequence", is_cap=2.0)
    loss, _ = policy_loss(_inputs(prox, prox, beh, adv), seq)
    assert loss.item() == pytest.approx(-0.75, abs=1e-5)  # sequence w = 3 * 0.25 = 0.75, below C
    only = LossConfig(is_mode="metrics")
    loss, m = policy_loss(_inputs(prox, prox, beh, adv), only)
    assert loss.item() == pytest.approx(-1.0) and "is/weight_mean" in m  # measured, not applied


def test_kl_and_entropy_terms_and_sft():
    x = _inputs([[0.0]], [[0.0]], [[0.0]], [[0.0]])
    x.ref_logprobs = t([[math.log(0.5)]])
    x.entropy = t([[1.5]])
    loss, m = policy_loss(x, LossConfig(is_mode="none", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01))
    assert loss.item() == pytest.approx(0.1 * (0.0 - math.log(0.5)) - 0.01 * 1.5, abs=1e-6)
    assert m["loss/entropy"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(_inputs([[0.0]], [[0.0]], [[0.0]], [[0.0]]), LossConfig(kl_coef=0.1))
    loss, _ = sft_loss(t([[-1.0, -3.0, -9.0]]), t([[1, 1, 0]]))
    assert loss.item() == pytest.approx(2.0)


def test_mis_bounds_are_validated():
    with pytest.raises(ValueError, match="is_low"):
        LossConfig(is_mode="mis", is_low=3.0, is_cap=2.0)


def test_gap_and_drift_split_tokens_by_version_lag():
    """The gap is measured on the trained version's own tokens only; older tokens report drift per lag."""
    from loongsage.algo.mismatch import gap_and_drift

    behavior = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    trainer = torch.tensor([[-1.0, -2.5, -2.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    lag = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    m = gap_and_drift(behavior, trainer, mask, lag)
    assert m["mismatch/tokens"] == 1 and m["mismatch/max_abs_logprob_diff"] == 0.0  # token 0 only
    assert m["offpolicy/tokens"] == 2 and m["offpolicy/kl"] == pytest.approx((0.5 - 1.0) / 2)
    assert m["offpolicy/lag1/kl"] == pytest.approx(0.5) and m["offpolicy/lag2/kl"] == pytest.approx(-1.0)
    assert m["offpolicy/lag1/is_weight_mean"] == pytest.approx(math.exp(-0.5))
    only_old = gap_and_drift(behavior, trainer, mask, torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    assert not any(k.startswith("mismatch/") for k in only_old)  # no gap is claimed without current tokens
    assert set(gap_and_drift(behavior, trainer, mask)) == {"mismatch/kl", "mismatch/abs_logprob_diff",
                                                           "mismatch/max_abs_logprob_diff", "mismatch/tokens"}


def test_metric_sums_weight_a_subset_metric_by_its_own_tokens():
    from loongsage.trainer.step import MetricSums

    sums = MetricSums()
    sums.add({"mismatch/kl": 0.2, "mismatch/tokens": 1.0, "loss/policy": 1.0}, tokens=10)
    sums.add({"mismatch/kl": 0.5, "mismatch/tokens": 3.0, "loss/policy": 2.0}, tokens=10)
    out = sums.result()
    assert out["mismatch/kl"] == pytest.approx((0.2 * 1 + 0.5 * 3) / 4) and out["mismatch/tokens"] == 4.0
    assert out["loss/policy"] == 3.0
