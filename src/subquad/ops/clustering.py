"""k-means for attention: Lloyd's iterations in Hamming or Euclidean space, and D² seeding.

Clustered attention (Vyas et al. 2020) groups queries with these (routing's online spherical
k-means is ``ops.spherical``). Every function is batched over G independent rows (batch × head):
points are ``(G, N, F)``, assignments ``(G, N)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from subquad.kernels.memory import kept_buffer
from subquad.ops.hashing import position_uniforms

__all__ = [
    "SEED_ROUNDS",
    "Euclidean",
    "Hamming",
    "cluster_counts",
    "cluster_sums",
    "first_argmax_",
    "flat_clusters",
    "gather_rows",
    "lloyd",
    "seed_and_assign",
    "seed_centroids",
    "seed_draws",
    "sign_codes",
]

SEED_ROUNDS = 4  # rounds of D² sampling that choose the initial centroids


class Hamming:
    """Lloyd's k-means in Hamming space over ±1 codes ``(G, N, B)``: the nearest centroid has the
    fewest differing bits, and a centroid bit is its members' majority vote (a tie keeps it)."""

    def __init__(self, codes: Tensor) -> None:
        self.points = codes
        G, N, _ = codes.shape
        # Codes, transposed, with a row of ones that multiplies each centroid's tag (see nearest).
        self.points_t = torch.cat([codes, codes.new_ones(G, N, 1)], dim=-1).transpose(1, 2).contiguous()

    def subset(self, index: Tensor) -> Hamming:
        return Hamming(gather_rows(self.points, index))

    def distances(self, centroids: Tensor) -> Tensor:
        """``(G, r, N)`` differing bits to ``r`` centroids."""
        return (self.points.shape[-1] - self.scores(centroids)) * 0.5

    def scores(self, centroids: Tensor) -> Tensor:
        """``(G, r, N)`` dot products of the codes, larger for nearer: the nearest centroid has the
        largest (``distance_of`` its maximum is the distance to it)."""
        return torch.bmm(centroids, self.points_t[:, :-1])

    def distance_of(self, best: Tensor) -> Tensor:
        """Differing bits from the largest dot product ``best`` ``(G, N)``, in place."""
        return best.sub_(self.points.shape[-1]).mul_(-0.5)

    def nearest_distance(self, centroids: Tensor) -> Tensor:
        """``(G, N)`` differing bits to the nearest of ``r`` centroids: ``distances(...).amin(1)``
        from the largest dot product."""
        return self.distance_of(self.scores(centroids).amax(1))

    def nearest(self, centroids: Tensor) -> Tensor:
        # Hamming distance = (B − dot) / 2, so the nearest code has the largest dot. Tagging centroid
        # j with −j/2^p (p bits hold any j < C) makes the max of dot − j/2^p the largest dot at its
        # lowest j, read back from the fraction: exact in fp32 while (B + 1)·2^p < 2^24, and only
        # when matmuls run in full fp32 (TF32 or bf16 matmuls would round the tags).
        G, C, B = centroids.shape
        p = max(1, math.ceil(math.log2(C)))
        if (B + 1) * 2**p >= 2**24 or torch.get_float32_matmul_precision() != "highest":
            return first_argmax_(torch.bmm(centroids, self.points_t[:, :-1]), 1)
        tag = -torch.arange(C, dtype=centroids.dtype, device=centroids.device) * 2.0**-p
        tagged = torch.cat([centroids, tag.view(1, C, 1).expand(G, C, 1)], dim=-1)  # (G, C, B + 1)
        best = torch.bmm(tagged, self.points_t).amax(1)  # (G, N): max_j dot_j − j/2^p
        return ((torch.ceil(best) - best) * 2.0**p).round_().long()

    def members(self, weight: Tensor | None) -> Tensor:
        """What ``update`` sums: the codes times their weight (0 for padded points, which do not
        vote); None: every point is real."""
        return self.points if weight is None else self.points * weight.unsqueeze(-1)

    def update(self, centroids: Tensor, assign: Tensor, members: Tensor) -> Tensor:
        votes = cluster_sums(members, assign, centroids.shape[1])
        return torch.where(votes > 0, 1.0, torch.where(votes < 0, -1.0, centroids))


class Euclidean:
    """Lloyd's k-means under squared L2 on the vectors ``(G, N, D)``: the mean update. An empty
    cluster keeps its centroid."""

    def __init__(self, x: Tensor) -> None:
        self.points = x
        self._norms: Tensor | None = None

    def subset(self, index: Tensor) -> Euclidean:
        return Euclidean(gather_rows(self.points, index))

    def scores(self, centroids: Tensor, out: Tensor | None = None) -> Tensor:
        """``(G, r, N)`` c·x − ‖c‖²/2, larger for nearer, centroids by points: one ``baddbmm`` on the
        points' transposed view (no copy). With N innermost the product runs about twice as fast on
        CPU as points by centroids, and reductions over r vectorise along N."""
        half_norms = centroids.square().sum(-1, keepdim=True).mul_(-0.5)
        return torch.baddbmm(half_norms, centroids, self.points.transpose(1, 2), out=out)

    def _point_norms(self) -> Tensor:
        """``(G, 1, N)`` ‖x‖², the same for every call: seeding asks once per round."""
        if self._norms is None:
            self._norms = self.points.square().sum(-1).unsqueeze(1)
        return self._norms

    def distances(self, centroids: Tensor) -> Tensor:
        """``(G, r, N)`` squared distances to ``r`` centroids."""
        return (self._point_norms() - 2 * self.scores(centroids)).clamp_min(0)

    def distance_of(self, best: Tensor) -> Tensor:
        """Squared distance ``(G, N)`` from the largest score ``best``, in place: equal to the least
        of ``distances``, as rounding keeps ‖x‖² − 2·s monotone in s."""
        return best.mul_(-2).add_(self._point_norms().squeeze(1)).clamp_min_(0)

    def nearest_distance(self, centroids: Tensor) -> Tensor:
        """``(G, N)`` squared distance to the nearest of ``r`` centroids: ``distances(...).amin(1)``."""
        return self.distance_of(self.scores(centroids).amax(1))

    def nearest(self, centroids: Tensor) -> Tensor:
        """argmin ‖x − c‖² (the first on ties). Without autograd (k-means runs without), the scores
        go into a buffer the thread keeps: a fresh (G, C, N) each call was faulted in again."""
        out = None
        if not torch.is_grad_enabled():
            shape = (*centroids.shape[:2], self.points.shape[1])
            out = kept_buffer("kmeans.scores", math.prod(shape), centroids.dtype, centroids.device).view(shape)
        return first_argmax_(self.scores(centroids, out), 1)

    def members(self, weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """What ``update`` sums: the points times their weight, and the weight (padded points have
        weight 0 and do not count); None: every point is real, and the points are summed as they
        are (no copy)."""
        if weight is None:
            return self.points, None
        w = weight.to(self.points.dtype)
        return self.points * w.unsqueeze(-1), w

    def update(self, centroids: Tensor, assign: Tensor, members: tuple[Tensor, Tensor | None]) -> Tensor:
        points, weight = members
        C = centroids.shape[1]
        sums = cluster_sums(points, assign, C)
        counts = cluster_counts(assign, C, weight, points.dtype).unsqueeze(-1)
        return torch.where(counts > 0, sums / counts.clamp_min(1), centroids)


def first_argmax_(scores: Tensor, dim: int, top: Tensor | None = None) -> Tensor:
    """The index of the first maximum of ``scores`` along ``dim`` (long), overwriting ``scores``;
    ``top``: their maximum along ``dim`` (kept), when the caller has it.

    On CPU, ``max(dim).indices`` and ``argmax`` reduce about ten times slower than ``amax``: this
    takes two ``amax`` and two in-place passes instead, as ``n − max_j (n − j)·[s_j = max]``. A row
    holding NaN gives index ``n − 1`` (in range; such rows are the caller's to mask).
    """
    n = scores.shape[dim]
    weight = torch.arange(n, 0, -1, dtype=scores.dtype, device=scores.device)
    weight = weight.view([n if d == dim % scores.dim() else 1 for d in range(scores.dim())])
    top = scores.ge_(scores.amax(dim, keepdim=True) if top is None else top).mul_(weight).amax(dim)
    return (n - top).clamp_(max=n - 1).long()


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows ``x[g, index[g]]``: ``(G, N, F)`` by ``(G, n)`` -> ``(G, n, F)``. An ``index_select`` of
    whole rows of the ``(G·N, F)`` matrix: on CPU several times faster than ``gather`` along dim 1,
    which indexes element by element."""
    G, N, F_ = x.shape
    flat = (index + torch.arange(G, device=x.device).unsqueeze(-1) * N).reshape(-1)
    return x.reshape(G * N, F_).index_select(0, flat).view(G, index.shape[1], F_)


def flat_clusters(assign: Tensor, C: int) -> Tensor:
    """``assign`` ``(G, N)`` as indices ``(G·N,)`` into the G rows' C clusters each, flattened (G·C)."""
    return (assign + (torch.arange(assign.shape[0], device=assign.device) * C).unsqueeze(-1)).view(-1)


def cluster_sums(x: Tensor, assign: Tensor, C: int) -> Tensor:
    """Per-cluster sums ``(G, C, F)`` of ``x`` ``(G, N, F)`` under ``assign`` ``(G, N)``."""
    G, N, F = x.shape
    if x.device.type != "cpu":  # index_add uses atomics there: a one-hot matmul is deterministic
        return torch.bmm(torch.nn.functional.one_hot(assign, C).to(x.dtype).transpose(1, 2), x)
    return x.new_zeros(G * C, F).index_add(0, flat_clusters(assign, C), x.reshape(G * N, F)).view(G, C, F)


def cluster_counts(assign: Tensor, C: int, weight: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Per-cluster counts ``(G, C)`` of ``assign`` ``(G, N)``, each point counted with its ``weight``
    ``(G, N)`` (None: 1), in ``dtype``."""
    G, N = assign.shape
    if assign.device.type != "cpu":  # deterministic there too
        ones = torch.ones(G, N, 1, dtype=dtype, device=assign.device) if weight is None else weight.unsqueeze(-1)
        return cluster_sums(ones.to(dtype), assign, C).squeeze(-1)
    w = None if weight is None else weight.reshape(-1).to(dtype)
    return torch.bincount(flat_clusters(assign, C), weights=w, minlength=G * C).to(dtype).view(G, C)


def seed_draws(weight: Tensor, positions: Tensor, C: int, seed: int, heads: Tensor) -> tuple[Tensor, Tensor]:
    """The random part of ``seed_centroids``, a fixed function of (seed, head, position, weight).

    Args:
        weight: ``(G, N)`` 1 for real points, 0 for padded ones.
        positions: ``(G, N)`` each point's position in its sequence (what its draws hash).
        C: the number of centroids.
        seed: the layer's seed; ``heads``: ``(G,)`` each row's head.

    Returns:
        The first round's picks ``(G, s)``, uniform among the real points, and per later round
        ``(rounds − 1, G, N)`` factors ``E^(−1/2)``, ``E ~ Exp(1)``: a point's Gumbel-top-k key for
        probability ∝ d² is ``d · E^(−1/2)`` (the order of ``2·log d − log E``, without the logs).
    """
    sizes = _round_sizes(C)
    uniforms = position_uniforms(seed, heads, positions, range(1, len(sizes) + 1))  # (rounds, G, N)
    first = torch.where(weight > 0, uniforms[0], 2.0).topk(sizes[0], dim=1, largest=False).indices  # real points first
    return first, uniforms[1:].log_().neg_().rsqrt_()


def _round_sizes(C: int) -> list[int]:
    """Centroids drawn in each of the (at most ``SEED_ROUNDS``) rounds of D² sampling."""
    per_round = -(-C // min(C, SEED_ROUNDS))
    return [min(per_round, C - start) for start in range(0, C, per_round)]


def seed_centroids(metric: Hamming | Euclidean, weight: Tensor | None, C: int, draws: tuple[Tensor, Tensor]) -> Tensor:
    """``(G, C)`` indices of C distinct initial centroids, by D² sampling in ``SEED_ROUNDS`` rounds.

    The first round draws uniformly among real points; each later round draws a batch without
    replacement with probability ∝ d², by Gumbel-top-k, where d is ``metric.distances`` to the
    nearest centroid so far: a squared L2 distance for Euclidean (so ∝ ‖x − c‖⁴, greedier than
    k-means++'s ‖x − c‖²), differing bits for Hamming. It is k-means++ (Arthur & Vassilvitskii 2007)
    with several draws per round, as in k-means||: points of clusters that hold no centroid yet are
    the likely draws, so well-separated groups are not merged by an unlucky uniform draw, and the
    rounds stay few and batched. ``draws`` come from ``seed_draws``. ``weight`` ``(G, N)``: 0 marks
    padded points, which are never drawn; None: every point is real.
    """
    return _seed(metric, weight, C, draws, assign=False)[0]


def seed_and_assign(
    metric: Hamming | Euclidean, weight: Tensor | None, C: int, draws: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """``seed_centroids``, and each point's nearest of the C initial centroids ``(G, N)`` (the first
    on ties), Lloyd's first assignment: each round's scores serve both, so the points meet every
    centroid once, in the seeding's products, not again in a product of all C. The rounds' scores
    are kept for one argmax at the end."""
    return _seed(metric, weight, C, draws, assign=True)


def _seed(
    metric: Hamming | Euclidean, weight: Tensor | None, C: int, draws: tuple[Tensor, Tensor], assign: bool
) -> tuple[Tensor, Tensor | None]:
    sizes = _round_sizes(C)
    first, factors = draws
    picks = [first]
    padded = None if weight is None else weight == 0
    best = None  # (G, N): the largest score so far
    kept = []  # with assign, each round's scores, in the order of the picks
    for r, size in enumerate(sizes):
        if r > 0:  # draw this round's centroids ∝ d², by Gumbel-top-k
            keys = metric.distance_of(best.clone()).mul_(factors[r - 1])  # ≥ 0 for real points
            if padded is not None:
                keys.masked_fill_(padded, -1.0)
            picks.append(keys.topk(size, dim=1).indices)
        if r == len(sizes) - 1 and not assign:
            break
        scores = metric.scores(gather_rows(metric.points, picks[-1]))  # (G, size, N)
        top = scores.amax(1)
        best = top if best is None else torch.maximum(best, top)
        if assign:
            kept.append(scores)
    # one first argmax over all the rounds' scores: fewer passes than one per round
    nearest = first_argmax_(torch.cat(kept, dim=1), 1, best.unsqueeze(1)) if assign else None
    return torch.cat(picks, dim=1), nearest


def lloyd(
    metric: Hamming | Euclidean,
    weight: Tensor | None,
    init: Tensor,
    iterations: int,
    everyone: Hamming | Euclidean | None = None,
    assign: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Lloyd's iterations from the points at ``init``; stops at a fixed point. Returns the centroids
    and the assignment of ``metric``'s points to them or, given ``everyone`` (all the points, of
    which ``metric`` holds a sample), of everyone's: then the last step assigns all of them at once,
    one product where the sample's and then the others' would be two. ``weight`` ``(G, N)``: 0 for
    padded points, which do not move the centroids; None: every point is real. ``assign``: the
    points' nearest initial centroids, when the seeding found them (``seed_and_assign``)."""
    centroids = gather_rows(metric.points, init)
    if iterations == 0 and everyone is not None:
        return centroids, everyone.nearest(centroids)
    if assign is None:
        assign = metric.nearest(centroids)
    members = metric.members(weight)
    for step in range(iterations):
        centroids = metric.update(centroids, assign, members)
        if step == iterations - 1 and everyone is not None:
            return centroids, everyone.nearest(centroids)
        new = metric.nearest(centroids)
        if torch.equal(new, assign):
            break
        assign = new
    return centroids, (assign if everyone is None else everyone.nearest(centroids))


def sign_codes(q: Tensor, weight: Tensor, planes: Tensor, offsets: Tensor | None) -> Tensor:
    """±1 codes ``(G, L, B)``: the sign of each query's projection on each plane, minus its threshold.

    With ``offsets`` ``(G, B)`` the threshold of plane b is ``μ_b + σ_b·u_b``: the mean and spread
    of the real queries' projections, shifted by the plane's fixed random offset ``u_b``.
    """
    proj = torch.bmm(q, planes)  # (G, L, B)
    if offsets is not None:
        count = weight.sum(1).clamp_min(1).view(-1, 1, 1)
        w = weight.unsqueeze(-1)
        mean = (proj * w).sum(1, keepdim=True) / count
        std = (((proj - mean) * w).square().sum(1, keepdim=True) / count).sqrt()
        proj = proj - (mean + std * offsets.unsqueeze(1))
    return torch.where(proj > 0, 1.0, -1.0).to(torch.float32)
