"""The epoch permutation (rng.permutation_at and the C kernel _rng.permute): the definition
against a reference written here from the documented construction, bijectivity (exhaustive
up to 2**20, sampled to 2**40 through the reference's inverse), and shuffle quality by
chi-square over many keys, with proof that the same tests reject weak permutations.

The quality tests draw one permutation per key (a seed, or an epoch) and test what a uniform
random permutation implies, with scipy's chi-square distribution as the reference:
* position uniformity: the sample at a position is uniform over [0, n);
* pairwise independence: the samples at two positions are a uniform pair of distinct values;
* epochs: the position of a sample in epoch e + 1 is independent of its position in epoch e.
Keys are fixed, so every p-value is fixed too: a pass cannot turn into a flaky failure.
"""

import numpy as np
import pytest

from dpu_pipe import ConfigError, rng

_rng = pytest.importorskip("dpu_pipe._rng", reason="Cython kernels not built")
stats = pytest.importorskip("scipy.stats")

# Below this, a chi-square p-value fails a good permutation (after a Bonferroni correction
# for the tests of one function); a weak one must land below REJECT.
ALPHA = 1e-4
REJECT = 1e-12


# --- a reference, written from rng.py's description ---------------------------------------------

def _round_fn(seed, epoch, right, r):
    """F_r: first 64-bit word of block (seed, epoch, index=right, STREAM_SHUFFLE, r)."""
    return rng.random_u64(seed, epoch, right, rng.STREAM_SHUFFLE, r)[..., 0]


def _domain(n):
    bits = max(8, (n - 1).bit_length())
    return bits // 2, bits - bits // 2


def reference(pos, n, seed, epoch, rounds=8):
    """Feistel network over [0, 2**bits) with halves swapping widths, cycle-walked into
    [0, n); uint64 arrays broadcast. ``rounds`` below 8 makes the weak variants."""
    pos, seed, epoch = np.broadcast_arrays(np.asarray(pos, np.uint64), np.asarray(seed, np.uint64),
                                           np.asarray(epoch, np.uint64))
    out = pos.reshape(-1).copy()
    seed, epoch = seed.reshape(-1), epoch.reshape(-1)
    if n == 1:
        return np.zeros(pos.shape, np.int64)
    todo = np.arange(out.size)
    while todo.size:
        a, b = _domain(n)
        x = out[todo]
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)
        for r in range(rounds):
            f = (left ^ _round_fn(seed[todo], epoch[todo], right, r)) & np.uint64((1 << a) - 1)
            left, right = right, f
            a, b = b, a
        out[todo] = (left << np.uint64(b)) | right
        todo = todo[out[todo] >= np.uint64(n)]
    return out.astype(np.int64).reshape(pos.shape)


def reference_inverse(values, n, seed, epoch, rounds=8):
    """The position that holds each sample index: the inverse network, cycle-walked."""
    out = np.asarray(values, np.uint64).reshape(-1).copy()
    todo = np.arange(out.size)
    while todo.size:
        a, b = _domain(n)
        if rounds % 2:
            a, b = b, a
        # after the forward rounds the left half has width a, the right half b
        x = out[todo]
        left, right = x >> np.uint64(b), x & np.uint64((1 << b) - 1)
        for r in reversed(range(rounds)):
            # forward: (L, R) -> (R, L ^ F_r(R)) with |L| = w; here left = R, right = L ^ F
            f = _round_fn(seed, epoch, left, r) & np.uint64((1 << b) - 1)
            left, right = right ^ f, left
            a, b = b, a
        out[todo] = (left << np.uint64(b)) | right
        todo = todo[out[todo] >= np.uint64(n)]
    return out.astype(np.int64).reshape(np.shape(values))


# --- the definition -----------------------------------------------------------------------------

# n = 2: the reference walks each value's cycle through a 256-value domain until it lands
# below 2, about 10 s here; the slow tier checks it.
SIZES = [1, pytest.param(2, marks=pytest.mark.slow), 255, 256, 257, 1000, 65537, 2**20 + 7,
         10**9, 2**40 - 1, 2**40, 2**62]


@pytest.mark.parametrize("n", SIZES)
def test_twins_and_reference_agree(n):
    g = np.random.default_rng(n % 1000)
    pos = np.unique(np.concatenate([[0, n - 1], g.integers(0, n, 300)]))
    for seed, epoch in ((0, 0), (2**64 - 1, 2**32 - 1), (12345, 7)):
        want = reference(pos, n, seed, epoch)
        assert np.array_equal(rng.permutation_at(pos, n, seed, epoch), want)
        got = _rng.permute(pos, n, seed, epoch)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    if n < 255:
        return   # numpy's cycle-walk over a 256-value domain is slow; the twins agree above
    # per-element keys (the kernel's other path) against the same definition
    seeds = g.integers(0, 2**63, pos.size, dtype=np.uint64)
    epochs = g.integers(0, 2**32, pos.size, dtype=np.uint64)
    assert np.array_equal(_rng.permute(pos, n, seeds, epochs), reference(pos, n, seeds, epochs))
    assert np.array_equal(rng.permutation_at(pos, n, seeds, epochs),
                          reference(pos, n, seeds, epochs))


def test_reference_inverse_inverts():
    for n in (3, 256, 1001, 2**21 + 1):
        pos = np.arange(min(n, 3000))
        assert np.array_equal(reference_inverse(reference(pos, n, 9, 4), n, 9, 4), pos)


def test_bad_arguments():
    for fn in (rng.permutation_at, _rng.permute):
        with pytest.raises(ConfigError, match="n must be"):
            fn([0], 0, 0, 0)
        with pytest.raises(ConfigError, match="n must be"):
            fn([0], 2**62 + 1, 0, 0)
        with pytest.raises(ConfigError, match="positions"):
            fn([5], 5, 0, 0)
        with pytest.raises(ConfigError, match="position"):
            fn([-1], 5, 0, 0)
        with pytest.raises(ConfigError, match="seed"):
            fn([0], 5, -1, 0)
        with pytest.raises(ConfigError, match="epoch"):
            fn([0], 5, 0, 2**32)


# --- bijectivity --------------------------------------------------------------------------------

PRIMES = [5, 13, 251, 257, 65521, 65537, 999983, 1048573]
EXHAUSTIVE = sorted(set(list(range(1, 300)) + PRIMES
                        + [2**k + d for k in range(1, 21) for d in (-1, 0, 1)]))
KEYS = [(0, 0), (2**64 - 1, 1), (0xDEADBEEF, 2**32 - 1)]


@pytest.mark.slow
def test_bijective_exhaustively_up_to_two_to_the_twenty():
    """Every position of every listed n (1..299, primes, 2**k - 1, 2**k, 2**k + 1 up to
    2**20 + 1) under three keys: each sample index exactly once."""
    for n in EXHAUSTIVE:
        pos = np.arange(n)
        for seed, epoch in KEYS[:1] if n > 300 and n not in PRIMES else KEYS:
            p = _rng.permute(pos, n, seed, epoch)
            counts = np.bincount(p, minlength=n)
            assert counts.size == n and (counts == 1).all(), (n, seed, epoch)


@pytest.mark.parametrize("n", [2**20 + 3, 10**9 + 7, 2**39 + 1, 2**40 - 1, 2**40])
def test_bijective_sampled_beyond(n):
    """Beyond 2**20: sampled positions (spread out, and one contiguous run) map into [0, n)
    and back through the reference's inverse network — no two positions can share a
    sample when each sample's position is recovered."""
    g = np.random.default_rng(n % 7919)
    pos = np.concatenate([g.integers(0, n, 2000), np.arange(n - 1000, n), np.arange(1000)])
    for seed, epoch in KEYS[1:]:
        p = _rng.permute(pos, n, seed, epoch)
        assert p.min() >= 0 and p.max() < n
        assert np.array_equal(reference_inverse(p, n, seed, epoch), pos)
    run = _rng.permute(np.arange(2**18) + n // 3, n, 7, 7)
    assert len(np.unique(run)) == run.size


# --- shuffle quality ----------------------------------------------------------------------------

K = 20000   # keys per quality test
SEEDS = (np.arange(K, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) + np.uint64(11)


def library(pos, n, seed, epoch):
    return _rng.permute(pos, n, seed, epoch)


def affine(pos, n, seed, epoch):
    """p -> (a p + b) mod n, a coprime to n, (a, b) from the key: a bijection, not a shuffle."""
    w = rng.random_u64(seed, epoch, 0, rng.STREAM_USER)
    a = (w[..., 0] % np.uint64(n)).astype(np.int64)
    a = np.where(np.gcd(a, n) == 1, a, 1)
    b = (w[..., 1] % np.uint64(n)).astype(np.int64)
    return (a * np.asarray(pos, np.int64) + b) % n


def two_rounds(pos, n, seed, epoch):
    return reference(pos, n, seed, epoch, rounds=2)


def one_round(pos, n, seed, epoch):
    return reference(pos, n, seed, epoch, rounds=1)


def rotating_epochs(pos, n, seed, epoch):
    """A good permutation of epoch 0 whose order moves by one place each epoch."""
    shifted = (np.asarray(pos, np.int64) + np.asarray(epoch, np.int64)) % n
    return _rng.permute(shifted, n, seed, 0)


def _bins(values, n, nbins):
    edges = (np.arange(nbins + 1) * n) // nbins
    return np.searchsorted(edges, values, side="right") - 1, np.diff(edges)


def position_pvalues(perm, n, keys="seeds", positions=None, nbins=16):
    """For each position: chi-square p-value of the sample found there over K keys."""
    positions = np.array(positions if positions is not None else
                         sorted({0, 1, 2, n // 2, n - 1} & set(range(n))))
    seed, epoch = (SEEDS[:, None], 5) if keys == "seeds" else (1234, np.arange(K)[:, None])
    got = perm(positions[None, :], n, seed, epoch)
    nb = min(n, nbins)
    b, size = _bins(got, n, nb)
    out = []
    for c in range(len(positions)):
        counts = np.bincount(b[:, c], minlength=nb)
        out.append(stats.chisquare(counts, K * size / n).pvalue)
    return np.array(out)


def pair_pvalues(perm, n, keys="seeds", pairs=None, nbins=16):
    """For each pair of positions: chi-square p-value of the pair of samples found there over
    K keys, against a uniform pair of distinct values (values binned when n > nbins)."""
    pairs = pairs or [(0, 1), (0, n // 2), (1, n - 1), (n // 3, n // 3 + 1)]
    pairs = [(p, q) for p, q in pairs if p != q and max(p, q) < n]
    seed, epoch = (SEEDS[:, None], 5) if keys == "seeds" else (1234, np.arange(K)[:, None])
    pos = np.array(sorted({p for pq in pairs for p in pq}))
    got = perm(pos[None, :], n, seed, epoch)
    col = {p: i for i, p in enumerate(pos)}
    nb = min(n, nbins)
    b, size = _bins(got, n, nb)
    expected = (np.outer(size, size) - np.diag(size)) / (n * (n - 1)) * K
    keep = expected > 0
    out = []
    for p, q in pairs:
        counts = np.bincount(b[:, col[p]] * nb + b[:, col[q]], minlength=nb * nb).reshape(nb, nb)
        out.append(stats.chisquare(counts[keep], expected[keep]).pvalue)
    return np.array(out)


def epoch_pvalue(perm, n, epochs=200, nbins=8):
    nbins = min(n, nbins)
    """Chi-square p-value of independence between where each sample sits in epoch e and in
    epoch e + 1 (positions binned), pooled over 20 seeds and ``epochs`` consecutive pairs;
    and the Pearson correlation of the two positions."""
    table = np.zeros((nbins, nbins))
    xs, ys = [], []
    for s in range(20):
        for e in range(0, epochs, 20):
            pos = np.arange(n)
            a, b = perm(pos, n, s, e), perm(pos, n, s, e + 1)
            inv_a, inv_b = np.empty(n, np.int64), np.empty(n, np.int64)
            inv_a[a], inv_b[b] = pos, pos      # position of each sample in each epoch
            ba, _ = _bins(inv_a, n, nbins)
            bb, _ = _bins(inv_b, n, nbins)
            table += np.bincount(ba * nbins + bb, minlength=nbins**2).reshape(nbins, nbins)
            xs.append(inv_a)
            ys.append(inv_b)
    p = stats.chi2_contingency(table, correction=False).pvalue
    return p, np.corrcoef(np.concatenate(xs), np.concatenate(ys))[0, 1]


QUALITY_SIZES = [2, 5, 16, 23, 1000, 2**20 + 1]


def _passes(pvalues, tests):
    return pvalues.min() > ALPHA / tests


@pytest.mark.slow
@pytest.mark.parametrize("n", QUALITY_SIZES)
def test_quality_positions_are_uniform(n):
    for keys in ("seeds", "epochs"):
        p = position_pvalues(library, n, keys)
        assert _passes(p, p.size), (keys, p)


@pytest.mark.slow
@pytest.mark.parametrize("n", QUALITY_SIZES[1:])
def test_quality_pairs_are_independent(n):
    for keys in ("seeds", "epochs"):
        p = pair_pvalues(library, n, keys)
        assert _passes(p, p.size), (keys, p)


@pytest.mark.slow
@pytest.mark.parametrize("n", [7, 1000, 65537])
def test_quality_consecutive_epochs_are_independent(n):
    epochs = 200 if n < 10**4 else 20
    p, r = epoch_pvalue(library, n, epochs=epochs)
    assert p > ALPHA, p
    assert abs(r) < 5 / np.sqrt(20 * (epochs // 20) * n), r


@pytest.mark.slow
def test_quality_tests_reject_weak_permutations():
    """Each weak permutation is a bijection of [0, n) yet fails a test the library passes."""
    for weak in (one_round, two_rounds, affine):
        for n in (16, 256, 1000):
            assert np.array_equal(np.sort(weak(np.arange(n), n, 3, 4)), np.arange(n))
    # one round leaves the right half in place: the value's high bits are the position's
    assert position_pvalues(one_round, 256).min() < REJECT
    assert pair_pvalues(two_rounds, 16).min() < REJECT
    assert pair_pvalues(affine, 16).min() < REJECT
    p, r = epoch_pvalue(rotating_epochs, 1000, epochs=40)
    assert p < REJECT and r > 0.9
