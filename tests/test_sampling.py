"""Batched sampling: exact distributions, top-k/top-p sets, seeds independent of the batch."""
import math

import pytest
import torch

from woq.engine.sampling import SamplingParams, sample, uniform_noise


def _draws(logits, n, temperature=1.0, top_k=0, top_p=1.0, min_p=None):
    """n draws for one row, each with its own seed (one batch of n identical rows)."""
    B = n
    return sample(
        logits.expand(B, -1),
        torch.full((B,), temperature),
        torch.full((B,), top_k),
        torch.full((B,), top_p),
        torch.arange(B, dtype=torch.int64) * 7919 + 13,
        torch.zeros(B, dtype=torch.int64),
        None if min_p is None else torch.full((B,), min_p),
    )


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square at p ~ 1e-4 (deterministic draws: the test cannot flake)."""
    keep = probs > 0
    n = counts.sum()
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    dof = int(keep.sum()) - 1
    return stat < dof + 4.5 * math.sqrt(2 * dof) + 10


def test_noise_never_reaches_0_or_1_so_gumbel_noise_stays_finite():
    from woq.engine.sampling import unit_interval

    extremes = unit_interval(torch.tensor([0, 1, (1 << 23) - 2, (1 << 23) - 1]))
    assert 0 < extremes.min() and extremes.max() < 1
    assert torch.isfinite(-torch.log(-torch.log(extremes))).all()
    assert extremes[-1].double() == 1 - 2.0 ** -24  # (exact: the largest fp32 below 1)


def test_uniform_noise_is_uniform_and_keyed():
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 200_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1])
    again = uniform_noise(torch.tensor([2]), torch.tensor([0]), 200_000)
    assert torch.equal(again[0], u[1])  # a pure function of (seed, step, token)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    tokens = _draws(logits[None], 40_000, temperature=temperature)
    counts = torch.bincount(tokens, minlength=6).double()
    assert _chi2_ok(counts, torch.softmax(logits.double() / temperature, -1))


def test_top_k_and_top_p_restrict_then_renormalise():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    counts = torch.bincount(_draws(logits[None], 30_000, top_k=2), minlength=5).double()
    assert counts[2:].sum() == 0 and _chi2_ok(counts, torch.tensor([0.4, 0.3, 0, 0, 0], dtype=torch.float64) / 0.7)
    # top_p = 0.8: the smallest set reaching 0.8 is {0.4, 0.3, 0.15}
    counts = torch.bincount(_draws(logits[None], 30_000, top_p=0.8), minlength=5).double()
    assert counts[3:].sum() == 0 and _chi2_ok(counts, torch.tensor([0.4, 0.3, 0.15, 0, 0], dtype=torch.float64) / 0.85)
    # a tiny top_p still keeps the most likely token
    assert _draws(logits[None], 100, top_p=0.01).eq(0).all()


def test_min_p_keeps_tokens_near_the_most_likely_before_top_p():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    logits = torch.log(probs).float()
    # min_p = 0.3: p >= 0.12 stays, renormalised
    counts = torch.bincount(_draws(logits[None], 30_000, min_p=0.3), minlength=5).double()
    kept = torch.where(probs >= 0.3 * probs.max(), probs, 0)
    assert counts[3:].sum() == 0 and _chi2_ok(counts, kept / kept.sum())
    # at temperature 2 the same min_p compares the flattened distribution: p^(1/2) >= 0.3 * 0.4^(1/2)
    flat = probs.sqrt() / probs.sqrt().sum()
    counts = torch.bincount(_draws(logits[None], 30_000, temperature=2.0, min_p=0.3), minlength=5).double()
    kept = torch.where(flat >= 0.3 * flat.max(), flat, 0)
    assert kept.gt(0).sum() == 5 and _chi2_ok(counts, kept / kept.sum())
    # then top_p over what min_p left (vLLM's order): {0.4, 0.3, 0.15} / 0.85 -> the smallest set
    # reaching 0.8 is {0.4, 0.3}; top_p alone would keep 0.15 too
    counts = torch.bincount(_draws(logits[None], 30_000, top_p=0.8, min_p=0.3), minlength=5).double()
    assert counts[2:].sum() == 0 and _chi2_ok(counts, torch.tensor([0.4, 0.3, 0, 0, 0], dtype=torch.float64) / 0.7)
    # min_p = 1 keeps the most likely token alone; 0 keeps the whole distribution
    assert _draws(logits[None], 200, min_p=1.0).eq(0).all()
    counts = torch.bincount(_draws(logits[None], 30_000, min_p=0.0), minlength=5).double()
    assert _chi2_ok(counts, probs)


def test_greedy_rows_and_batch_independence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3])
    args = (torch.tensor([0, 50, 0, 0, 0]), torch.tensor([1.0, 0.9, 1.0, 1.0, 0.5]),
            torch.tensor([11, 22, 33, 44, 55]), torch.tensor([0, 3, 1, 9, 2]))
    batch = sample(logits, temp, *args)
    assert batch[0] == logits[0].argmax() and batch[3] == logits[3].argmax()
    for i in range(5):  # each row alone draws the same token as inside the batch
        alone = sample(logits[i : i + 1], temp[i : i + 1], *(a[i : i + 1] for a in args))
        assert alone.item() == batch[i].item()


def test_params_validation():
    for bad in (dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(min_p=-0.1), dict(min_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
