/* A bf16 Llama-family decoder's layers for one step of decodes and verification windows, as one call.
 *
 * Why: a one-row step of the Qwen2.5-Coder-0.5B int4 draft spent ~9 of its ~18 ms outside the matmuls
 * (AMD EPYC, 2 threads): per layer a dozen Python module calls, ctypes argument conversions and output
 * tensors around eight C calls. The C calls themselves were already ours (engine/int4_matmul.c,
 * bf16_matmul.c, paged_decode.c, row_ops.c); this file runs the same calls in the same order on the
 * same inputs, so its result is the module path's bit for bit (tests/engine/test_decode_stack.py).
 *
 * The kernels live in their own libraries (each cached on its own source by engine/c_library.py), so
 * they are called here through function pointers that the Python side takes from those libraries.
 *
 * Per layer, for `rows` query rows (every row a decode or a window row: the paged-decode kernel's case):
 *   x, h = add_rms_norm(x, delta, input_norm)      (the first layer: h = rms_norm(x))
 *   qkv = qkv_proj(h) (+ bias); q, k = rope(q, k); cache[slot] = k, v
 *   a = paged_decode(q, cache); x, h = add_rms_norm(x, o_proj(a), post_norm)
 *   delta = down(silu(gate) * up), gate_up = gate_up_proj(h)
 * then out = final_norm(x + delta). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

typedef int (*int4_matmul_fn)(const bf16 *x, int64_t m, int64_t k, const void *packed, const bf16 *sz,
                              int64_t n, int64_t group, bf16 *out, int threads);
typedef int (*bf16_matmul_fn)(const bf16 *x, int64_t m, int64_t k, int64_t x_stride, const bf16 *w, int64_t n,
                              const bf16 *bias, bf16 *out, int threads);
typedef int (*add_rms_norm_fn)(const bf16 *a, int64_t a_stride, const bf16 *delta, int64_t delta_stride,
                               bf16 *sum_out, const bf16 *weight, bf16 *out, int64_t rows, int64_t dim,
                               float eps, int threads);
typedef int (*rope_fn)(const bf16 *q, int64_t q_stride, int64_t q_heads, const bf16 *k, int64_t k_stride,
                       int64_t k_heads, int64_t head_dim, const int64_t *positions, int64_t rows,
                       const float *cos_table, const float *sin_table, int64_t table_rows, bf16 *q_out,
                       bf16 *k_out, int threads);
typedef int (*silu_mul_fn)(const bf16 *gate_up, int64_t stride, int64_t rows, int64_t inter, bf16 *out,
                           int threads);
typedef int (*paged_decode_fn)(int is_bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                               const int64_t *seq_info, const int64_t *slots, int64_t max_c, int64_t num_seqs,
                               int64_t heads, int64_t kv_heads, int64_t dim, float scale, int num_threads);

enum { LINEAR_INT4 = 0, LINEAR_BF16 = 1 };
enum { STACK_OK = 0, STACK_NO_MEMORY = -1, STACK_POSITION = -2, STACK_KIND = -3 };

typedef struct {
    int64_t kind;                 /* LINEAR_INT4 (engine/int4_matmul.c) or LINEAR_BF16 (bf16_matmul.c) */
    void *function;               /* int4_matmul_fn or bf16_matmul_fn */
    const void *weight;           /* int4: packed tiles [T, K/8, 16] int32; bf16: [N, K] */
    const bf16 *scales_and_zeros; /* int4: [T, K/g, 2, 16]; bf16: NULL */
    const bf16 *bias;             /* [N] or NULL */
    int64_t out_features, in_features, group_size;
} Linear;

typedef struct {
    const bf16 *input_norm, *post_norm; /* [hidden] */
    Linear qkv, o, gate_up, down;
    bf16 *k_cache, *v_cache; /* [slots, KVH, D] */
} Layer;

typedef struct {
    void *add_rms_norm, *rope, *silu_mul, *paged_decode; /* the row-op and attention kernels */
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [table_rows, D] float32 rope tables (sin with its first half negated) */
    int64_t table_rows;
    const bf16 *final_norm; /* [hidden] */
} Stack;

/* bf16 <-> float as torch rounds (nearest even; a NaN stays a NaN): for the int4 layers' bias, which
 * the module path adds after the matmul in bf16. (Copied from row_ops.c: each kernel library is built
 * and cached from its one source file.) */
static inline float to_float(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

/* out [rows, N] = x [rows, K] (contiguous) @ W^T (+ bias): the call each linear module makes. */
static int linear(const Linear *l, const bf16 *x, int64_t rows, bf16 *out, int threads) {
    if (l->kind == LINEAR_BF16)
        return ((bf16_matmul_fn)l->function)(x, rows, l->in_features, l->in_features, (const bf16 *)l->weight,
                                             l->out_features, l->bias, out, threads);
    if (l->kind != LINEAR_INT4) return STACK_KIND;
    if (((int4_matmul_fn)l->function)(x, rows, l->in_features, l->weight, l->scales_and_zeros, l->out_features,
                                      l->group_size, out, threads) != 0)
        return STACK_NO_MEMORY;
    if (l->bias != NULL)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < l->out_features; ++j) {
                bf16 *o = out + r * l->out_features + j;
                *o = to_bf16(to_float(*o) + to_float(l->bias[j]));
            }
    return STACK_OK;
}

int decode_stack(const Stack *s, const Layer *layers, int64_t num_layers, const bf16 *embedded, bf16 *out,
                 int64_t rows, const int64_t *positions, const int64_t *slot_mapping, const int64_t *seq_info,
                 const int64_t *context_slots, int64_t max_c, int64_t num_seqs, int threads) {
    const add_rms_norm_fn norm = (add_rms_norm_fn)s->add_rms_norm;
    const int64_t hidden = s->hidden, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_width = q_size + 2 * kv_size;
    /* Scratch, [rows, width] each: two residual streams (an add never writes the stream it reads),
     * the normed rows, qkv, rotated q and k, attention output, o_proj / down output, gate_up, act. */
    const int64_t widths[] = {hidden, hidden, hidden, qkv_width, q_size, kv_size, q_size, hidden,
                              2 * s->intermediate, s->intermediate};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; ++i) total += widths[i];
    bf16 *scratch = malloc((size_t)(total * rows) * sizeof(bf16));
    if (scratch == NULL) return STACK_NO_MEMORY;
    bf16 *buf[sizeof widths / sizeof widths[0]];
    for (size_t i = 0, at = 0; i < sizeof widths / sizeof widths[0]; at += widths[i] * rows, ++i)
        buf[i] = scratch + at;
    bf16 *x = buf[0], *x_next = buf[1], *h = buf[2], *qkv = buf[3], *q_rot = buf[4], *k_rot = buf[5];
    bf16 *attended = buf[6], *delta = buf[7], *gate_up = buf[8], *act = buf[9];
    memcpy(x, embedded, (size_t)(rows * hidden) * sizeof(bf16));
    const size_t kv_row_bytes = (size_t)kv_size * sizeof(bf16);
    int rc = STACK_OK;
    for (int64_t i = 0; i < num_layers && rc == STACK_OK; ++i) {
        const Layer *l = &layers[i];
        if (i == 0) {
            norm(x, hidden, NULL, 0, NULL, l->input_norm, h, rows, hidden, s->eps, threads);
        } else { /* the previous layer's MLP output joins the stream before this layer's norm */
            norm(x, hidden, delta, hidden, x_next, l->input_norm, h, rows, hidden, s->eps, threads);
            bf16 *t = x; x = x_next; x_next = t;
        }
        if ((rc = linear(&l->qkv, h, rows, qkv, threads)) != STACK_OK) break;
        if (((rope_fn)s->rope)(qkv, qkv_width, s->heads, qkv + q_size, qkv_width, s->kv_heads, d, positions, rows,
                               s->cos, s->sin, s->table_rows, q_rot, k_rot, threads) != 0) {
            rc = STACK_POSITION;
            break;
        }
        for (int64_t r = 0; r < rows; ++r) {
            memcpy(l->k_cache + slot_mapping[r] * kv_size, k_rot + r * kv_size, kv_row_bytes);
            memcpy(l->v_cache + slot_mapping[r] * kv_size, qkv + r * qkv_width + q_size + kv_size, kv_row_bytes);
        }
        if (((paged_decode_fn)s->paged_decode)(1, q_rot, l->k_cache, l->v_cache, attended, seq_info,
                                               context_slots, max_c, num_seqs, s->heads, s->kv_heads, d,
                                               s->scale, threads) != 0) {
            rc = STACK_NO_MEMORY;
            break;
        }
        if ((rc = linear(&l->o, attended, rows, delta, threads)) != STACK_OK) break;
        norm(x, hidden, delta, hidden, x_next, l->post_norm, h, rows, hidden, s->eps, threads);
        bf16 *t = x; x = x_next; x_next = t;
        if ((rc = linear(&l->gate_up, h, rows, gate_up, threads)) != STACK_OK) break;
        ((silu_mul_fn)s->silu_mul)(gate_up, 2 * s->intermediate, rows, s->intermediate, act, threads);
        rc = linear(&l->down, act, rows, delta, threads);
    }
    if (rc == STACK_OK) /* the last residual add and the model's final norm; the sum is not kept */
        norm(x, hidden, delta, hidden, x_next, s->final_norm, out, rows, hidden, s->eps, threads);
    free(scratch);
    return rc;
}
