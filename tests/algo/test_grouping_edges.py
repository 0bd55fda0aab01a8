"""Edge cases of anchor grouping: exact values, dtypes and boundaries of the helpers (mutation-test survivors).

Each test pins a documented contract of :mod:`megatron_gigpo.algo.grouping` that the partition-level tests in
``test_grouping.py`` cannot see: the candidate-pair lower bounds are only pruning, so a looser bound leaves every
partition unchanged, but its documented value (and dtype) is still checked here against a plain-Python reference.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from rapidfuzz.distance import Indel

from megatron_gigpo.algo.grouping import (
    BIGRAM_BINS,
    _bigram_lower_bound,
    _bigram_profiles,
    _candidate_pairs,
    _char_profiles,
    anchor_key,
    anchor_keys,
    factorize,
    max_linked_distance,
    renumber_by_first_appearance,
    similarity_anchor_groups,
)
from megatron_gigpo.algo.oracle import oracle_groups

pytestmark = pytest.mark.unit


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _byte_l1(a: str, b: str, bins: int = 128) -> int:
    """L1 distance of the UTF-8 byte histograms folded to ``bins`` bins (byte x in bin x mod bins)."""
    ca = Counter(x % bins for x in a.encode("utf-8"))
    cb = Counter(x % bins for x in b.encode("utf-8"))
    return sum(abs(ca[k] - cb[k]) for k in set(ca) | set(cb))


def _bigrams(s: str) -> Counter:
    raw = s.encode("utf-8")
    return Counter((131 * x + y) % BIGRAM_BINS for x, y in zip(raw, raw[1:]))


def test_array_key_is_the_documented_tuple():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)[:, ::2]  # a non-contiguous view
    assert anchor_key(arr) == ("ndarray", "<i2", (2, 2), np.array([[0, 2], [3, 5]], dtype=np.int16).tobytes())


def test_string_anchors_pass_through_without_a_copy():
    anchors = ["a", "b", "a"]
    assert anchor_keys(anchors) is anchors
    mixed = ["a", np.zeros(2, dtype=np.uint8)]
    assert anchor_keys(mixed) == ["a", anchor_key(mixed[1])]


def test_renumber_far_apart_negative_labels_uses_the_sorting_pass():
    # high - low = 2^62: a counting pass would need a 2^62-entry table; the sort-based pass must serve it.
    ids = torch.tensor([-(2**62), 0, -(2**62), 7], dtype=torch.int64)
    out = renumber_by_first_appearance(ids)
    assert out.dtype == torch.int64 and out.tolist() == [0, 1, 0, 2]


def test_char_profiles_values_and_dtypes():
    lengths, folded, divisor = _char_profiles(["ab", "\u00e9", ""])  # e-acute is UTF-8 C3 A9
    assert lengths.dtype == torch.int64 and lengths.tolist() == [2, 1, 0]
    assert folded.dtype == torch.int32 and folded.shape == (3, 128)
    expected = torch.zeros(3, 128, dtype=torch.int32)
    expected[0, ord("a")] = expected[0, ord("b")] = 1
    expected[1, 0xC3 - 128] = expected[1, 0xA9 - 128] = 1
    assert torch.equal(folded, expected)
    assert divisor.dtype == torch.int64 and divisor.tolist() == [1, 4, 1]


def test_candidate_pairs_bounds_match_reference():
    # uid 0 holds nodes 0, 2, 3, 4; uid 1 only node 1 (never paired). At threshold 0.01 a pair is kept unless
    # its bound reaches the total length (similarity 0): only ("aaaa", "bbb"), bound 7, is pruned.
    strings = ["aaaa", "x", "abbb", "\u00e9\u00e9\u00e9", "bbb"]
    node_group = torch.tensor([0, 1, 0, 0, 0])
    lengths, hist, divisor = _char_profiles(strings)
    first, second, lower = _candidate_pairs(node_group, lengths, hist, divisor, 0.01)
    assert first.dtype == second.dtype == lower.dtype == torch.int64
    got = {(i, j): low for i, j, low in zip(first.tolist(), second.tolist(), lower.tolist())}
    expected = {}
    for i, j in [(0, 2), (0, 3), (0, 4), (2, 3), (2, 4), (3, 4)]:
        div = 1 if strings[i].isascii() and strings[j].isascii() else 4
        l1 = _byte_l1(strings[i], strings[j])
        low = max(abs(len(strings[i]) - len(strings[j])), _ceil_div(l1, div))
        if low < len(strings[i]) + len(strings[j]):
            expected[(i, j)] = low
    assert got == expected and (0, 4) not in got
    assert got[(0, 2)] == 6 and got[(3, 4)] == 3  # ASCII (L1 6, divisor 1); non-ASCII (L1 9, divisor 4)
    for a, b in expected:
        assert expected[(a, b)] <= Indel.distance(strings[a], strings[b])


def test_candidate_pairs_prunes_by_the_linked_distance():
    strings = ["aaaa", "abbb", "aaab"]  # lower bounds: (0,1) 6, (0,2) 2, (1,2) 4; lengths sum to 8
    lengths, hist, divisor = _char_profiles(strings)
    first, second, lower = _candidate_pairs(torch.zeros(3, dtype=torch.int64), lengths, hist, divisor, 0.5)
    assert list(zip(first.tolist(), second.tolist(), lower.tolist())) == [(0, 2, 2), (1, 2, 4)]


def test_candidate_pairs_without_a_shared_uid_are_empty():
    lengths, hist, divisor = _char_profiles(["a", "b", "c"])
    for out in _candidate_pairs(torch.tensor([0, 1, 2]), lengths, hist, divisor, 0.5):
        assert out.dtype == torch.int64 and out.shape == (0,)


def test_candidate_pairs_histogram_l1_is_exact_below_float32_threshold_of_counts():
    # Rows with 2^24 - 1 and 2^24 - 2 bytes: their L1 2^25 - 3 is odd and above 2^24, which float32 would
    # round to 2^25 - 4; the byte total 2^24 - 1 >= 2^23 must switch the distance to float64.
    hist = torch.zeros(2, 128, dtype=torch.int32)
    hist[0, 0], hist[1, 1] = 2**24 - 1, 2**24 - 2
    lengths = torch.tensor([2**25, 2**25])
    divisor = torch.ones(2, dtype=torch.int64)
    first, second, lower = _candidate_pairs(torch.zeros(2, dtype=torch.int64), lengths, hist, divisor, 0.01)
    assert (first.tolist(), second.tolist(), lower.tolist()) == ([0], [1], [2**25 - 3])


def test_bigram_profiles_bins():
    strings = ["", "a", "ab", "aba", "\u00e9"]
    hist = _bigram_profiles(strings)
    assert hist.dtype == np.int32 and hist.shape == (5, BIGRAM_BINS)
    expected = np.zeros((5, BIGRAM_BINS), dtype=np.int32)
    for row, s in enumerate(strings):
        for k, count in _bigrams(s).items():
            expected[row, k] = count
    np.testing.assert_array_equal(hist, expected)
    assert hist[2, (131 * ord("a") + ord("b")) % BIGRAM_BINS] == 1
    assert hist[4, (131 * 0xC3 + 0xA9) % BIGRAM_BINS] == 1


def test_bigram_lower_bound_values():
    # (A, C): one ASCII deletion in the middle, L1 3 -> 1 (tight). ("ab", ""): L1 1 -> 1. ("abcd", "a"): L1 3
    # -> 1; ("abcde", ""): L1 4 -> 2. ("a" * 32769, "b"): one bigram counted 2^15 times (no int16 overflow).
    # Non-ASCII ("e-acute x2", ""): L1 3 over 2 + 4 -> 1.
    strings = ["abcdefghij", "abcdeghij", "ab", "", "abcd", "a", "abcde", "a" * 32769, "b", "\u00e9\u00e9"]
    pairs = [(0, 1), (2, 3), (4, 5), (6, 3), (7, 8), (9, 3)]
    _, _, divisor = _char_profiles(strings)
    first, second = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    got = _bigram_lower_bound(strings, first, second, divisor)
    expected = []
    for i, j in pairs:
        bi, bj = _bigrams(strings[i]), _bigrams(strings[j])
        l1 = sum(abs(bi[k] - bj[k]) for k in set(bi) | set(bj))
        expected.append(_ceil_div(l1, 2 + (1 if strings[i].isascii() and strings[j].isascii() else 4)))
    assert got.dtype == torch.int64 and got.tolist() == expected == [1, 1, 1, 2, 10923, 1]
    assert all(e <= Indel.distance(strings[i], strings[j]) for e, (i, j) in zip(expected, pairs))


@pytest.mark.parametrize(
    ("total", "thresh", "expected"),
    [
        (10, 0.5, 5),
        (10, 0.9, 1),  # (1 - 0.9) * 10 = 0.9999999999999998 in float64: the margin keeps the link at 1
        (4_000_000, 0.5, 2_000_000),  # an exact product above 1e6: the relative margin must not push it below
        (2**25 + 2, 0.5, 2**24 + 1),  # a total float32 cannot hold: the product runs in float64
        (7, 0.999, 0),
    ],
)
def test_max_linked_distance_values(total, thresh, expected):
    out = max_linked_distance(torch.tensor([total]), thresh)
    assert out.dtype == torch.int64 and out.tolist() == [expected]


def test_link_needs_the_exact_similarity_not_only_the_distance_limit():
    # "abcdef" vs "abcd": indel 2 over 10 characters, similarity exactly 0.8. At 0.8 + 1e-9 the integer limit
    # max_linked_distance still admits distance 2, but the float64 similarity check must reject the link.
    anchors, uid = ["abcdef", "abcd"], torch.zeros(2, dtype=torch.int64)
    assert Indel.normalized_similarity(*anchors) == 0.8
    assert int(max_linked_distance(torch.tensor([10]), 0.8 + 1e-9)) == 2
    assert similarity_anchor_groups(uid, anchors, 0.8).tolist() == [0, 0]
    assert similarity_anchor_groups(uid, anchors, 0.8 + 1e-9).tolist() == [0, 1]


def test_second_round_keeps_pairs_whose_bigram_bound_equals_the_limit():
    # A~C and B~D (one middle deletion each: indel 1, bigram bound exactly 1 = the limit at thresh 0.94), but
    # in round 1 every node checks an anagram partner (unigram bound 0, not linked): both links come from round
    # 2, where a bound equal to the limit must be kept.
    a, b, c, d = "abcdefghij", "bacdefghij", "abcdeghij", "bacdeghij"
    anchors = [a, b, c, d]
    uid = torch.zeros(4, dtype=torch.int64)
    group = similarity_anchor_groups(uid, anchors, 0.94)
    assert group.tolist() == [0, 1, 0, 1]
    codes, _ = factorize(["u"] * 4)
    expected = oracle_groups(["u"] * 4, anchors, True, 0.94)  # the loop oracle agrees (same partition)
    assert torch.equal(codes, uid) and len(set(zip(group.tolist(), expected))) == len(set(expected)) == 2
