"""Alignment objectives on small hand-computable tensors: values equal the formulas, invalid tokens get no
mass, gradients flow only to the draft."""

import math

import pytest
import torch

from decoding.alignment import atspeed_r, atspeed_s, constrained_log_softmax, mix, recommendation_loss, tvd_kd, word_kd

# one position, V = 6; tokens 0 and 5 cannot continue a catalog item
DRAFT = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0, 4.0]])
TARGET = torch.tensor([[-2.0, 0.5, 0.0, 1.5, 1.0, 5.0]])
VALID = torch.tensor([[False, True, True, True, True, False]])


def softmax_over(logits, tokens):
    z = sum(math.exp(logits[t]) for t in tokens)
    return {t: math.exp(logits[t]) / z for t in tokens}


def test_recommendation_loss_and_weights():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]])  # [1, 2, 4]
    labels = torch.tensor([[1, 0]])
    ce0, ce1 = math.log(4), -math.log(math.exp(2) / (math.exp(2) + 3))
    assert recommendation_loss(logits, labels).item() == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
    assert recommendation_loss(logits, labels, weight=torch.tensor([[1.0, 0.0]])).item() == pytest.approx(ce0)


def test_word_kd_and_tvd_kd_over_the_full_vocabulary():
    q = softmax_over(DRAFT[0].tolist(), range(6))
    p = softmax_over(TARGET[0].tolist(), range(6))
    kl = sum(p[v] * math.log(p[v] / q[v]) for v in range(6))
    tvd = 0.5 * sum(abs(p[v] - q[v]) for v in range(6))
    assert word_kd(DRAFT, TARGET).item() == pytest.approx(kl, rel=1e-5)
    assert tvd_kd(DRAFT, TARGET).item() == pytest.approx(tvd, rel=1e-5)
    assert word_kd(TARGET, TARGET).item() == pytest.approx(0, abs=1e-6)


def test_atspeed_s_equals_the_formula():
    q = softmax_over(DRAFT[0].tolist(), [1, 2, 3, 4])  # constrained: tokens 0 and 5 excluded
    p = softmax_over(TARGET[0].tolist(), [1, 2, 3, 4])
    s = sorted(q, key=q.get, reverse=True)[:2]  # draft's top-2 valid tokens: [2, 1]
    assert s == [2, 1]
    q_s = {y: q[y] / sum(q[x] for x in s) for y in s}  # renormalised over S
    p_s = {y: p[y] / sum(p[x] for x in s) for y in s}
    rkl = sum(q_s[y] * (math.log(q_s[y]) - math.log(p_s[y])) for y in s)
    reg = p_s[s[-1]] * -sum(q_s[y] * math.log(q_s[y]) for y in s)
    assert atspeed_s(DRAFT, TARGET, VALID, k=2).item() == pytest.approx(rkl + reg, rel=1e-5)
    assert atspeed_s(DRAFT, TARGET, VALID, k=2, beta=0.25).item() == pytest.approx(rkl + 0.25 * reg, rel=1e-5)


def test_atspeed_r_equals_the_formula():
    q = softmax_over(DRAFT[0].tolist(), [1, 2, 3, 4])
    p = softmax_over(TARGET[0].tolist(), [1, 2, 3, 4])
    t = sorted(p, key=p.get, reverse=True)[:3]  # target's top-3 valid tokens: [3, 4, 1]
    assert t == [3, 4, 1]
    tvd = 0.5 * sum(abs(q[y] - p[y]) for y in t)
    assert atspeed_r(DRAFT, TARGET, VALID, k=3).item() == pytest.approx(tvd, rel=1e-5)


@pytest.mark.parametrize("loss", [atspeed_s, atspeed_r])
def test_invalid_tokens_get_no_mass(loss):
    assert constrained_log_softmax(DRAFT, VALID).exp()[~VALID].sum() == 0
    draft = DRAFT.clone().requires_grad_()
    value = loss(draft, TARGET, VALID, k=2)
    value.backward()
    assert (draft.grad[~VALID] == 0).all() and draft.grad[VALID].abs().sum() > 0
    moved = DRAFT.clone()
    moved[~VALID] += torch.tensor([10.0, -7.0])  # invalid logits do not change the loss
    target_moved = TARGET.clone()
    target_moved[~VALID] -= 3.0
    assert loss(moved, target_moved, VALID, k=2).item() == pytest.approx(value.item(), rel=1e-6)


@pytest.mark.parametrize(
    "loss",
    [
        lambda d, t, v: atspeed_s(d, t, v, 3),
        lambda d, t, v: atspeed_r(d, t, v, 3),
        lambda d, t, v: word_kd(d, t),
        lambda d, t, v: tvd_kd(d, t),
    ],
)
def test_gradients_flow_only_to_the_draft(loss):
    draft = torch.randn(4, 3, 6, requires_grad=True)
    target = torch.randn(4, 3, 6, requires_grad=True)
    valid = torch.rand(4, 3, 6) > 0.4
    loss(draft, target, valid).backward()
    assert target.grad is None
    assert draft.grad is not None and draft.grad.abs().sum() > 0


def test_fewer_valid_tokens_than_k_and_empty_rows_stay_finite():
    draft = torch.randn(3, 6, requires_grad=True)
    target = torch.randn(3, 6)
    valid = torch.zeros(3, 6, dtype=torch.bool)
    valid[0, 2] = True  # one valid token: both losses are exactly 0 (q = p = 1 on it)
    valid[1, [1, 4]] = True
    weight = torch.tensor([1.0, 1.0, 0.0])  # row 2 has no valid token: padding, weight 0
    for loss in (atspeed_s, atspeed_r):
        value = loss(draft, target, valid, k=5, weight=weight)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(draft.grad).all()
        draft.grad = None
    single = torch.zeros(1, 6, dtype=torch.bool)
    single[0, 2] = True
    assert atspeed_s(draft[:1], target[:1], single, k=5).item() == pytest.approx(0, abs=1e-6)
    assert atspeed_r(draft[:1], target[:1], single, k=5).item() == pytest.approx(0, abs=1e-6)


def test_mix():
    assert mix(torch.tensor(2.0), torch.tensor(4.0), 0.25).item() == pytest.approx(2.5)
