"""Anchor-state grouping: exact keys, similarity clustering against a loop oracle, order independence."""

from __future__ import annotations

import random
import string

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rapidfuzz.distance import Indel

from megatron_gigpo.algo.grouping import (
    _bigram_lower_bound,
    _char_profiles,
    anchor_key,
    anchor_state_groups,
    connected_components,
    factorize,
    renumber_by_first_appearance,
)
from megatron_gigpo.algo.oracle import lcs_similarity, oracle_groups

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=60, deadline=None)


def _same_partition(a, b) -> bool:
    a, b = list(a), list(b)
    return len(set(zip(a, b))) == len(set(a)) == len(set(b))


def _groups(uids, anchors, similarity=False, thresh=0.95):
    codes, _ = factorize(uids)
    return anchor_state_groups(codes, anchors, enable_similarity=similarity, similarity_thresh=thresh)


def test_exact_groups_stay_inside_uids_and_pool_revisits():
    group, size = _groups(["a", "a", "a", "b", "b"], ["s", "t", "s", "s", "s"])
    assert group.tolist() == [0, 1, 0, 2, 2]
    assert size.tolist() == [2, 1, 2, 2, 2]


def test_array_keys_include_shape_and_dtype():
    img = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    wide = np.zeros((2, 2, 6), dtype=np.uint8)
    wide[:, :, ::2] = img
    view = wide[:, :, ::2]  # same content, non-contiguous
    assert not view.flags.c_contiguous
    anchors = [img, img.copy(), view, img.reshape(4, 3), img.astype(np.int16), "x"]
    group, _ = _groups(["u"] * len(anchors), anchors)
    assert group.tolist() == [0, 0, 0, 1, 2, 3]
    one_byte_off = img.copy()
    one_byte_off[0, 0, 0] += 1
    assert anchor_key(one_byte_off) != anchor_key(img)


@pytest.mark.parametrize(
    ("anchor", "match"),
    [(np.array([object()], dtype=object), "object-dtype"), (3, "must be str or numpy.ndarray, got int")],
)
def test_unsupported_anchor_is_named(anchor, match):
    with pytest.raises(TypeError, match=match):
        _groups(["u", "u"], ["ok", anchor])
    with pytest.raises(TypeError, match="row 1"):
        _groups(["u", "u"], ["ok", anchor])


def test_similarity_mode_needs_strings():
    with pytest.raises(TypeError, match="row 1 has ndarray"):
        _groups(["u", "u"], ["x", np.zeros(2)], similarity=True)


@pytest.mark.parametrize("thresh", [0.0, 1.0, -0.5, 2.0])
def test_similarity_threshold_outside_open_interval(thresh):
    with pytest.raises(ValueError, match=r"similarity_thresh must be in \(0, 1\)"):
        _groups(["u", "u"], ["x", "y"], similarity=True, thresh=thresh)


def test_length_mismatch():
    with pytest.raises(ValueError, match="3 anchors for 2 rows"):
        anchor_state_groups(torch.tensor([0, 0]), ["a", "b", "c"], enable_similarity=False, similarity_thresh=0.9)


@SETTINGS
@given(a=st.text(alphabet="ab é√", max_size=12), b=st.text(alphabet="ab é√", max_size=12))
def test_rapidfuzz_indel_is_normalized_lcs(a, b):
    assert Indel.normalized_similarity(a, b) == lcs_similarity(a, b)  # bit for bit: ties decide links


ALPHABET = "ab c\u00e9\u221a\U0001f600"  # ASCII and 2-, 3- and 4-byte UTF-8 characters
short_text = st.text(alphabet=ALPHABET, max_size=10)


@SETTINGS
@given(
    rows=st.lists(st.tuples(st.sampled_from(["u", "v"]), short_text), min_size=1, max_size=14),
    thresh=st.sampled_from([0.5, 0.6, 2 / 3, 0.75, 0.8, 0.9]),
    seed=st.integers(0, 2**31 - 1),
)
def test_similarity_groups_match_single_linkage_oracle(rows, thresh, seed):
    uids = [u for u, _ in rows]
    anchors = [a for _, a in rows]
    group, size = _groups(uids, anchors, similarity=True, thresh=thresh)
    ref = oracle_groups(uids, anchors, True, thresh, similarity=lcs_similarity)
    assert _same_partition(group.tolist(), ref)
    assert size.tolist() == [ref.count(g) for g in ref]
    perm = random.Random(seed).sample(range(len(rows)), len(rows))
    moved, _ = _groups([uids[i] for i in perm], [anchors[i] for i in perm], similarity=True, thresh=thresh)
    assert _same_partition(moved.tolist(), group[perm].tolist())


@SETTINGS
@given(pairs=st.lists(st.tuples(st.text(alphabet=ALPHABET, max_size=40), st.text(alphabet=ALPHABET, max_size=40)),
                      min_size=1, max_size=8))
def test_histogram_bounds_never_exceed_the_indel_distance(pairs):
    # The filters may only drop pairs that cannot link: each lower bound <= the true Indel distance.
    strings = [s for pair in pairs for s in pair]
    first, second = torch.arange(0, len(strings), 2), torch.arange(1, len(strings), 2)
    lengths, hist, divisor = _char_profiles(strings)
    div = torch.maximum(divisor[first], divisor[second])
    unigram = ((hist[first] - hist[second]).abs().sum(1) + div - 1) // div
    bigram = _bigram_lower_bound(strings, first, second, divisor)
    truth = torch.tensor([Indel.distance(a, b) for a, b in pairs])
    assert bool((unigram <= truth).all()) and bool((bigram <= truth).all())
    assert bool(((lengths[first] - lengths[second]).abs() <= truth).all())


def test_byte_histogram_bound_stays_exact_past_float32_counts():
    # 5.6M four-byte characters: fewer than 2^23 code points but a folded byte count of 3N = 2^24 + 5, which
    # float32 rounds to 2^24 + 4. The unigram bound then read L1 = 5 instead of 4 (lower bound 2 > the
    # allowed distance 1) and dropped this true link (indel 1: b is a with one character appended).
    char = "\U00030c30"  # UTF-8 F0 B0 B0 B0: its three continuation bytes fold into one bin
    n = (2**24 + 5) // 3
    a, b = char * n, char * (n + 1)
    thresh = 1.0 - 1.5 / (2 * n + 1)  # the link needs indel <= 1; similarity 1 - 1 / (2n + 1) >= thresh
    assert Indel.distance(a, b, score_cutoff=2) == 1
    group, _ = _groups(["u", "u"], [a, b], similarity=True, thresh=thresh)
    assert group.tolist() == [0, 0]


def _pages(rng: random.Random, num_uids: int, visits: int) -> tuple[list[str], list[str]]:
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(300)]
    uids, anchors = [], []
    for u in range(num_uids):
        pages = [" ".join(rng.choices(vocab, k=60)) for _ in range(3)]
        pages.append(pages[0][:-30] + " " + " ".join(rng.choices(vocab, k=5)))  # near the link threshold
        for _ in range(visits):
            words = rng.choice(pages).split(" ")
            for _ in range(rng.randint(0, 3)):
                words[rng.randrange(len(words))] = rng.choice(vocab + ["\u00fcber", "caf\u00e9"])
            uids.append(f"u{u}")
            anchors.append(" ".join(words))
    return uids, anchors


@pytest.mark.parametrize("thresh", [0.9, 0.95, 0.97])
def test_similarity_groups_on_long_pages_match_oracle(thresh):
    uids, anchors = _pages(random.Random(int(thresh * 100)), num_uids=6, visits=12)
    group, _ = _groups(uids, anchors, similarity=True, thresh=thresh)
    assert _same_partition(group.tolist(), oracle_groups(uids, anchors, True, thresh))
    exact, _ = _groups(uids, anchors)
    assert _same_partition(list(zip(exact.tolist(), group.tolist())), exact.tolist())  # exact refines similarity


def test_single_linkage_chains():
    # a~b and b~c but not a~c: one group (connected components), independent of the order
    a, b, c = "aaaaaaaaaa", "aaaaaaaaab", "aaaaaaaabb"
    assert Indel.normalized_similarity(a, b) >= 0.9 > Indel.normalized_similarity(a, c)
    for order in ([a, b, c], [a, c, b], [c, a, b]):
        group, _ = _groups(["u"] * 3, order, similarity=True, thresh=0.9)
        assert len(set(group.tolist())) == 1


def test_connected_components():
    src, dst = torch.tensor([0, 3, 4, 6]), torch.tensor([1, 4, 5, 5])
    assert connected_components(8, src, dst).tolist() == [0, 0, 2, 3, 3, 3, 3, 7]


@SETTINGS
@given(labels=st.lists(st.integers(-5, 40), max_size=30), spread=st.sampled_from([1, 10**12]))
def test_renumber_by_first_appearance(labels, spread):
    # spread 1: dense labels (counting pass); 10**12: sparse labels (sort-based pass). Same numbering.
    ids = torch.tensor([x * spread for x in labels], dtype=torch.int64)
    seen: dict[int, int] = {}
    expected = [seen.setdefault(x, len(seen)) for x in labels]
    out = renumber_by_first_appearance(ids)
    assert out.dtype == torch.int64 and out.tolist() == expected
