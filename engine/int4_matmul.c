/* int4 weight x bf16 activations on the CPU, reading each weight once for every row of the call.
 *
 * Built and loaded by engine/int4_kernel.py (gcc -O3 -march=native -fopenmp, at first use). PyTorch's
 * packed int4 CPU kernel dequantizes the weight again for every few rows, so 4 rows cost 1.7x one row
 * and 16 rows 5.8x (docs/bench/issue20-s36/results/int4_rows.txt): a draft step over several requests,
 * an int4 target's verification windows and every prefill pay for it. Here a tile of 16 output
 * channels is decoded from its nibbles once per four rows into bf16 vectors that stay in registers,
 * and each row costs one bf16 dot-product instruction per 32 weights.
 *
 * Weights are w = (q - 8) * scale + zero per group of `group` input channels (q in [0, 15], the
 * convention of engine/quantization.py). A nibble q becomes the bf16 number 128 + q by setting the
 * bits of 128 (0x4300) around it, exactly, so the dot product over a group is
 *   sum_k x_k (128 + q_k) = acc,  and  sum_k x_k w_k = scale * acc + (zero - 136 * scale) * sum_k x_k,
 * all in float32 (the products of bf16 numbers are exact in float32). The output is rounded once to bf16.
 *
 * Every row goes through the same operations in the same order whatever else the call holds (the rows
 * are computed four at a time, each with its own accumulators), so a row's output does not depend on
 * its batch: a quantized target's verification window gets the logits of one-token steps.
 *
 * Layouts (contiguous, row-major; T = ceil(N / 16) tiles, G = K / group):
 *   x       [M, K]       bf16
 *   packed  [T, K/8, 16] uint32   word (t, b, j): bits 4i..4i+3 hold q[16t + j, 8b + 2i] and bits
 *                                 16+4i..19+4i hold q[16t + j, 8b + 2i + 1], i = 0..3
 *   sz      [T, G, 2, 16] bf16    per tile and group: the 16 channels' scales, then their zeros
 *   out     [M, N]       bf16
 * Channels past N in the last tile are padding (scale and zero 0) and are not stored.
 *
 * int4_matmul_q8 (below) is a draft's variant: the same words, the activations rounded to int8.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(SPECSERVE_GENERIC)
#include <immintrin.h>

typedef uint16_t bf16;

enum { TILE = 16, ROWS = 4, PAIRS = 4 }; /* channels per tile, rows per pass, k pairs per packed word */

int int4_matmul_available(void) { return 1; }

/* 16 bf16 numbers as float32 (exact). */
static inline __m512 load_bf16(const bf16 *p) {
    return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p));
}

/* The tile's 16 scales of group g, and its zeros less `offset` times the scales (each path's offset). */
static inline void group_scale(const bf16 *sz, int64_t g, __m512 offset, __m512 *scale, __m512 *shift) {
    *scale = load_bf16(sz + 2 * TILE * g);
    *shift = _mm512_fnmadd_ps(offset, *scale, load_bf16(sz + 2 * TILE * g + TILE));
}

/* Each row's 16 sums rounded once to bf16; the tile's first `width` channels stored. */
static inline void store_rows(int R, const __m512 *total, bf16 *const *out, int64_t width) {
    const __mmask16 keep = width >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << width) - 1);
    for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(out[r], keep, (__m256i)_mm512_cvtneps_pbh(total[r]));
}

/* Sum of each group of x's row, float32, in one fixed order (the same for a row alone or in a batch). */
static void group_sums(const bf16 *x, int64_t k, int64_t group, float *sums) {
    for (int64_t g = 0; g < k / group; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = g * group; c < (g + 1) * group; c += 16) {
            acc = _mm512_add_ps(acc, load_bf16(x + c));
        }
        sums[g] = _mm512_reduce_add_ps(acc);
    }
}

/* Rows r0..r0+R-1 of one tile: `rows` of x (as k pairs, 32 bits each), their group sums, the tile's
 * packed words and scales; stores the tile's channels (up to `width`) of each row. R is a constant at
 * every call, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile_rows(int R, const uint32_t *const *xp,
                                                            const float *const *sums, const __m512i *words,
                                                            const bf16 *sz, int64_t k, int64_t group,
                                                            bf16 *const *out, int64_t width) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), base = _mm512_set1_epi32(0x43004300);
    const __m512 offset = _mm512_set1_ps(136.0f);
    __m512 total[ROWS];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    const int64_t words_per_group = group / 8;
    for (int64_t g = 0; g < k / group; ++g) {
        __m512 acc[ROWS][PAIRS];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < PAIRS; ++i) acc[r][i] = _mm512_setzero_ps();
        for (int64_t b = g * words_per_group; b < (g + 1) * words_per_group; ++b) {
            const __m512i w = _mm512_loadu_si512(words + b);
            __m512bh v[PAIRS];
            /* (w >> 4i) & 0x000F000F | 0x43004300: lane j = the bf16 pair (128 + q[j, 8b+2i], 128 + q[j, 8b+2i+1]) */
            v[0] = (__m512bh)_mm512_ternarylogic_epi32(w, nibbles, base, 0xEA);
            v[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4), nibbles, base, 0xEA);
            v[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 8), nibbles, base, 0xEA);
            v[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 12), nibbles, base, 0xEA);
            for (int r = 0; r < R; ++r)
                for (int i = 0; i < PAIRS; ++i)
                    acc[r][i] = _mm512_dpbf16_ps(acc[r][i], v[i], (__m512bh)_mm512_set1_epi32((int)xp[r][4 * b + i]));
        }
        __m512 scale, shift; /* shift = zero - 136 * scale */
        group_scale(sz, g, offset, &scale, &shift);
        for (int r = 0; r < R; ++r) {
            const __m512 dot = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
            total[r] = _mm512_fmadd_ps(dot, scale, total[r]);
            total[r] = _mm512_fmadd_ps(shift, _mm512_set1_ps(sums[r][g]), total[r]);
        }
    }
    store_rows(R, total, out, width);
}

/* ---------------------------------------------------------------------------------------------
 * Draft-only variant: activations rounded to int8 (one scale per row and group, as llama.cpp's Q8
 * blocks), products as int8 dot products (VNNI: 64 multiply-adds an instruction where bf16 does 32).
 * Not exact: a draft's numbers decide only what it proposes, never what the target emits.
 *
 * The same packed words serve: masking a word leaves in each 32-bit lane the bytes of inputs
 * 8b + {0, 4, 1, 5}, masking it shifted by 4 those of 8b + {2, 6, 3, 7}; a row's int8 activations are
 * stored in that order (quantize_row) so that one 32-bit broadcast meets each lane's four codes.
 * With x ~ xs * xq per group: sum_k x_k w_k ~ xs * (scale * sum_k xq_k q_k + (zero - 8 scale) * sum_k xq_k).
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX512VNNI__)

int int4_matmul_q8_available(void) { return 1; }

/* One row: xq [K] int8, within each 8 inputs in the order 0, 4, 1, 5, 2, 6, 3, 7; per group its
 * scale (peak / 127) and the sum of its codes. Rounding is to nearest (even). */
static void quantize_row(const bf16 *x, int64_t k, int64_t group, int8_t *xq, float *scales, float *sums) {
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int64_t g = 0; g < k / group; ++g) {
        __m512 peak = _mm512_setzero_ps();
        for (int64_t c = g * group; c < (g + 1) * group; c += 16) {
            const __m512 v = load_bf16(x + c);
            peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
        }
        const float top = _mm512_reduce_max_ps(peak);
        const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        __m512i total = _mm512_setzero_si512();
        for (int64_t c = g * group; c < (g + 1) * group; c += 16) {
            const __m512 v = load_bf16(x + c);
            const __m512i q = _mm512_permutexvar_epi32(order, _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse)));
            total = _mm512_add_epi32(total, q);
            _mm_storeu_si128((__m128i *)(xq + c), _mm512_cvtsepi32_epi8(q));
        }
        scales[g] = top / 127.0f;
        sums[g] = (float)_mm512_reduce_add_epi32(total);
    }
}

static inline __attribute__((always_inline)) void tile_rows_q8(int R, const uint32_t *const *xp,
                                                               const float *const *scales, const float *const *sums,
                                                               const __m512i *words, const bf16 *sz, int64_t k,
                                                               int64_t group, bf16 *const *out, int64_t width) {
    const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
    const __m512 eight = _mm512_set1_ps(8.0f);
    __m512 total[ROWS];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    const int64_t words_per_group = group / 8;
    for (int64_t g = 0; g < k / group; ++g) {
        __m512i acc[ROWS][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int64_t b = g * words_per_group; b < (g + 1) * words_per_group; ++b) {
            const __m512i w = _mm512_loadu_si512(words + b);
            const __m512i even = _mm512_and_si512(w, low), odd = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);
            for (int r = 0; r < R; ++r) {
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], even, _mm512_set1_epi32((int)xp[r][2 * b]));
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], odd, _mm512_set1_epi32((int)xp[r][2 * b + 1]));
            }
        }
        __m512 scale, shift; /* shift = zero - 8 * scale */
        group_scale(sz, g, eight, &scale, &shift);
        for (int r = 0; r < R; ++r) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[r][0], acc[r][1]));
            const __m512 group_sum = _mm512_fmadd_ps(shift, _mm512_set1_ps(sums[r][g]), _mm512_mul_ps(dot, scale));
            total[r] = _mm512_fmadd_ps(group_sum, _mm512_set1_ps(scales[r][g]), total[r]);
        }
    }
    store_rows(R, total, out, width);
}

#define SPECSERVE_VNNI 1
#else
int int4_matmul_q8_available(void) { return 0; }
#endif

/* Rows r0..r0+R-1 of one tile, on either path (R a constant at every call: inlined and unrolled). */
static inline __attribute__((always_inline)) void tile_pass(int q8, int R, const uint32_t *const *xp,
                                                            const float *const *scales, const float *const *sums,
                                                            const __m512i *words, const bf16 *sz, int64_t k,
                                                            int64_t group, bf16 *const *out, int64_t width) {
#ifdef SPECSERVE_VNNI
    if (q8) {
        tile_rows_q8(R, xp, scales, sums, words, sz, k, group, out, width);
        return;
    }
#else
    (void)q8, (void)scales; /* `run` refuses q8 without VNNI */
#endif
    tile_rows(R, xp, sums, words, sz, k, group, out, width);
}

/* out = x @ dequantized(packed)^T, with x as it is (bf16 pairs) or rounded to int8 (`q8`, a draft's).
 * Returns 0, -1 when scratch could not be allocated, -2 when `q8` is asked of a build without VNNI. */
static int run(int q8, const bf16 *x, int64_t m, int64_t k, const uint32_t *packed, const bf16 *sz, int64_t n,
               int64_t group, bf16 *out, int num_threads) {
#ifndef SPECSERVE_VNNI
    if (q8) return -2;
#endif
    const int64_t tiles = (n + TILE - 1) / TILE, groups = k / group;
    const int64_t int8_bytes = q8 ? (m * k + 63) & ~(int64_t)63 : 0; /* the rounded rows, if any */
    char *scratch = malloc((size_t)int8_bytes + (size_t)(2 * m * groups) * sizeof(float));
    if (scratch == NULL) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *scales = (float *)(scratch + int8_bytes), *sums = scales + m * groups;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m > 4)
    for (int64_t r = 0; r < m; ++r) {
#ifdef SPECSERVE_VNNI
        if (q8) {
            quantize_row(x + r * k, k, group, xq + r * k, scales + r * groups, sums + r * groups);
            continue;
        }
#endif
        group_sums(x + r * k, k, group, sums + r * groups);
    }
    const char *rows = q8 ? (const char *)xq : (const char *)x;
    const int64_t row_bytes = q8 ? k : 2 * k;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const __m512i *words = (const __m512i *)(packed + t * (k / 8) * TILE);
        const bf16 *tile_sz = sz + t * groups * 2 * TILE;
        const int64_t width = n - t * TILE;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const uint32_t *xp[ROWS];
            const float *rs[ROWS], *rsum[ROWS];
            bf16 *o[ROWS];
            const int R = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            for (int r = 0; r < R; ++r) {
                xp[r] = (const uint32_t *)(rows + (r0 + r) * row_bytes);
                rs[r] = scales + (r0 + r) * groups;
                rsum[r] = sums + (r0 + r) * groups;
                o[r] = out + (r0 + r) * n + t * TILE;
            }
            switch (R) {
            case 1: tile_pass(q8, 1, xp, rs, rsum, words, tile_sz, k, group, o, width); break;
            case 2: tile_pass(q8, 2, xp, rs, rsum, words, tile_sz, k, group, o, width); break;
            case 3: tile_pass(q8, 3, xp, rs, rsum, words, tile_sz, k, group, o, width); break;
            default: tile_pass(q8, 4, xp, rs, rsum, words, tile_sz, k, group, o, width); break;
            }
        }
    }
    free(scratch);
    return 0;
}

int int4_matmul(const bf16 *x, int64_t m, int64_t k, const uint32_t *packed, const bf16 *sz, int64_t n,
                int64_t group, bf16 *out, int num_threads) {
    return run(0, x, m, k, packed, sz, n, group, out, num_threads);
}

int int4_matmul_q8(const bf16 *x, int64_t m, int64_t k, const uint32_t *packed, const bf16 *sz, int64_t n,
                   int64_t group, bf16 *out, int num_threads) {
    return run(1, x, m, k, packed, sz, n, group, out, num_threads);
}

#else /* no AVX512-BF16: the caller keeps PyTorch's int4 kernel */

int int4_matmul_available(void) { return 0; }
int int4_matmul_q8_available(void) { return 0; }
int int4_matmul_q8(const void *x, int64_t m, int64_t k, const void *packed, const void *sz, int64_t n, int64_t group,
                   void *out, int num_threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)sz, (void)n, (void)group, (void)out, (void)num_threads;
    return -2;
}

int int4_matmul(const void *x, int64_t m, int64_t k, const void *packed, const void *sz, int64_t n, int64_t group,
                void *out, int num_threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)sz, (void)n, (void)group, (void)out, (void)num_threads;
    return -2;
}

#endif
