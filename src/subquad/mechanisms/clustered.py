"""Clustered attention (Vyas, Katharopoulos & Fleuret 2020); its improved form builds on it
(``mechanisms.improved_clustered``).

**Clustered** (§3.2, eq. 3–6). The L queries of each (batch, head) are grouped into C clusters;
each cluster's centroid is the mean of its queries, ``Q^c_j = Σ_{i∈j} Q_i / |j|`` (eq. 3). The
centroids attend once, ``A^c = softmax(Q^c Kᵀ · scale)`` (C × S, eq. 4), ``V^c = A^c V`` (eq. 5),
and every query takes its cluster's row, ``V̂_i = V^c_{c(i)}`` (eq. 6). Cost O(L·C·D + C·S·D).

**Grouping.** The paper (§3.2.2) hashes the queries with B sign-of-random-projection bits and runs
Lloyd's k-means in Hamming space: the assignment step takes the centroid code with the fewest
differing bits, the update step each bit's majority vote (the Hamming-space median; a tied bit keeps
its value). With ``hash_offsets`` each hyperplane is shifted by a random offset relative to the
spread of the queries' projections (``μ_b + σ_b·u_b``), so a bit separates two queries with a
probability that grows with their projected distance and Hamming distance tracks L2 distance;
without, the planes pass through the origin (SimHash: the angle only). That is ``kmeans="hamming"``.

The default, ``kmeans="euclidean"``, runs Lloyd directly on the query vectors (squared L2, mean
update). Measured on clustered inputs it approximates attention several times better at the same
number of clusters (32 bits cannot keep nearby groups of queries apart), and it is as fast here:
a distance is one fused matmul either way, and it needs no hashing pass. Both metrics share:

- Initialisation by D² sampling (k-means++, in a few batched rounds as in k-means||), so
  well-separated groups of queries are not merged by an unlucky uniform draw.
- ``fit_per_cluster``: the centroids are fitted on a seeded random sample of that many real queries
  per cluster, then every query is assigned to its nearest centroid (0 fits on all queries, as the
  paper does). The attention centroids are the means of eq. 3 over *all* members either way.
- Lloyd stops early once an assignment step changes nothing: a fixed point, so the result equals
  that of all ``iterations`` steps.
- Padded queries (``query_padding_mask``) take no part in the fitting or the centroids and return
  zeros.

**Reproducibility.** The hash planes and offsets are buffers of ``ClusteredState``, drawn once from
the layer's seed. The initial centroids and the fitting sample come from a counter-based hash of
(seed, head, position): a row's clusters depend only on its own queries, not on the batch, the
grouping of rows or global RNG state. The same inputs always give the same outputs. Without a
state, seed 0 is used.

**Degenerate settings.** ``clusters >= L`` gives every query its own cluster, which is exact full
attention; ``topk >= S`` makes improved-clustered exact (``m̂ = 1``). Both are clamped, not errors.

**Implementation.** Everything is batched over (batch × head) rows, in groups of rows sized so the
(C × S) centroid scores stay a few MB (large temporaries cost page faults on every call). Hamming
distances are one matmul of ±1 codes; the nearest centroid is found with a max, not an argmax, by
folding ``−j/2^p`` into the dot products (exact integers plus a tag, so ``amax`` identifies the
lowest-indexed nearest centroid). The exact re-scoring of improved-clustered sorts the queries by
cluster and cuts each cluster into tiles of ``TUNING.clustered_tile`` queries that share the cluster's k keys: one
batched matmul per step, with no (L × k × D) gather. Half-precision inputs are computed in fp32.

There is no causal form: the paper defines none (a centroid averages queries from the whole
sequence), so ``is_causal=True`` raises and names the mechanisms that have one.
"""

from __future__ import annotations

from torch import Tensor, nn

from subquad.ops.query_clusters import (
    ClusteredConfig,
    ClusteredState,
    cluster_queries,
    clustered_outputs,
    exactly_full,
)
from subquad.registry import Mechanism

__all__ = [
    "ClusteredConfig",
    "ClusteredState",
    "cluster_queries",
    "clustered_attention",
]


def clustered_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: ClusteredConfig | None = None,
    state: nn.Module | None = None,
    query_padding_mask: Tensor | None = None,
) -> Tensor:
    """Clustered attention (eq. 3–6): each query gets its cluster centroid's attention output.

    Args:
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        key_padding_mask: bool ``(B, S)``, True marks a real key.
        is_causal: must be False; there is no causal form.
        scale: default ``D ** -0.5``.
        config: ``ClusteredConfig``.
        state: ``ClusteredState`` with the hash planes and seed; seed 0 when None.
        query_padding_mask: bool ``(B, L)``, True marks a real query; padded queries are left out
            of the clustering and return zeros. Layers pass the key mask here in self-attention.

    Returns:
        ``(B, H, L, Dv)``.
    """
    config = config or ClusteredConfig()
    if type(config) is not ClusteredConfig:
        raise ValueError(
            f"clustered needs a ClusteredConfig, got {type(config).__name__}; clustered and improved-clustered "
            "each take their own config"
        )
    return clustered_outputs(q, k, v, key_padding_mask, is_causal, scale, config, state, query_padding_mask)


PAPER = "Vyas, Katharopoulos & Fleuret 2020, Fast Transformers with Clustered Attention"
CLUSTERED = Mechanism(
    name="clustered",
    fn=clustered_attention,
    config=ClusteredConfig,
    summary="queries grouped by k-means (or LSH + Hamming k-means); one softmax per centroid, broadcast back",
    paper=f"{PAPER}, §3.2 eq. 3-6",
    causal=False,
    tensor_args=("query_padding_mask",),
    groups_queries=True,
    state=ClusteredState,
    exact_full=exactly_full,
    plain_backward=True,
    examples=(
        {},
        {"clusters": 3},
        {"clusters": 2, "kmeans": "hamming", "bits": 8, "iterations": 3},
        {"clusters": 5, "fit_per_cluster": 0},
    ),
)

MECHANISM = CLUSTERED
