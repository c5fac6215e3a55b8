/* bf16 x bf16 linear layers for a few rows on the CPU: decodes and verification windows.
 *
 * Built and loaded by engine/bf16_kernel.py (gcc -O3 -march=native -fopenmp, at first use). torch's
 * bf16 nn.Linear on the CPU (oneDNN) reads a decode's weights well below the rate the machine streams
 * them, and from a few rows on it adds the rows' arithmetic to that stream. Here the weights are read
 * once per call in their own layout ([N, K], as nn.Linear keeps them: no packed copy), a block of
 * CHANNELS output channels at a time; every row of the call is multiplied against the block while it
 * sits in the cache, and the last pass over a block brings the next one into L2. Over the linear layers
 * of SmolLM2 and the Qwen2.5 pair (AMD EPYC, 2 threads; docs/bench/issue20-s39/results/bf16_rows.txt):
 * 0.37-0.63x torch's time for 1-4 rows, 0.48-0.72x for 16, 0.56-0.99x for 48.
 *
 * Each output is the dot product of a row of x and a row of w: one bf16 dot-product instruction per 32
 * inputs into a float32 accumulator of 16 lanes, in K order, then the lanes summed by the same tree for
 * every output, the bias added (float32) and the result rounded once to bf16. A row goes through the
 * same operations whatever else the call holds, so its output does not depend on its batch.
 *
 * Layouts (row-major): x [M, K] bf16 with row stride `x_stride`, w [N, K] bf16 contiguous, bias [N]
 * bf16 or NULL, out [M, N] bf16 contiguous.
 */
#include <stdint.h>

typedef uint16_t bf16;

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(SPECSERVE_GENERIC)
#include <immintrin.h>

enum { ROWS = 4, CHANNELS = 6, CHUNK = 32 }; /* rows and channels a pass, inputs an instruction */

int bf16_matmul_available(void) { return 1; }

/* The 16 lane sums of 16 accumulators: sums[i] = the lanes of a[i] added by one tree (lanes j and j + 8,
 * then j and j + 4, j and j + 2, j and j + 1), so each sum is the same number whichever accumulators
 * share the call; 15 additions and 30 shuffles for the 16, where summing each alone takes 4 additions
 * and ~4 shuffles. */
static inline void reduce16(const __m512 *a, float *sums) {
    __m512 v1[8], v2[4], v3[2];
    for (int i = 0; i < 8; ++i) /* [a[2i] lanes j + (j+8), a[2i+1] lanes j + (j+8)], j < 8 */
        v1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i) /* 128-bit lane L: a[4i + L], its 4 sums of j + (j+4) */
        v2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v1[2 * i], v1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(v1[2 * i], v1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i) /* lane L: a[8i + L]'s 2 sums of j + (j+2), then a[8i + 4 + L]'s */
        v3[i] = _mm512_add_ps(_mm512_shuffle_ps(v2[2 * i], v2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(v2[2 * i], v2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane L, element e: the sum of a[4e + L] */
    const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(v3[0], v3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(v3[0], v3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* sums[i] is lane 4 * (i % 4) + i / 4 of total: one permute and one store. */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(sums, _mm512_permutexvar_ps(order, total));
}

/* R rows x C channels of out, each the full dot product over k. R and C are constants at every call
 * (inlined, unrolled), so the R*C accumulators live in registers. */
static inline __attribute__((always_inline)) void block(int R, int C, const bf16 *const *xr,
                                                        const bf16 *const *wc, int64_t k, const bf16 *bias,
                                                        bf16 *const *out, const bf16 *ahead, int ahead_rows) {
    __m512 acc[ROWS][CHANNELS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t whole = k - k % CHUNK;
    for (int64_t kk = 0; kk < whole; kk += CHUNK) {
        for (int c = 0; c < ahead_rows; ++c) _mm_prefetch((const char *)(ahead + c * k + kk), _MM_HINT_T1);
        __m512bh xv[ROWS];
        for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(xr[r] + kk);
        for (int c = 0; c < C; ++c) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wc[c] + kk);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
        }
    }
    if (whole < k) { /* the last k % 32 inputs, zero-filled */
        const __mmask32 keep = (__mmask32)((1ull << (k - whole)) - 1);
        __m512bh xv[ROWS];
        for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(keep, xr[r] + whole);
        for (int c = 0; c < C; ++c) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(keep, wc[c] + whole);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
        }
    }
    /* The lanes of every accumulator summed, 16 accumulators at a time (zeros pad the last group). */
    float sums[ROWS * CHANNELS + 15];
    for (int first = 0; first < R * C; first += 16) {
        __m512 group[16];
        for (int i = 0; i < 16; ++i) {
            const int a = first + i;
            group[i] = a < R * C ? acc[a / C][a % C] : _mm512_setzero_ps();
        }
        reduce16(group, sums + first);
    }
    /* Each row's C outputs at once: the bias added in float32 and the sums rounded to bf16 (round to
     * nearest even), C lanes of a vector; the same numbers as one output at a time, which took 6-21%
     * of SmolLM2's layers' time at 8-128 rows (K = 576: 18 dot-product instructions an output) and
     * 2-5% of Qwen2.5-1.5B's (docs/bench/issue20-s47/results/epilogue_layers.txt). */
    const __mmask16 lanes = (__mmask16)((1u << C) - 1);
    const __m512 b = bias != NULL
                         ? _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias)), 16))
                         : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        __m512 row = _mm512_maskz_loadu_ps(lanes, sums + r * C);
        if (bias != NULL) row = _mm512_add_ps(row, b);
        _mm256_mask_storeu_epi16(out[r], lanes, (__m256i)_mm512_cvtneps_pbh(row));
    }
}

static inline __attribute__((always_inline)) void rows_block(int C, int R, const bf16 *const *xr,
                                                             const bf16 *const *wc, int64_t k, const bf16 *bias,
                                                             bf16 *const *out, const bf16 *ahead, int ahead_rows) {
    switch (R) {
    case 1: block(1, C, xr, wc, k, bias, out, ahead, ahead_rows); break;
    case 2: block(2, C, xr, wc, k, bias, out, ahead, ahead_rows); break;
    case 3: block(3, C, xr, wc, k, bias, out, ahead, ahead_rows); break;
    default: block(4, C, xr, wc, k, bias, out, ahead, ahead_rows); break;
    }
}

/* out = x @ w^T (+ bias). Returns 0. */
int bf16_matmul(const bf16 *x, int64_t m, int64_t k, int64_t x_stride, const bf16 *w, int64_t n, const bf16 *bias,
                bf16 *out, int num_threads) {
    const int64_t blocks = (n + CHANNELS - 1) / CHANNELS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t c0 = b * CHANNELS;
        const int C = n - c0 < CHANNELS ? (int)(n - c0) : CHANNELS;
        const bf16 *wc[CHANNELS];
        for (int c = 0; c < C; ++c) wc[c] = w + (c0 + c) * k;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const int R = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            const bf16 *xr[ROWS];
            bf16 *o[ROWS];
            for (int r = 0; r < R; ++r) {
                xr[r] = x + (r0 + r) * x_stride;
                o[r] = out + (r0 + r) * n + c0;
            }
            const bf16 *bb = bias != NULL ? bias + c0 : NULL;
            /* The passes over this block bring the next block's weights into L2 (those rows follow
             * this block's in memory), each pass its share of the next block's channels, so the rows'
             * arithmetic overlaps the next weights' stream. (With the whole fetch in the last pass,
             * a window of 5-8 rows paid its first pass's arithmetic and the stream one after the
             * other: Qwen2.5-1.5B's gate_up took 1.46x the 4-row time for 6 rows.) */
            const int64_t next = c0 + C, passes = (m + ROWS - 1) / ROWS, pass = r0 / ROWS;
            const int64_t fetched = next < n ? (n - next < CHANNELS ? n - next : CHANNELS) : 0;
            const int64_t first = fetched * pass / passes, end = fetched * (pass + 1) / passes;
            const int ahead_rows = (int)(end - first);
            const bf16 *ahead = w + (next + first) * k;
            switch (C) {
            case 1: rows_block(1, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            case 2: rows_block(2, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            case 3: rows_block(3, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            case 4: rows_block(4, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            case 5: rows_block(5, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            default: rows_block(6, R, xr, wc, k, bb, o, ahead, ahead_rows); break;
            }
        }
    }
    return 0;
}

#else /* no AVX512-BF16: the caller keeps torch's linear */

int bf16_matmul_available(void) { return 0; }
int bf16_matmul(const void *x, int64_t m, int64_t k, int64_t x_stride, const void *w, int64_t n, const void *bias,
                void *out, int num_threads) {
    (void)x, (void)m, (void)k, (void)x_stride, (void)w, (void)n, (void)bias, (void)out, (void)num_threads;
    return -2;
}

#endif
