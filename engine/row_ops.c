/* A bf16 decoder layer's row operations on the CPU: RMSNorm (with the residual add before it), rotary
 * embedding, and SiLU(gate) * up.
 *
 * Built and loaded by engine/row_ops_kernel.py (gcc -O3 -march=native -fopenmp, at first use). In torch
 * each of these is five to twelve small ops, each a dispatch, an allocation and a pass over the rows;
 * for a decode's one to a few rows that overhead is the whole cost. Here each is one call and one pass:
 * a one-row step of the Qwen2.5-Coder-0.5B int4 draft spent 3.5 ms of 21.1 in torch's and 2.2 in these
 * (0.935x the step; AMD EPYC, 2 threads; docs/bench/issue20-s40/results/row_ops.txt).
 *
 * Every result is what the torch ops (engine/models/layers.py, rope.py) compute, rounding for rounding:
 * each torch op on bf16 works in float32 and rounds its result to bf16 (nearest, ties to even), and so
 * does each step here. Two steps cannot be bit for bit: the RMSNorm's sum of squares is added in another
 * order (16 lanes, then a fixed tree), and SiLU's exp is our polynomial, not torch's; either moves a
 * result by at most one bf16 step, and only where the float32 value lies near a rounding boundary. A row
 * goes through the same operations whatever else the call holds, so its output does not depend on its
 * batch.
 *
 * Plain C loops the compiler vectorises (no intrinsics), so the file builds on any CPU gcc targets.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

enum { LANES = 16, PARALLEL_ELEMENTS = 1 << 16 }; /* sum lanes; a call this big uses every thread */

static inline float to_float(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch does; a NaN stays a (quiet) NaN. Branch-free, so the loops
 * that call it vectorise. */
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* out[r] = bf16(w * bf16(x[r] * 1 / sqrt(mean(x[r]^2) + eps))), RMSNorm as layers.RMSNorm computes it
 * (normalise in float32, round, then scale by the weight). With `delta`, x[r] = bf16(a[r] + delta[r]),
 * the residual add before the norm, stored into `sum_out` [rows, dim] (contiguous); otherwise x = a.
 * a and delta have row strides a_stride and delta_stride; out is [rows, dim] contiguous. */
int add_rms_norm(const bf16 *a, int64_t a_stride, const bf16 *delta, int64_t delta_stride, bf16 *sum_out,
                 const bf16 *weight, bf16 *out, int64_t rows, int64_t dim, float eps, int threads) {
    if (delta != NULL && sum_out == NULL) return -1;
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *x = a + r * a_stride;
        if (delta != NULL) {
            const bf16 *d = delta + r * delta_stride;
            bf16 *s = sum_out + r * dim;
            for (int64_t i = 0; i < dim; ++i) s[i] = to_bf16(to_float(x[i]) + to_float(d[i]));
            x = s;
        }
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int j = 0; j < LANES; ++j) {
                const float v = to_float(x[i + j]);
                lanes[j] += v * v;
            }
        for (int j = 0; i + j < dim; ++j) {
            const float v = to_float(x[i + j]);
            lanes[j] += v * v;
        }
        for (int width = LANES / 2; width >= 1; width /= 2) /* the same tree for every row */
            for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
        const float scale = 1.0f / sqrtf(lanes[0] / (float)dim + eps);
        bf16 *o = out + r * dim;
        for (int64_t k = 0; k < dim; ++k)
            o[k] = to_bf16(to_float(weight[k]) * to_float(to_bf16(to_float(x[k]) * scale)));
    }
    return 0;
}

/* Rotary embedding of rows' q and k heads, as rope.RotaryEmbedding computes it in bf16:
 * out = bf16(bf16(x * c) + bf16(swap_halves(x) * s)), c and s the float32 tables' entries at the row's
 * position rounded to bf16 (`sin_table` holds the first half negated, so this is rotate_half). q [rows,
 * q_heads, head_dim] with row stride q_stride (heads contiguous), k likewise; q_out and k_out contiguous.
 * Returns -1, writing nothing, if a position is outside the tables' `table_rows`. */
int rope(const bf16 *q, int64_t q_stride, int64_t q_heads, const bf16 *k, int64_t k_stride, int64_t k_heads,
         int64_t head_dim, const int64_t *positions, int64_t rows, const float *cos_table,
         const float *sin_table, int64_t table_rows, bf16 *q_out, bf16 *k_out, int threads) {
    for (int64_t r = 0; r < rows; ++r)
        if (positions[r] < 0 || positions[r] >= table_rows) return -1;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * (q_heads + k_heads) * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *cos_row = cos_table + positions[r] * head_dim;
        const float *sin_row = sin_table + positions[r] * head_dim;
        float c[head_dim], s[head_dim]; /* the row's tables rounded to bf16, as torch's .to(dtype) */
        for (int64_t d = 0; d < head_dim; ++d) {
            c[d] = to_float(to_bf16(cos_row[d]));
            s[d] = to_float(to_bf16(sin_row[d]));
        }
        for (int part = 0; part < 2; ++part) {
            const int64_t heads = part == 0 ? q_heads : k_heads;
            const bf16 *in = part == 0 ? q + r * q_stride : k + r * k_stride;
            bf16 *o = (part == 0 ? q_out : k_out) + r * heads * head_dim;
            for (int64_t h = 0; h < heads; ++h) {
                const bf16 *x = in + h * head_dim;
                bf16 *y = o + h * head_dim;
                for (int64_t d = 0; d < half; ++d) /* the halves swapped for the sin term */
                    y[d] = to_bf16(to_float(to_bf16(to_float(x[d]) * c[d])) +
                                   to_float(to_bf16(to_float(x[d + half]) * s[d])));
                for (int64_t d = half; d < head_dim; ++d)
                    y[d] = to_bf16(to_float(to_bf16(to_float(x[d]) * c[d])) +
                                   to_float(to_bf16(to_float(x[d - half]) * s[d])));
            }
        }
    }
    return 0;
}

/* e^x in float32 within about 2 ulp (Cephes' expf: x = n ln2 + g, e^g by a degree-6 polynomial, times
 * 2^n): 0 below -87.3 (where float32 would be subnormal), infinity above 88.7, a NaN stays NaN; so
 * SiLU's x / (1 + e^-x) meets the infinities and NaNs as torch's does. */
static inline float exp_approx(float x) {
    const float hi = 88.72283f, lo = -87.33654f;
    const float clamped = x < lo ? lo : (x > hi ? hi : x); /* not fminf: that would not vectorise */
    /* n = round(x / ln2): adding 1.5 * 2^23 leaves the integer in the low mantissa bits */
    const float shifted = clamped * 1.44269504088896341f + 12582912.0f;
    const float n = shifted - 12582912.0f;
    float g = clamped - n * 0.693359375f; /* ln2 in two parts: the first exact in float */
    g = g - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * g + 1.3981999507e-3f;
    p = p * g + 8.3334519073e-3f;
    p = p * g + 4.1665795894e-2f;
    p = p * g + 1.6666665459e-1f;
    p = p * g + 5.0000001201e-1f;
    p = p * g * g + g + 1.0f;
    const float m = n > 127.0f ? 127.0f : n; /* 2^128 is not a float: 2 * 2^127 */
    const uint32_t bits = (uint32_t)((int32_t)m + 127) << 23; /* 2^m, m in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float result = n > 127.0f ? p * scale * 2.0f : p * scale;
    result = x < lo ? 0.0f : (x > hi ? INFINITY : result);
    return x != x ? x : result;
}

/* out[r, i] = bf16(bf16(silu(g)) * u), g = gate_up[r, i], u = gate_up[r, inter + i]: GatedMLP's
 * act(gate) * up with SiLU (x / (1 + e^-x) in float32, rounded, then the product rounded). gate_up has
 * row stride `stride`; out is [rows, inter] contiguous. */
int silu_mul(const bf16 *gate_up, int64_t stride, int64_t rows, int64_t inter, bf16 *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *gate = gate_up + r * stride, *up = gate + inter;
        bf16 *o = out + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float g = to_float(gate[i]);
            const float silu = to_float(to_bf16(g / (1.0f + exp_approx(-g))));
            o[i] = to_bf16(silu * to_float(up[i]));
        }
    }
    return 0;
}
