/* Paged attention for decodes and verification windows on the CPU, read straight from the KV cache.
 *
 * Built and loaded by engine/paged_decode_kernel.py (gcc -O3 -march=native -fopenmp, at first use).
 * Each sequence reads only its own context, in cache order, once per layer: no gathered copy of K and
 * V, no padding to the longest context or query of the batch. Scores and softmax are float32; the
 * output is rounded once to the model's dtype. Where the compiler targets AVX512-BF16 (and the head
 * size is a multiple of 32), bf16 models take the vector paths below: scores as bf16 dot products
 * summed in float32, probabilities rounded to bf16 for the weighted sum (as the matmul path's weights
 * are), and a vector exp. Everywhere else, and for float32 models, plain loops the compiler vectorises.
 *
 * Layouts (all contiguous, row-major):
 *   q, out            [T, H, D]        the step's query rows (a decode has one, a window q_len)
 *   k_cache, v_cache  [num_slots, KVH, D]
 *   seq_info          [S, 4] int64     per sequence: its first row in q, its query rows, its context
 *                                      length, its first visible context position
 *   slots             [S, max_c] int64 the cache slot of each context position
 * Query row j of a sequence sits at position ctx_len - q_len + j and sees the keys from its first
 * visible position to its own.
 *
 * One work item is a sequence and a range of its KV heads; its rows are (head, query row) pairs,
 * r = (head - first head) * q_len + j. No state outlives a call.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(SPECSERVE_GENERIC)
#define SPECSERVE_AVX512_BF16 1
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* nearest even, as torch */
    return (bf16)(u >> 16);
}

/* One item's view of the call. */
typedef struct {
    int is_bf16;
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *slots; /* this sequence's row of `slots` */
    int64_t q_start, q_len, ctx_start, n; /* n: visible context of the last query row */
    int64_t h0, h1, heads, kv_heads, group, dim;
    float scale;
    /* scratch */
    int64_t *visible; /* [rows] keys each row sees, from ctx_start */
    float *queries;   /* [rows, D] scaled, float32 (generic path) */
    float *acc;       /* [rows, D] */
    float *row;       /* [D] */
    float *scores;    /* [rows, n] */
    bf16 *work;       /* [(n + 1) * D + 2 (n + 2)] the vector path's interleaved values, two rows' probabilities */
    void *kt;         /* [D / 2] 64-byte vectors: the vector path's transposed block of sixteen keys */
} Item;

static inline int64_t item_rows(const Item *it) { return (it->h1 - it->h0) * it->group * it->q_len; }

/* Element i of the cache or query array `base` (row `index`, D elements) as float32, into dst. */
static inline void load_row(const Item *it, const void *base, int64_t index, float *dst) {
    if (it->is_bf16) {
        const bf16 *src = (const bf16 *)base + index * it->dim;
#pragma omp simd
        for (int64_t i = 0; i < it->dim; ++i) dst[i] = bf16_to_float(src[i]);
    } else {
        memcpy(dst, (const float *)base + index * it->dim, (size_t)it->dim * sizeof(float));
    }
}

static inline int64_t cache_row(const Item *it, int64_t t, int64_t kv_head) {
    return it->slots[it->ctx_start + t] * it->kv_heads + kv_head;
}

static inline int64_t query_row(const Item *it, int64_t r) { /* index of row r's [D] vector in q and out */
    const int64_t per_head = it->q_len, head = it->h0 * it->group + r / per_head;
    return (it->q_start + r % per_head) * it->heads + head;
}

/* ---- scores [rows, n] = scale * q . k ---------------------------------------------------------- */

static void key_scores_generic(Item *it) {
    const int64_t rows = item_rows(it), per_kv_head = it->group * it->q_len, dim = it->dim;
    for (int64_t r = 0; r < rows; ++r) {
        float *qr = it->queries + r * dim;
        load_row(it, it->q, query_row(it, r), qr);
        for (int64_t i = 0; i < dim; ++i) qr[i] *= it->scale;
    }
    for (int64_t t = 0; t < it->n; ++t) {
        for (int64_t kh = it->h0; kh < it->h1; ++kh) {
            load_row(it, it->k_cache, cache_row(it, t, kh), it->row);
            const int64_t r0 = (kh - it->h0) * per_kv_head;
            for (int64_t r = r0; r < r0 + per_kv_head; ++r) {
                const float *qr = it->queries + r * dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < dim; ++i) s += qr[i] * it->row[i];
                it->scores[r * it->n + t] = s;
            }
        }
    }
}

#ifdef SPECSERVE_AVX512_BF16
/* Sixteen keys of one KV head as [dim / 2] vectors, lane u of vector c holding elements 2c and 2c + 1
 * of key u: the block's rows transposed sixteen pairs at a time (unpack 32- and 64-bit elements within
 * 128-bit lanes, then the 4 x 4 blocks of 128 bits). Keys past `count` are zeros. */
static void transpose_keys(const bf16 *const keys[16], int64_t count, int64_t dim, __m512i *kt) {
    for (int64_t c0 = 0; c0 < dim / 2; c0 += 16) { /* pairs c0 .. c0 + 15 of every key */
        __m512i in[16], a[16], b[16];
        for (int64_t u = 0; u < 16; ++u)
            in[u] = u < count ? _mm512_loadu_si512(keys[u] + 2 * c0) : _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) {
            a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
            a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
        }
        for (int i = 0; i < 4; ++i) { /* b[4i + m], 128-bit lane L: keys 4i .. 4i + 3, pair 4L + m */
            b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
            b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
        }
        for (int m = 0; m < 4; ++m) {
            const __m512i c0m = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44), c1m = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xee);
            const __m512i c2m = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
            const __m512i c3m = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xee);
            kt[c0 + m] = _mm512_shuffle_i32x4(c0m, c2m, 0x88);
            kt[c0 + 4 + m] = _mm512_shuffle_i32x4(c0m, c2m, 0xdd);
            kt[c0 + 8 + m] = _mm512_shuffle_i32x4(c1m, c3m, 0x88);
            kt[c0 + 12 + m] = _mm512_shuffle_i32x4(c1m, c3m, 0xdd);
        }
    }
}

/* One row's scores against a transposed block: its query's bf16 pairs broadcast against the keys' pairs,
 * in four partial sums (pairs c mod 4) added at the end. The same operations for every row, whatever
 * else the call holds: a decode alone and the same row in a window or a batch agree bitwise. */
static inline __m512 row_scores(const __m512i *kt, const bf16 *query, int64_t dim) {
    __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < dim / 2; c += 4)
        for (int j = 0; j < 4; ++j) {
            uint32_t pair;
            memcpy(&pair, query + 2 * (c + j), sizeof pair);
            s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)kt[c + j], (__m512bh)_mm512_set1_epi32((int)pair));
        }
    return _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
}

/* Sixteen keys at a time with the keys as lanes: each block transposed once per KV head (the cost is
 * shared by the head's rows: its query heads x the window's rows), then dim / 2 products per row and
 * key and no horizontal sums. The query is not rounded again: the scale multiplies the float scores. */
static void key_scores_bf16(Item *it) {
    const int64_t per_kv_head = it->group * it->q_len, dim = it->dim;
    const __m512 scale = _mm512_set1_ps(it->scale);
    const bf16 *q = it->q, *k_cache = it->k_cache, *keys[16];
    __m512i *kt = it->kt;
    for (int64_t t0 = 0; t0 < it->n; t0 += 16) {
        const int64_t count = it->n - t0 < 16 ? it->n - t0 : 16;
        const __mmask16 live = (__mmask16)((1u << count) - 1u);
        for (int64_t kh = it->h0; kh < it->h1; ++kh) {
            for (int64_t u = 0; u < count; ++u) keys[u] = k_cache + cache_row(it, t0 + u, kh) * dim;
            transpose_keys(keys, count, dim, kt);
            const int64_t r0 = (kh - it->h0) * per_kv_head;
            for (int64_t r = r0; r < r0 + per_kv_head; ++r)
                _mm512_mask_storeu_ps(it->scores + r * it->n + t0, live,
                                      _mm512_mul_ps(row_scores(kt, q + query_row(it, r) * dim, dim), scale));
        }
    }
}

/* exp(x) as 2^n * 2^f, n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial
 * (relative error ~1e-7 from the polynomial, a few ulps from the reduction for |x| < 100). */
static inline __m512 exp512(__m512 x) {
    /* max(-150, x): a NaN x stays NaN (the second operand wins), so a NaN score poisons its row as in torch */
    const __m512 y = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-150.0f), x), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.69314718055994531f)); /* f ln 2 */
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Row r's probabilities rounded to bf16 into probs [n + 2], zero after its last visible key (the
 * second key of an odd last pair weighs nothing). */
static void row_probabilities(const Item *it, int64_t r, bf16 *probs) {
    const float *sr = it->scores + r * it->n;
    const int64_t vis = it->visible[r];
    int64_t t = 0;
    for (; t + 16 <= vis; t += 16)
        _mm256_storeu_si256((__m256i *)(probs + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + t)));
    for (; t < vis; ++t) probs[t] = float_to_bf16(sr[t]);
    probs[vis] = 0;
}

/* acc row r = its probabilities . the interleaved values, pairs of keys at a time, sums in float32. */
static void value_row(Item *it, int64_t r, const bf16 *interleaved, bf16 *probs) {
    const int64_t dim = it->dim, vis = it->visible[r];
    row_probabilities(it, r, probs);
    __m512 sum[16];
    for (int64_t e = 0; e < dim / 16; ++e) sum[e] = _mm512_setzero_ps();
    for (int64_t p = 0; p < (vis + 1) / 2; ++p) {
        uint32_t two;
        memcpy(&two, probs + 2 * p, sizeof two);
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)two);
        const bf16 *src = interleaved + p * 2 * dim;
        for (int64_t e = 0; e < dim / 16; ++e)
            sum[e] = _mm512_dpbf16_ps(sum[e], w, (__m512bh)_mm512_loadu_si512(src + 32 * e));
    }
    for (int64_t e = 0; e < dim / 16; ++e) _mm512_storeu_ps(it->acc + r * dim + 16 * e, sum[e]);
}

/* Pairs of keys at a time: each KV head's value rows interleaved once (element i of keys t and t + 1
 * side by side), each row's probabilities rounded to bf16 and taken two by two, sums in float32. */
static void weighted_values_bf16(Item *it) {
    const int64_t per_kv_head = it->group * it->q_len, dim = it->dim, pairs = (it->n + 1) / 2;
    const bf16 *v_cache = it->v_cache;
    bf16 *interleaved = it->work, *probs = interleaved + pairs * 2 * dim; /* [pairs, D, 2], 2 x [n + 2] */
    int16_t lo[32], hi[32];
    for (int k = 0; k < 32; ++k) { /* lane k: element k / 2 (+ 16) of the first key (k even) or the second */
        lo[k] = (int16_t)((k / 2) | (k & 1 ? 32 : 0));
        hi[k] = (int16_t)((16 + k / 2) | (k & 1 ? 32 : 0));
    }
    const __m512i lo_index = _mm512_loadu_si512(lo), hi_index = _mm512_loadu_si512(hi);
    for (int64_t kh = it->h0; kh < it->h1; ++kh) {
        for (int64_t p = 0; p < pairs; ++p) {
            const bf16 *first = v_cache + cache_row(it, 2 * p, kh) * dim;
            const bf16 *second = 2 * p + 1 < it->n ? v_cache + cache_row(it, 2 * p + 1, kh) * dim : NULL;
            bf16 *dst = interleaved + p * 2 * dim;
            for (int64_t c = 0; c < dim / 32; ++c) {
                const __m512i a = _mm512_loadu_si512(first + 32 * c);
                const __m512i b = second ? _mm512_loadu_si512(second + 32 * c) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + 64 * c, _mm512_permutex2var_epi16(a, lo_index, b));
                _mm512_storeu_si512(dst + 64 * c + 32, _mm512_permutex2var_epi16(a, hi_index, b));
            }
        }
        /* Rows (head, j) and (head + 1, j) see the same keys: up to a head size of 128 two rows share
         * each value load (twice the independent sums in flight), each row's sums as alone. */
        const int64_t r0 = (kh - it->h0) * per_kv_head, step = dim <= 128 ? 2 : 1;
        for (int64_t h = 0; h < it->group; h += step)
            for (int64_t j = 0; j < it->q_len; ++j) {
                const int64_t ra = r0 + h * it->q_len + j, rb = h + 1 < it->group && step == 2 ? ra + it->q_len : -1;
                if (rb < 0) {
                    value_row(it, ra, interleaved, probs);
                    continue;
                }
                const int64_t vis = it->visible[ra];
                bf16 *pa = probs, *pb = probs + it->n + 2;
                row_probabilities(it, ra, pa);
                row_probabilities(it, rb, pb);
                __m512 sa[8], sb[8];
                for (int64_t e = 0; e < dim / 16; ++e) sa[e] = sb[e] = _mm512_setzero_ps();
                for (int64_t p = 0; p < (vis + 1) / 2; ++p) {
                    uint32_t two_a, two_b;
                    memcpy(&two_a, pa + 2 * p, sizeof two_a);
                    memcpy(&two_b, pb + 2 * p, sizeof two_b);
                    const __m512bh wa = (__m512bh)_mm512_set1_epi32((int)two_a), wb = (__m512bh)_mm512_set1_epi32((int)two_b);
                    const bf16 *src = interleaved + p * 2 * dim;
                    for (int64_t e = 0; e < dim / 16; ++e) {
                        const __m512bh v = (__m512bh)_mm512_loadu_si512(src + 32 * e);
                        sa[e] = _mm512_dpbf16_ps(sa[e], wa, v);
                        sb[e] = _mm512_dpbf16_ps(sb[e], wb, v);
                    }
                }
                for (int64_t e = 0; e < dim / 16; ++e) {
                    _mm512_storeu_ps(it->acc + ra * dim + 16 * e, sa[e]);
                    _mm512_storeu_ps(it->acc + rb * dim + 16 * e, sb[e]);
                }
            }
    }
}
#endif

/* ---- softmax of each row over its visible keys ------------------------------------------------- */

static void softmax_rows(Item *it) {
    for (int64_t r = 0; r < item_rows(it); ++r) {
        float *sr = it->scores + r * it->n, m = -INFINITY, sum = 0.0f;
        const int64_t vis = it->visible[r];
        if (vis == 0) continue;
        for (int64_t t = 0; t < vis; ++t) m = sr[t] > m ? sr[t] : m;
        int64_t t = 0;
#ifdef SPECSERVE_AVX512_BF16
        const __m512 max = _mm512_set1_ps(m);
        __m512 total = _mm512_setzero_ps();
        for (; t + 16 <= vis; t += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + t), max));
            _mm512_storeu_ps(sr + t, e);
            total = _mm512_add_ps(total, e);
        }
        sum = _mm512_reduce_add_ps(total);
#endif
        for (; t < vis; ++t) {
            sr[t] = expf(sr[t] - m);
            sum += sr[t];
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < vis; ++t) sr[t] *= inv;
    }
}

/* ---- acc [rows, D] = probabilities . v ----------------------------------------------------------- */

static void weighted_values_generic(Item *it) {
    const int64_t per_kv_head = it->group * it->q_len, dim = it->dim;
    memset(it->acc, 0, (size_t)(item_rows(it) * dim) * sizeof(float));
    for (int64_t t = 0; t < it->n; ++t) {
        for (int64_t kh = it->h0; kh < it->h1; ++kh) {
            load_row(it, it->v_cache, cache_row(it, t, kh), it->row);
            const int64_t r0 = (kh - it->h0) * per_kv_head;
            for (int64_t r = r0; r < r0 + per_kv_head; ++r) {
                if (t >= it->visible[r]) continue;
                const float p = it->scores[r * it->n + t];
                float *ar = it->acc + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; ++i) ar[i] += p * it->row[i];
            }
        }
    }
}

static void store_output(Item *it) {
    for (int64_t r = 0; r < item_rows(it); ++r) {
        const float *ar = it->acc + r * it->dim;
        const int64_t index = query_row(it, r) * it->dim;
        if (it->is_bf16) {
            bf16 *o = (bf16 *)it->out + index;
            for (int64_t i = 0; i < it->dim; ++i) o[i] = float_to_bf16(ar[i]);
        } else {
            memcpy((float *)it->out + index, ar, (size_t)it->dim * sizeof(float));
        }
    }
}

/* 1 when this build's AVX512-BF16 path takes bf16 heads of `dim` values (two 512-bit loads of bf16
 * pairs per 32 values; at most 256, the query's eight registers in the score pass and the row's sixteen
 * accumulators in the value pass). The Python side asks this once per head size: the rule lives here only. */
int paged_decode_vector_head(int64_t dim) {
#ifdef SPECSERVE_AVX512_BF16
    return dim > 0 && dim % 32 == 0 && dim <= 256;
#else
    (void)dim;
    return 0;
#endif
}

static void attend(Item *it) {
    for (int64_t r = 0; r < item_rows(it); ++r) { /* row j sees n - (q_len - 1 - j) keys */
        const int64_t vis = it->n - (it->q_len - 1 - r % it->q_len);
        it->visible[r] = vis > 0 ? vis : 0; /* none: the row's output is zeros */
    }
    if (it->is_bf16 && paged_decode_vector_head(it->dim)) {
#ifdef SPECSERVE_AVX512_BF16
        key_scores_bf16(it);
        softmax_rows(it);
        weighted_values_bf16(it);
#endif
    } else {
        key_scores_generic(it);
        softmax_rows(it);
        weighted_values_generic(it);
    }
    store_output(it);
}

/* Bytes of scratch an item with `rows` rows and `n` keys needs (see Item), 64-byte aligned parts. */
static size_t scratch_bytes(int64_t rows, int64_t n, int64_t dim) {
    const size_t floats = (size_t)(2 * rows * dim + dim + rows * n), halves = (size_t)((n + 1) * dim + 2 * (n + 2));
    return (size_t)rows * sizeof(int64_t) + floats * sizeof(float) + halves * sizeof(bf16) + (size_t)dim * 32 + 7 * 64;
}

static char *carve(char **cursor, size_t bytes) {
    char *part = *cursor;
    *cursor += (bytes + 63) & ~(size_t)63;
    return part;
}

/* Items: one per sequence (all its KV heads, so each cache row is read whole and once) when the batch
 * has a few sequences per thread; else one per (sequence, KV head), so a lone decode still uses every
 * thread. Each thread allocates its scratch once, for the largest item. Returns 0, or -1 when scratch
 * could not be allocated (nothing is then promised of `out`). */
int paged_decode(int is_bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                 const int64_t *seq_info, const int64_t *slots, int64_t max_c, int64_t num_seqs, int64_t heads,
                 int64_t kv_heads, int64_t dim, float scale, int num_threads) {
    const int64_t split = num_seqs >= 2 * (int64_t)num_threads ? 1 : kv_heads; /* items per sequence */
    const int64_t items = num_seqs * split, per_item = kv_heads / split, group = heads / kv_heads;
    size_t largest = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t *info = seq_info + 4 * s;
        const size_t bytes = scratch_bytes(per_item * group * info[1], info[2] - info[3], dim);
        largest = bytes > largest ? bytes : largest;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        char *scratch = aligned_alloc(64, (largest + 63) & ~(size_t)63);
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) {
            if (scratch == NULL) continue;
            const int64_t s = i / split, *info = seq_info + 4 * s;
            Item it = {is_bf16, q, k_cache, v_cache, out, slots + s * max_c, info[0], info[1], info[3],
                       info[2] - info[3], (i % split) * per_item, (i % split + 1) * per_item, heads, kv_heads,
                       group, dim, scale, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
            const int64_t rows = item_rows(&it);
            char *cursor = scratch;
            it.visible = (int64_t *)carve(&cursor, (size_t)rows * sizeof(int64_t));
            it.queries = (float *)carve(&cursor, (size_t)(rows * dim) * sizeof(float));
            it.acc = (float *)carve(&cursor, (size_t)(rows * dim) * sizeof(float));
            it.row = (float *)carve(&cursor, (size_t)dim * sizeof(float));
            it.scores = (float *)carve(&cursor, (size_t)(rows * it.n) * sizeof(float));
            it.work = (bf16 *)carve(&cursor, (size_t)((it.n + 1) * dim + 2 * (it.n + 2)) * sizeof(bf16));
            it.kt = carve(&cursor, (size_t)dim * 32); /* dim / 2 vectors of 64 bytes */
            attend(&it);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
