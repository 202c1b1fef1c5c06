/* Batched softmax attention on short sequences, fp32, x86-64 AVX2 + FMA: subquad's optional
 * native kernel (subquad.kernels.native compiles it on first use; nothing is compiled at install).
 *
 * Each of the n0·n1 items holds Lq queries, Lk keys and Lk values; an item's queries attend to
 * its keys under an optional additive mask and an optional causal flag (key j <= query i, top
 * left), as torch's CPU flash kernel does. Returns, per query, the normalised output and the
 * log-sum-exp of its scaled scores; a query that sees no key gets zeros and -inf.
 *
 * Layout: queries in vector lanes. A block of up to 32 queries is packed transposed and scaled,
 * Qt (D × 32); scores are computed transposed, St = K Qt (keys × 32), so the softmax of each
 * query runs down a column, eight queries per vector and no horizontal reduction; the output is
 * accumulated transposed, Ot = Vᵀ P (Dv × 32), and written back row by row. Both products use one
 * register tile, C(6 × 16) += A(6 × r) B(r × 16): 12 accumulators, 8 loads per 12 FMAs.
 *
 * Strides are in elements; the last dimension of every tensor is contiguous. The mask, when
 * given, is passed transposed (item, key, query), so that a key's row of it is read as a vector.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 32 /* queries per block */
#define NEG_INF (-INFINITY)

typedef struct {
    int64_t n0, n1, Lq, Lk, D, Dv;
    const float *q;
    int64_t q0, q1, qr;
    const float *k;
    int64_t k0, k1, kr;
    const float *v;
    int64_t v0, v1, vr;
    const float *m; /* additive mask, transposed: (item, key, query); NULL when none */
    int64_t m0, m1, mk;
    float *o;
    int64_t o0, o1, orow;
    float *l;
    int64_t l0, l1, lrow;
    int causal;
    float scale;
    int merge; /* merge into the softmax that o and l already hold (over other keys), not overwrite */
    int64_t first, last; /* this thread's tasks: (item, query block) pairs */
    int failed;
} Job;

/* exp(x) for x <= 0 (scores minus their maximum), 0 below about -88 and for -inf; NaN stays NaN
 * (max_ps returns its second operand when either is NaN), as torch's kernel lets it through. */
static inline __m256 exp_nonpositive(__m256 x) {
    __m256 t = _mm256_max_ps(_mm256_set1_ps(-127.0f), _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n); /* [-0.5, 0.5]: 2^f by its Taylor series to degree 7 */
    __m256 p = _mm256_set1_ps(1.5252733804059840e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284770e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    /* 2^n through the exponent bits; n = -127 gives the bits of +0 */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Transposes the 8 × 8 block r[0..7] in place. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* C[a][0:16] (+)= sum_r A[a·sa + r·sr] · B[r·ldb + 0:16] for a < ROWS, r < depth. */
#define TILE(ROWS)                                                                                       \
    static inline void tile##ROWS(const float *A, int64_t sa, int64_t sr, const float *B, int64_t ldb, \
                                  int64_t depth, float *C, int64_t ldc, int accumulate) {              \
        __m256 c[ROWS][2];                                                                             \
        for (int a = 0; a < ROWS; a++) {                                                               \
            c[a][0] = accumulate ? _mm256_loadu_ps(C + a * ldc) : _mm256_setzero_ps();                 \
            c[a][1] = accumulate ? _mm256_loadu_ps(C + a * ldc + 8) : _mm256_setzero_ps();             \
        }                                                                                              \
        for (int64_t r = 0; r < depth; r++) {                                                          \
            __m256 b0 = _mm256_loadu_ps(B + r * ldb), b1 = _mm256_loadu_ps(B + r * ldb + 8);           \
            for (int a = 0; a < ROWS; a++) {                                                           \
                __m256 x = _mm256_broadcast_ss(A + a * sa + r * sr);                                   \
                c[a][0] = _mm256_fmadd_ps(x, b0, c[a][0]);                                             \
                c[a][1] = _mm256_fmadd_ps(x, b1, c[a][1]);                                             \
            }                                                                                          \
        }                                                                                              \
        for (int a = 0; a < ROWS; a++) {                                                               \
            _mm256_storeu_ps(C + a * ldc, c[a][0]);                                                    \
            _mm256_storeu_ps(C + a * ldc + 8, c[a][1]);                                                \
        }                                                                                              \
    }
TILE(6)
TILE(4)
TILE(2)
TILE(1)

/* C (rows × 16·halves) = A B over `depth`: tiles of 6 rows (12 accumulators, enough to hide the
 * FMA latency), then of 4, 2 and 1 for the rest. */
static void product_part(const float *A, int64_t sa, int64_t sr, const float *B, int64_t ldb, int64_t depth, float *C,
                         int64_t ldc, int64_t rows, int halves, int acc) {
    int64_t a = 0;
    for (; a + 6 <= rows; a += 6)
        for (int h = 0; h < halves; h++) tile6(A + a * sa, sa, sr, B + 16 * h, ldb, depth, C + a * ldc + 16 * h, ldc, acc);
    for (; a + 4 <= rows; a += 4)
        for (int h = 0; h < halves; h++) tile4(A + a * sa, sa, sr, B + 16 * h, ldb, depth, C + a * ldc + 16 * h, ldc, acc);
    for (; a + 2 <= rows; a += 2)
        for (int h = 0; h < halves; h++) tile2(A + a * sa, sa, sr, B + 16 * h, ldb, depth, C + a * ldc + 16 * h, ldc, acc);
    for (; a < rows; a++)
        for (int h = 0; h < halves; h++) tile1(A + a * sa, sa, sr, B + 16 * h, ldb, depth, C + a * ldc + 16 * h, ldc, acc);
}

/* The same, the depth taken DEPTH at a time, so that the slices of A and B that the tiles read
 * again and again stay in the L1 cache (a long product over keys would stream them from L2). */
#define DEPTH 64
static void product(const float *A, int64_t sa, int64_t sr, const float *B, int64_t ldb, int64_t depth, float *C,
                    int64_t ldc, int64_t rows, int halves) {
    for (int64_t r = 0; r < depth || r == 0; r += DEPTH)
        product_part(A + r * sr, sa, sr, B + r * ldb, ldb, depth - r < DEPTH ? depth - r : DEPTH, C, ldc, rows, halves,
                     r > 0);
}

typedef struct {
    float *qt, *st, *ot, *kp, *vp;
    int64_t item; /* whose keys and values kp and vp hold, or -1 */
} Buffers;

/* Rows of an item's keys (or values) far apart in memory (a strided view) are copied together
 * first: the products read every row once per register tile, and rows a page apart would thrash
 * the caches' sets. Rows already `width` apart are read in place. */
static const float *rows_together(const float *x, int64_t stride, int64_t rows, int64_t width, float *into) {
    if (stride == width) return x;
    for (int64_t j = 0; j < rows; j++) memcpy(into + j * width, x + j * stride, sizeof(float) * width);
    return into;
}

/* One block of queries [first, first + count) of one item. */
static void block(const Job *job, int64_t i0, int64_t i1, int64_t first, int64_t count, Buffers *buf) {
    const int64_t D = job->D, Dv = job->Dv;
    const int halves = count > 16 ? 2 : 1, width = 16 * halves;
    const float *q = job->q + i0 * job->q0 + i1 * job->q1 + first * job->qr;
    const float *k = job->k + i0 * job->k0 + i1 * job->k1;
    const float *v = job->v + i0 * job->v0 + i1 * job->v1;
    int64_t kr = job->kr, vr = job->vr;
    if (kr != D || vr != Dv) {
        int64_t item = i0 * job->n1 + i1;
        if (buf->item != item) {
            rows_together(k, kr, job->Lk, D, buf->kp);
            rows_together(v, vr, job->Lk, Dv, buf->vp);
            buf->item = item;
        }
        k = rows_together(k, kr, 0, D, buf->kp), kr = D;
        v = rows_together(v, vr, 0, Dv, buf->vp), vr = Dv;
    }
    float *qt = buf->qt, *st = buf->st, *ot = buf->ot;

    /* Qt (D × width), scaled; the lanes past `count` are zero */
    const __m256 scale = _mm256_set1_ps(job->scale);
    const int64_t D8 = D / 8 * 8;
    for (int64_t i = 0; i < width; i += 8) { /* 8 × 8 blocks, transposed in registers */
        for (int64_t d = 0; d < D8; d += 8) {
            __m256 r[8];
            for (int a = 0; a < 8; a++)
                r[a] = i + a < count ? _mm256_mul_ps(_mm256_loadu_ps(q + (i + a) * job->qr + d), scale) : _mm256_setzero_ps();
            transpose8(r);
            for (int a = 0; a < 8; a++) _mm256_storeu_ps(qt + (d + a) * width + i, r[a]);
        }
        for (int64_t a = i; a < i + 8; a++)
            for (int64_t d = D8; d < D; d++) qt[d * width + a] = a < count ? q[a * job->qr + d] * job->scale : 0.0f;
    }

    /* the keys this block can see: all, or when causal those up to its last query */
    int64_t keys = job->Lk;
    if (job->causal && first + count < keys) keys = first + count;

    /* St (keys × width) = K Qt */
    product(k, kr, 1, qt, width, D, st, width, keys, halves);

    /* mask, causal flag, then per query: max, exp, sum */
    __m256 mx[4], sum[4];
    for (int h = 0; h < 2 * halves; h++) mx[h] = _mm256_set1_ps(NEG_INF), sum[h] = _mm256_setzero_ps();
    const float *mask = job->m ? job->m + i0 * job->m0 + i1 * job->m1 + first : NULL;
    float part[QB] = {0}; /* a partial block's mask row, so that no lane reads past the queries */
    for (int64_t j = 0; j < keys; j++) {
        float *row = st + j * width;
        if (mask) {
            const float *add = mask + j * job->mk;
            if (count < width) add = memcpy(part, add, sizeof(float) * count);
            for (int h = 0; h < 2 * halves; h++)
                _mm256_storeu_ps(row + 8 * h, _mm256_add_ps(_mm256_loadu_ps(row + 8 * h), _mm256_loadu_ps(add + 8 * h)));
        }
        if (job->causal && j > first)
            for (int64_t i = 0; i < width && first + i < j; i++) row[i] = NEG_INF;
        for (int h = 0; h < 2 * halves; h++) mx[h] = _mm256_max_ps(mx[h], _mm256_loadu_ps(row + 8 * h));
    }
    for (int h = 0; h < 2 * halves; h++) /* a query that sees no key: exp(-inf - 0) = 0 below */
        mx[h] = _mm256_blendv_ps(mx[h], _mm256_setzero_ps(), _mm256_cmp_ps(mx[h], _mm256_set1_ps(NEG_INF), _CMP_EQ_OQ));
    for (int64_t j = 0; j < keys; j++) {
        float *row = st + j * width;
        for (int h = 0; h < 2 * halves; h++) {
            __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + 8 * h), mx[h]));
            _mm256_storeu_ps(row + 8 * h, p);
            sum[h] = _mm256_add_ps(sum[h], p);
        }
    }

    /* Ot (Dv × width) = Vᵀ P */
    product(v, 1, vr, st, width, keys, ot, width, Dv, halves);

    float top[QB], total[QB];
    for (int h = 0; h < 2 * halves; h++) _mm256_storeu_ps(top + 8 * h, mx[h]), _mm256_storeu_ps(total + 8 * h, sum[h]);
    float *o = job->o + i0 * job->o0 + i1 * job->o1 + first * job->orow;
    float *l = job->l + i0 * job->l0 + i1 * job->l1 + first * job->lrow;
    /* o = keep·o + mine·Ot: keep = 0 and mine = 1/total when writing; when merging, the two
     * softmaxes are weighted by their shares of the merged sum, as log-sum-exps:
     * lse = log(e^old + e^new), keep = e^(old − lse), mine = e^(top − lse) = e^(new − lse)/total. */
    float keep[QB], mine[QB];
    for (int64_t i = 0; i < count; i++) { /* total = 0: no key; NaN (a NaN or +inf score) goes through */
        float lse = total[i] == 0.0f ? NEG_INF : top[i] + logf(total[i]);
        keep[i] = 0.0f, mine[i] = total[i] == 0.0f ? 0.0f : 1.0f / total[i];
        if (job->merge) {
            float old = l[i * job->lrow];
            float merged = old == NEG_INF ? lse : lse == NEG_INF ? old
                         : fmaxf(old, lse) + log1pf(expf(-fabsf(old - lse)));
            if (merged == NEG_INF) { /* neither saw a key: o stays zero */
                keep[i] = 1.0f, mine[i] = 0.0f;
            } else {
                keep[i] = expf(old - merged), mine[i] = total[i] == 0.0f ? 0.0f : expf(top[i] - merged);
            }
            lse = merged;
        }
        l[i * job->lrow] = lse;
    }
    const int64_t Dv8 = Dv / 8 * 8;
    for (int64_t i = 0; i < count; i += 8) {
        for (int64_t d = 0; d < Dv8; d += 8) {
            __m256 r[8];
            for (int a = 0; a < 8; a++) r[a] = _mm256_loadu_ps(ot + (d + a) * width + i);
            transpose8(r);
            for (int a = 0; a < 8 && i + a < count; a++) {
                float *row = o + (i + a) * job->orow + d;
                __m256 x = _mm256_mul_ps(r[a], _mm256_set1_ps(mine[i + a]));
                if (job->merge) x = _mm256_fmadd_ps(_mm256_loadu_ps(row), _mm256_set1_ps(keep[i + a]), x);
                _mm256_storeu_ps(row, x);
            }
        }
        for (int64_t a = i; a < i + 8 && a < count; a++)
            for (int64_t d = Dv8; d < Dv; d++) {
                float *x = o + a * job->orow + d;
                *x = (job->merge ? keep[a] * *x : 0.0f) + ot[d * width + a] * mine[a];
            }
    }
}


/* Task t: item (i0, i1) and its query block from `first`; items nearer in memory follow one
 * another (the batch dimension of the smaller stride runs fastest), so pages and lines are reused. */
static void locate(const Job *job, int64_t t, int64_t *i0, int64_t *i1, int64_t *first) {
    const int64_t blocks = (job->Lq + QB - 1) / QB, item = t / blocks;
    *first = (t % blocks) * QB;
    if (llabs(job->q0) < llabs(job->q1))
        *i0 = item % job->n0, *i1 = item / job->n0;
    else
        *i0 = item / job->n1, *i1 = item % job->n1;
}

static void prefetch_rows(const float *x, int64_t stride, int64_t rows, int64_t width) {
    for (int64_t j = 0; j < rows; j++)
        for (int64_t c = 0; c < width; c += 16) _mm_prefetch((const char *)(x + j * stride + c), _MM_HINT_T1);
}

/* Start loading what task t reads, while the one before it computes: rows of strided views lie
 * pages apart, and each would otherwise be a miss the kernel waits for. */
static void prefetch_task(const Job *job, int64_t t) {
    int64_t i0, i1, first;
    locate(job, t, &i0, &i1, &first);
    int64_t count = job->Lq - first < QB ? job->Lq - first : QB;
    prefetch_rows(job->q + i0 * job->q0 + i1 * job->q1 + first * job->qr, job->qr, count, job->D);
    if (first == 0 && (job->kr != job->D || job->vr != job->Dv)) { /* a new item's keys, to be packed */
        prefetch_rows(job->k + i0 * job->k0 + i1 * job->k1, job->kr, job->Lk, job->D);
        prefetch_rows(job->v + i0 * job->v0 + i1 * job->v1, job->vr, job->Lk, job->Dv);
    }
}

/* A 64-byte aligned buffer of `floats` floats (aligned_alloc wants a multiple of 64 bytes). */
static float *buffer(int64_t floats) {
    size_t bytes = ((size_t)(floats > 0 ? floats : 1) * sizeof(float) + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

static void *run(void *arg) {
    Job *job = (Job *)arg;
    Buffers buf;
    buf.qt = buffer(job->D * QB);
    buf.st = buffer(job->Lk * QB);
    buf.ot = buffer(job->Dv * QB);
    int packs = job->kr != job->D || job->vr != job->Dv;
    buf.kp = packs ? buffer(job->Lk * job->D) : NULL;
    buf.vp = packs ? buffer(job->Lk * job->Dv) : NULL;
    buf.item = -1;
    if (!buf.qt || !buf.st || !buf.ot || (packs && (!buf.kp || !buf.vp))) {
        job->failed = 1;
    } else {
        for (int64_t t = job->first; t < job->last; t++) {
            int64_t i0, i1, first;
            locate(job, t, &i0, &i1, &first);
            if (t + 1 < job->last) prefetch_task(job, t + 1);
            block(job, i0, i1, first, job->Lq - first < QB ? job->Lq - first : QB, &buf);
        }
    }
    free(buf.qt);
    free(buf.st);
    free(buf.ot);
    free(buf.kp);
    free(buf.vp);
    return NULL;
}

/* Returns 0, or 1 when a buffer could not be allocated. A thread that cannot start has its share
 * done by the calling thread. */
int subquad_block_attention(int64_t n0, int64_t n1, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv, const float *q,
                            int64_t q0, int64_t q1, int64_t qr, const float *k, int64_t k0, int64_t k1, int64_t kr,
                            const float *v, int64_t v0, int64_t v1, int64_t vr, const float *m, int64_t m0, int64_t m1,
                            int64_t mk, float *o, int64_t o0, int64_t o1, int64_t orow, float *l, int64_t l0,
                            int64_t l1, int64_t lrow, int causal, float scale, int merge, int threads) {
    Job base = {n0, n1, Lq, Lk, D, Dv, q, q0, q1, qr, k, k0, k1, kr, v, v0, v1, vr, m, m0, m1, mk,
                o, o0, o1, orow, l, l0, l1, lrow, causal, scale, merge, 0, 0, 0};
    const int64_t tasks = n0 * n1 * ((Lq + QB - 1) / QB);
    if (threads < 1) threads = 1;
    if (threads > tasks) threads = tasks > 0 ? (int)tasks : 1;
    Job jobs[threads];
    pthread_t ids[threads];
    int started[threads];
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].first = tasks * t / threads;
        jobs[t].last = tasks * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    int failed = jobs[0].failed;
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
            failed |= jobs[t].failed;
        } else {
            run(&jobs[t]); /* could not start a thread: do its share here */
            failed |= jobs[t].failed;
        }
    }
    return failed;
}
