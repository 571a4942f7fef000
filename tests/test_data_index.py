"""The computed sample indices (loom.data.index) and the sampler over them: a seekable
permutation instead of a per-rank list, a mixture schedule whose ratios hold at every prefix,
a validation holdout by arithmetic, document positions of a window. In-process, no launches."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from loom.data.index import Blend, Holdout, Permutation, window_positions
from loom.data.index.windows import IGNORE


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4099])
def test_the_permutation_is_a_bijection_of_0_to_n_and_seekable(n):
    perm = Permutation(n, seed=11)
    whole = perm(np.arange(n))
    assert sorted(whole.tolist()) == list(range(n))
    picks = np.array([0, n // 2, n - 1])
    assert perm(picks).tolist() == whole[picks].tolist()  # element i without the others
    assert perm(n - 1) == int(whole[-1])


def test_the_permutation_depends_on_the_seed_and_shuffles():
    a, b = Permutation(1000, 1)(np.arange(1000)), Permutation(1000, 2)(np.arange(1000))
    assert not np.array_equal(a, b)
    assert (a == np.arange(1000)).sum() < 20  # not the identity, nor close to it
    big = Permutation(10**12, 3)
    got = big(np.arange(10**6, 10**6 + 1000))
    assert len(set(got.tolist())) == 1000 and got.max() < 10**12


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.6, 0.3, 0.1], [5, 1], [0.123, 0.877],
                                     [0.25, 0.25, 0.5, 1e-3]])
def test_every_prefix_of_the_blend_is_within_one_sample_of_the_weights(weights):
    blend = Blend(weights)
    shares = [Fraction(str(w)) / sum(Fraction(str(x)) for x in weights) for w in weights]
    counts = [0] * len(weights)
    for k in range(min(5 * blend.period, 30000)):
        j, m = blend.source_of(k)
        assert m == counts[j]  # the m-th sample drawn from source j, in order
        counts[j] += 1
        for c, s in zip(counts, shares, strict=True):
            assert abs(c - s * (k + 1)) < 1 + 1e-9
    assert blend.counts(k + 1) == counts
    far = 10**13 + 7  # seekable far beyond any list
    assert sum(blend.counts(far)) == far


def test_the_holdout_splits_windows_by_arithmetic_as_a_list_would():
    for windows, fraction in [(100, 0.1), (7, 0.5), (1000, 0.005), (5, None), (3, 0.2)]:
        h = Holdout.of(windows, fraction)
        k = max(2, round(1 / fraction)) if fraction else 0
        val = [i for i in range(windows) if k and i % k == k - 1]
        train = [i for i in range(windows) if i not in val]
        assert [h.train_window(t) for t in range(h.n_train)] == train
        assert [h.val_window(v) for v in range(h.n_val)] == val


def test_window_positions_restart_at_each_document_and_mark_crossing_targets():
    positions, crossing = window_positions(np.array([3, 7, 8]), 8)
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # input 2's target is token 3, the next document's first; input 7's target opens another
    assert np.flatnonzero(crossing).tolist() == [2, 6, 7]
    positions, crossing = window_positions(np.array([], dtype=np.int64), 4)
    assert positions.tolist() == [0, 1, 2, 3] and not crossing.any()
    assert IGNORE == -100


class _Ordered:
    ordered = True

    def __len__(self) -> int:
        return 40


def test_an_ordered_dataset_is_read_in_its_order_continuing_across_epochs_at_any_dp():
    from loom.data.sampler import ResumableDistributedSampler

    def steps(dp, epoch):
        per_rank = []
        for r in range(dp):
            s = ResumableDistributedSampler(_Ordered(), dp, r, micro_batch=2, global_batch=8, seed=3)
            s.set_epoch(epoch)
            per_rank.append(list(s))
        return sorted(i for ids in per_rank for i in ids)

    assert steps(1, 0) == steps(2, 0) == steps(4, 0) == list(range(40))
    assert steps(2, 1) == list(range(40, 80))  # epoch 1 continues the schedule, not a repeat
