"""Anchor-state grouping (GiGPO, arXiv 2505.10978, Sec. 4.2): which step rows share a state.

Two rows belong to the same step group only if they have the same ``uid`` (same task and initial state);
within a uid:

- **exact** mode: their anchors have the same canonical key (:func:`anchor_key`): a string is its own key;
  a numpy array is keyed by ``(dtype, shape, bytes)``, so equal pixels with another shape or dtype are a
  different state. The time step and the trajectory are not part of the key: revisits pool together.
- **similarity** mode: single-linkage clustering. Rows ``i`` and ``j`` are *linked* when their normalized
  Indel similarity ``1 - indel(a_i, a_j) / (len a_i + len a_j)`` (rapidfuzz's
  ``Indel.normalized_similarity``, evaluated with that same float64 formula; ``indel = len_i + len_j -
  2 LCS``, so it equals ``2 LCS / (len_i + len_j)``; 1 for two empty strings) is ``>= similarity_thresh``;
  step groups are the connected components of the links (chains count: a~b and b~c join a and c). The
  partition is a pure function of the set of (uid, anchor) pairs: it does not depend on row order (unlike a
  greedy "compare with each cluster's first member" pass, whose result changes with the order rows arrive in),
  and identical anchors always share a group, so exact groups refine similarity groups. Only string anchors
  are allowed in this mode.

Group ids are numbered 0, 1, ... by first appearance in row order; only the partition is meaningful.

Speed (similarity mode): rows with equal keys collapse to one node first; a pair of nodes is only sent to
rapidfuzz if a cheap lower bound on its Indel distance allows a link: the length difference, and the L1
distance of the strings' UTF-8 byte histograms divided by the longest UTF-8 character length (one inserted
or deleted character changes the histogram by at most that much: the q = 1 case of Ukkonen's q-gram lemma,
"Approximate string matching with q-grams and maximal matches", 1992). The bound never rejects a true link,
so the result is exactly the definition above. Exact checks run in two batched rounds (each node's most
promising candidate first, then only the candidates whose nodes are still in different components): pairs
already connected cannot change the partition and are never compared. Before the second round, whose pairs
are mostly different states (rapidfuzz cannot stop early on them), a sharper bound prunes them: the L1
distance of UTF-8 byte-*bigram* histograms (folded to 512 bins) divided by ``2 + max_utf8_len`` (one
inserted or deleted character of ``u`` bytes removes one bigram and adds ``u + 1``: the q = 2 case of the
same lemma). It costs one histogram per node that still has such a pair, so it runs only there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from rapidfuzz import process
from rapidfuzz.distance import Indel


def factorize(values: Sequence[Hashable]) -> tuple[torch.Tensor, list[Hashable]]:
    """Integer codes for hashable values, numbered by first appearance.

    Args:
        values: length R sequence of hashable values (strings, ints, tuples).
    Returns:
        ``(codes, uniques)``: int64 (R,) with ``uniques[codes[i]] == values[i]``.
    Raises:
        TypeError: a value is not hashable.
    """
    uniques = list(dict.fromkeys(values))  # C-level hashing, keeps first-appearance order
    code_of = dict(zip(uniques, range(len(uniques))))
    codes = np.fromiter(map(code_of.__getitem__, values), dtype=np.int64, count=len(values))
    return torch.from_numpy(codes), uniques


def anchor_key(anchor: object, row: int | None = None) -> Hashable:
    """Canonical, hashable key of one anchor observation.

    Args:
        anchor: a ``str`` (its own key) or a numpy array (key ``("ndarray", dtype.str, shape, bytes)``;
            the C-order bytes, so views and copies with equal content get the same key).
        row: row number, only for the error message.
    Returns:
        the key; a string key never equals an array key.
    Raises:
        TypeError: another type, or an object-dtype array (its bytes are pointers, not content).
    """
    if isinstance(anchor, str):
        return anchor
    if isinstance(anchor, np.ndarray):
        if anchor.dtype.hasobject:
            raise TypeError(f"anchor of row {row}: object-dtype arrays have no canonical content key")
        return ("ndarray", anchor.dtype.str, anchor.shape, np.ascontiguousarray(anchor).tobytes())
    raise TypeError(f"anchor of row {row} must be str or numpy.ndarray, got {type(anchor).__name__}")


def anchor_keys(anchors: Sequence[object]) -> Sequence[Hashable]:
    """:func:`anchor_key` of every row (strings pass through without a copy)."""
    if set(map(type, anchors)) <= {str}:
        return anchors  # strings are their own keys: no per-row work
    try:
        return [a if type(a) is str else anchor_key(a) for a in anchors]
    except TypeError:
        # Re-run one by one only to name the offending row.
        for i, a in enumerate(anchors):
            anchor_key(a, i)
        raise


def renumber_by_first_appearance(ids: torch.Tensor) -> torch.Tensor:
    """Relabel arbitrary int64 group labels (R,) as 0, 1, ... in order of first appearance."""
    if ids.numel() == 0:
        return ids.clone()
    labels = ids.numpy()
    n = labels.size
    low, high = int(labels.min()), int(labels.max())
    if high - low < 8 * n:  # labels dense enough for an O(R) pass without sorting
        dense = labels - low
        first = np.full(high - low + 1, n, dtype=np.int64)
        first[dense[::-1]] = np.arange(n - 1, -1, -1)  # the last write wins: each label's first row
        opener = first[dense]  # (R,) the first row of each row's label
        rank = np.cumsum(opener == np.arange(n)) - 1  # (R,) group number, counted at each opening row
        return torch.from_numpy(rank[opener])
    # numpy's sort-based unique: steadier than torch.unique's threaded sort on small CPU tensors.
    _, first_row, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty_like(first_row)
    rank[np.argsort(first_row, kind="stable")] = np.arange(first_row.size)
    return torch.from_numpy(rank[inverse.reshape(-1)]).to(torch.int64)


def exact_anchor_groups(uid_index: torch.Tensor, keys: Sequence[Hashable]) -> torch.Tensor:
    """Step groups of exact mode: rows with the same uid code and the same anchor key.

    Args:
        uid_index: int64 (R,), uid code per row.
        keys: R anchor keys (:func:`anchor_keys`).
    Returns:
        int64 (R,) group ids, numbered by first appearance.
    """
    key_codes, uniques = factorize(keys)
    combined = uid_index * max(len(uniques), 1) + key_codes  # (R,) unique per (uid, key)
    return renumber_by_first_appearance(combined)


def connected_components(num_nodes: int, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Component label (the smallest node index in it) of every node of an undirected graph.

    Min-label propagation with pointer jumping; each round is vectorised over edges, and the number of
    rounds grows with the logarithm of the component diameter in practice.

    Args:
        num_nodes: number of nodes.
        src, dst: int64 (E,) edge endpoints.
    Returns:
        int64 (num_nodes,).
    """
    label = torch.arange(num_nodes, dtype=torch.int64)
    if src.numel() == 0:
        return label
    while True:
        low = torch.minimum(label[src], label[dst])  # (E,)
        new = label.scatter_reduce(0, src, low, reduce="amin").scatter_reduce(0, dst, low, reduce="amin")
        # Labels always point at a node with a smaller or equal label: jump until fixed.
        while True:
            jumped = new[new]
            if torch.equal(jumped, new):
                break
            new = jumped
        if torch.equal(new, label):
            return label
        label = new


def _char_profiles(strings: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per string: length in code points, UTF-8 byte histogram folded to 128 bins, and the divisor that turns
    the histogram L1 distance of two strings into a lower bound on their Indel distance.

    One inserted or deleted character changes the byte histogram by at most its UTF-8 length (1 for ASCII,
    up to 4), and folding bins can only shrink an L1 distance, so for two strings
    ``indel >= L1 / max_utf8_len``: the divisor is 1 when both strings are ASCII, else 4.
    """
    n = len(strings)
    hist = np.empty((n, 256), dtype=np.int32)
    for i, s in enumerate(strings):  # one C-level bincount per distinct anchor
        hist[i] = np.bincount(np.frombuffer(s.encode("utf-8"), dtype=np.uint8), minlength=256)
    folded = torch.from_numpy(hist[:, :128] + hist[:, 128:])  # (n, 128)
    lengths = torch.tensor(list(map(len, strings)), dtype=torch.int64)  # (n,)
    divisor = torch.tensor([1 if s.isascii() else 4 for s in strings], dtype=torch.int64)  # (n,)
    return lengths, folded, divisor


def _candidate_pairs(
    node_group: torch.Tensor, lengths: torch.Tensor, hist: torch.Tensor, divisor: torch.Tensor, thresh: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs of nodes of one uid whose Indel-distance lower bound still allows similarity >= thresh.

    Work is batched per distinct uid size k (few distinct sizes): the histograms of all uids with k nodes
    form a (G_k, k, 128) block whose pairwise L1 distances come from one ``torch.cdist(p=1)`` call.

    Returns:
        ``(first, second, lower)``: int64 (P,) node pairs and their distance lower bound (smaller = more
        alike, used to order the exact checks).
    """
    order = torch.argsort(node_group, stable=True)
    sizes = torch.bincount(node_group)
    starts = torch.cumsum(sizes, 0) - sizes
    # float32 holds integer counts and L1 sums exactly below 2^24; a pair's L1 is at most the sum of its two
    # UTF-8 byte lengths (up to 4 per character, so the code-point length is no guide): test bytes.
    hist_f = hist.to(torch.float64 if int(hist.sum(1).max()) >= 2**23 else torch.float32)
    firsts, seconds, lowers = [], [], []
    for k in torch.unique(sizes).tolist():
        if k < 2:
            continue
        groups_k = torch.nonzero(sizes == k).flatten()
        nodes = order[starts[groups_k].unsqueeze(1) + torch.arange(k)]  # (G_k, k)
        l1 = torch.cdist(hist_f[nodes], hist_f[nodes], p=1).round().to(torch.int64)  # (G_k, k, k)
        a, b = torch.triu_indices(k, k, offset=1)
        i, j = nodes[:, a].flatten(), nodes[:, b].flatten()  # (G_k * k(k-1)/2,)
        div = torch.maximum(divisor[i], divisor[j])
        lower = torch.maximum((lengths[i] - lengths[j]).abs(), (l1[:, a, b].flatten() + div - 1) // div)
        keep = lower <= max_linked_distance(lengths[i] + lengths[j], thresh)
        firsts.append(i[keep])
        seconds.append(j[keep])
        lowers.append(lower[keep])
    if not firsts:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    return torch.cat(firsts), torch.cat(seconds), torch.cat(lowers)


#: Bins of the folded byte-bigram histogram (folding merges bins, which can only shrink an L1 distance).
BIGRAM_BINS = 512


def _bigram_profiles(strings: list[str]) -> np.ndarray:
    """int32 (n, BIGRAM_BINS): each string's UTF-8 byte-bigram histogram, bigram ``(x, y)`` in bin
    ``(131 x + y) mod 512`` (any fixed folding keeps the lower bound of :func:`_bigram_lower_bound` valid)."""
    hist = np.zeros((len(strings), BIGRAM_BINS), dtype=np.int32)
    for i, s in enumerate(strings):
        b = np.frombuffer(s.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
        if b.size > 1:
            key = b[:-1] * 131  # uint16: 255 * 131 + 255 < 2^16
            key += b[1:]
            key &= BIGRAM_BINS - 1
            hist[i] = np.bincount(key, minlength=BIGRAM_BINS)
    return hist


def _bigram_lower_bound(
    strings: list[str], first: torch.Tensor, second: torch.Tensor, divisor: torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """int64 (P,): a lower bound on ``indel(strings[first], strings[second])`` from bigram histograms.

    An inserted or deleted character of ``u`` UTF-8 bytes removes one byte bigram and adds ``u + 1`` (or
    fewer at either end), so ``indel >= L1 / (2 + u_max)``: 3 when both strings are ASCII (``divisor`` 1),
    else 6 (``divisor`` 4, i.e. u_max = 4). Pairs are processed ``chunk`` at a time to bound the memory.
    """
    nodes, inverse = torch.unique(torch.cat([first, second]), return_inverse=True)
    hist = _bigram_profiles([strings[i] for i in nodes.tolist()])  # (m, BIGRAM_BINS)
    if hist.max(initial=0) < 2**15:
        hist = hist.astype(np.int16)  # differences of counts < 2^15 fit int16: half the memory traffic
    a, b = inverse[: first.numel()].numpy(), inverse[first.numel():].numpy()
    l1 = np.concatenate([np.abs(hist[a[k : k + chunk]] - hist[b[k : k + chunk]]).sum(1, dtype=np.int64)
                         for k in range(0, a.size, chunk)])
    div = torch.maximum(divisor[first], divisor[second]) + 2
    return (torch.from_numpy(l1) + div - 1) // div


def max_linked_distance(total: torch.Tensor, thresh: float) -> torch.Tensor:
    """int64: an upper bound on the Indel distance of any linked pair whose lengths sum to ``total``.

    ``1 - d / total >= thresh`` needs ``d <= (1 - thresh) * total``; the small margins only admit extra
    candidates (which the exact check then rejects), never lose a link to rounding.
    """
    return torch.floor((1.0 - thresh) * total.to(torch.float64) * (1.0 + 1e-12) + 1e-6).to(torch.int64)


def _links(
    strings: list[str], first: torch.Tensor, second: torch.Tensor, lengths: torch.Tensor, thresh: float
) -> torch.Tensor:
    """bool (P,): ``1 - indel(a, b) / (len a + len b) >= thresh`` for each pair, in float64 exactly as
    ``Indel.normalized_similarity`` computes it.

    Distances come from rapidfuzz with an *integer* cutoff (it may stop early above it); its normalized
    cutoff is not used because its float rounding can drop a pair sitting exactly on the threshold. Pairs
    are batched by their cutoff rounded up on a geometric grid, so few calls serve all lengths.
    """
    if first.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    total = lengths[first] + lengths[second]  # (P,)
    limit = max_linked_distance(total, thresh)
    # Round each limit up to the grid 2^(k/8) (steps of ~9%): few calls, cutoffs at most ~9% loose.
    grid = torch.exp2(torch.ceil(8 * torch.log2(limit.clamp(min=1).to(torch.float64))) / 8)
    bucket = torch.maximum(torch.ceil(grid - 1e-9).to(torch.int64), limit)  # never below the limit
    dist = torch.empty_like(total)
    for cut in torch.unique(bucket).tolist():
        sel = torch.nonzero(bucket == cut).flatten()
        dist[sel] = torch.from_numpy(
            process.cpdist(
                [strings[i] for i in first[sel].tolist()],
                [strings[j] for j in second[sel].tolist()],
                scorer=Indel.distance,
                score_cutoff=int(cut),
                dtype=np.int64,
                workers=torch.get_num_threads(),  # follow the intra-op thread budget
            )
        )
    sim = 1.0 - dist.to(torch.float64) / total.to(torch.float64)
    return (dist <= limit) & (sim >= thresh)


def similarity_anchor_groups(
    uid_index: torch.Tensor, anchors: Sequence[object], similarity_thresh: float
) -> torch.Tensor:
    """Step groups of similarity mode (single linkage on normalized Indel similarity, see module doc).

    Args:
        uid_index: int64 (R,), uid code per row.
        anchors: R string anchors.
        similarity_thresh: link threshold, in (0, 1).
    Returns:
        int64 (R,) group ids, numbered by first appearance.
    Raises:
        TypeError: an anchor is not a string.
        ValueError: threshold outside (0, 1).
    """
    if not 0.0 < similarity_thresh < 1.0:
        raise ValueError(f"similarity_thresh must be in (0, 1), got {similarity_thresh}")
    for i, a in enumerate(anchors):
        if not isinstance(a, str):
            raise TypeError(f"similarity grouping needs string anchors; row {i} has {type(a).__name__}")
    node_of_row = exact_anchor_groups(uid_index, anchors)  # (R,) exact duplicates collapse to one node
    num_nodes = int(node_of_row.max()) + 1 if node_of_row.numel() else 0
    rows = torch.arange(node_of_row.numel(), dtype=torch.int64)
    rep_row = torch.full((num_nodes,), node_of_row.numel(), dtype=torch.int64)
    rep_row = rep_row.scatter_reduce(0, node_of_row, rows, reduce="amin")  # first row of each node
    node_uid = uid_index[rep_row]  # (num_nodes,)
    if node_uid.numel() == 0 or int(torch.bincount(node_uid).max()) < 2:
        return node_of_row  # no uid holds two different anchors: nothing to compare
    strings = [anchors[r] for r in rep_row.tolist()]
    lengths, hist, divisor = _char_profiles(strings)
    first, second, lower = _candidate_pairs(node_uid, lengths, hist, divisor, similarity_thresh)
    # Round 1: each node checks its most promising candidate (smallest bound), which links most near
    # duplicates. Round 2 checks only the candidates whose ends are still in different components: pairs
    # inside one component cannot change the partition, so skipping them keeps the result exact.
    order = torch.argsort(lower, stable=True)  # rank -> pair
    ranks = torch.arange(order.numel(), dtype=torch.int64).repeat(2)
    best = torch.full((num_nodes,), order.numel(), dtype=torch.int64)
    best = best.scatter_reduce(0, torch.cat([first[order], second[order]]), ranks, reduce="amin")
    round1 = order[torch.from_numpy(np.unique(best[best < order.numel()].numpy()))]
    linked1 = _links(strings, first[round1], second[round1], lengths, similarity_thresh)
    component = connected_components(num_nodes, first[round1][linked1], second[round1][linked1])
    rest = torch.ones(first.numel(), dtype=torch.bool)
    rest[round1] = False
    rest &= component[first] != component[second]
    first2, second2 = first[rest], second[rest]
    if first2.numel():  # sharper (bigram) bound before the costly exact checks, see module doc
        total = lengths[first2] + lengths[second2]
        keep = _bigram_lower_bound(strings, first2, second2, divisor) <= max_linked_distance(total, similarity_thresh)
        first2, second2 = first2[keep], second2[keep]
    linked2 = _links(strings, first2, second2, lengths, similarity_thresh)
    src = torch.cat([first[round1][linked1], first2[linked2]])
    dst = torch.cat([second[round1][linked1], second2[linked2]])
    component = connected_components(num_nodes, src, dst)  # (num_nodes,)
    return renumber_by_first_appearance(component[node_of_row])


def anchor_state_groups(
    uid_index: torch.Tensor,
    anchors: Sequence[object],
    *,
    enable_similarity: bool,
    similarity_thresh: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step groups of GiGPO (Sec. 4.2), exact or similarity mode (see module doc).

    Args:
        uid_index: int64 (R,), uid code per row.
        anchors: R anchors (str or numpy array; str only in similarity mode).
        enable_similarity: similarity mode instead of exact keys.
        similarity_thresh: link threshold in (0, 1), used in similarity mode.
    Returns:
        ``(step_group_id, step_group_size)``: int64 (R,) each.
    Raises:
        ValueError: ``len(anchors) != len(uid_index)``.
        TypeError: unsupported anchor type.
    """
    if len(anchors) != uid_index.numel():
        raise ValueError(f"{len(anchors)} anchors for {uid_index.numel()} rows")
    if enable_similarity:
        group = similarity_anchor_groups(uid_index, anchors, similarity_thresh)
    else:
        group = exact_anchor_groups(uid_index, anchor_keys(anchors))
    size = torch.bincount(group)[group] if group.numel() else group.clone()
    return group, size
