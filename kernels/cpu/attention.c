/* Decode attention on a CPU, read straight from the KV pages (kernels/cpu_attention.py builds and calls it).
 *
 * Query row i attends to the first row_lens[i] tokens of sequence seqs[i]: one row per decoding sequence, or a few
 * rows of one sequence (speculative drafts being verified). With a window (sliding-window layers, window > 0), to the
 * last `window` of them only: the pages before the window are not read. For each (row, KV head), the query heads of its group score every context token
 * of that head, take the softmax, and sum the value rows: one pass over the keys, one over the values, each row read
 * once from its page, page by page. Nothing is gathered into a copy first, as the pure-torch reference
 * (kernels/reference.py) must before it can call SDPA. With sinks (gpt-oss; NULL: none), query head q's softmax has one
 * more term, e^{sinks[q]}, for a key whose value is zero: it takes probability and adds nothing.
 *
 * Layout (in elements): token t of sequence s lives in page block_tables[s * bt_stride + t / block_size] at offset
 * t % block_size; its key for KV head h starts at page * k_page + (t % block_size) * k_token + h * k_head, its value
 * likewise with the v_ strides. GQA pages: k_token = Hkv * D, k_head = D. MLA latent pages: one head whose whole row
 * (Dk = kv_lora_rank + rope) is the key and whose first Dv = kv_lora_rank values are the value, so k and v point
 * into the same pages. Queries are float32 [n, Hq, Dk], outputs float32 [n, Hq, Dv]; pages float32 or bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load(const void *base, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } x;
        x.u = (uint32_t)((const uint16_t *)base)[i] << 16;
        return x.f;
    }
    return ((const float *)base)[i];
}

/* e^x for x <= 0 (scores minus their maximum), in a form the compiler vectorizes (glibc's expf is a call per
 * element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to degree 7 (relative error < 2e-7),
 * 2^n by the exponent bits. Below -87 the result is 0, as expf's underflows to it. */
ALWAYS_INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

typedef struct {
    int64_t n, hq, hkv, dk, dv, block_size, bt_stride;
    int64_t k_page, k_token, k_head, v_page, v_token, v_head;
    int64_t window; /* 0: every token of the context; else the last `window` tokens */
    float scale;
    int threads;
} Shape;

/* One (sequence i, KV head h) task over tokens [lo, end) of the sequence; `bf16` is a constant at each call site,
 * so each page dtype gets its own loop. Scores are indexed from lo: token t's is scores[g * len + t - lo]. */
ALWAYS_INLINE void attend(const Shape *p, const float *q, const void *k, const void *v, const int32_t *table,
                          const float *sinks, int64_t lo, int64_t end, int64_t i, int64_t h, float *scores,
                          float *out, int bf16) {
    const int64_t group = p->hq / p->hkv, dk = p->dk, dv = p->dv, bs = p->block_size, len = end - lo;
    const float *qrows = q + (i * p->hq + h * group) * dk;
    /* keys, a page at a time from the page holding lo; a page's rows stay in L1. j0: the page's first row read */
    for (int64_t start = lo - lo % bs; start < end; start += bs) {
        const int64_t page = table[start / bs], rows = end - start < bs ? end - start : bs;
        const int64_t j0 = start < lo ? lo - start : 0;
        const int64_t first = page * p->k_page + h * p->k_head;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qrows + g * dk;
            float *sg = scores + g * len + start - lo;
            for (int64_t j = j0; j < rows; j++) {
                const int64_t row = first + j * p->k_token;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dk; d++) dot += qg[d] * load(k, row + d, bf16);
                sg[j] = dot * p->scale;
            }
        }
    }
    memset(out, 0, sizeof(float) * group * dv);
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len, best = s[0], total = 0.0f;
#pragma omp simd reduction(max : best)
        for (int64_t t = 0; t < len; t++) best = s[t] > best ? s[t] : best;
        if (sinks) {
            const float sink = sinks[h * group + g];
            best = sink > best ? sink : best;
            total = exp_nonpositive(sink - best);
        }
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) total += (s[t] = exp_nonpositive(s[t] - best));
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inverse;
    }
    for (int64_t start = lo - lo % bs; start < end; start += bs) {  /* values, a page at a time */
        const int64_t page = table[start / bs], rows = end - start < bs ? end - start : bs;
        const int64_t j0 = start < lo ? lo - start : 0;
        const int64_t first = page * p->v_page + h * p->v_head;
        for (int64_t g = 0; g < group; g++) {
            const float *weights = scores + g * len + start - lo;
            float *o = out + g * dv;
            for (int64_t d0 = 0; d0 < dv; d0 += 32) {  /* 32 outputs in registers across the page's rows */
                const int64_t width = dv - d0 < 32 ? dv - d0 : 32;
                float acc[32] = {0};
                for (int64_t j = j0; j < rows; j++) {
                    const int64_t row = first + j * p->v_token + d0;
                    const float weight = weights[j];
#pragma omp simd
                    for (int64_t d = 0; d < 32; d++) acc[d] += weight * (d < width ? load(v, row + d, bf16) : 0.0f);
                }
                for (int64_t d = 0; d < width; d++) o[d0 + d] += acc[d];
            }
        }
    }
}

/* dtype: 0 = float32 pages, 1 = bfloat16 pages. seqs[i] is the sequence (row of block_tables) that query row i
 * belongs to, row_lens[i] how many of its tokens the row sees; sinks: [hq] float32, or NULL. */
void paged_decode_attention(int dtype, const Shape *p, const float *q, const void *k, const void *v,
                            const int32_t *block_tables, const int32_t *row_lens, const int32_t *seqs,
                            const float *sinks, float *out) {
    const int64_t group = p->hq / p->hkv;
    int64_t longest = 1;
    for (int64_t i = 0; i < p->n; i++)
        if (row_lens[i] > longest) longest = row_lens[i];
    if (p->window > 0 && p->window < longest) longest = p->window;
#pragma omp parallel num_threads(p->threads)
    {
        float *scores = malloc(sizeof(float) * group * longest);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < p->n * p->hkv; task++) {
            const int64_t i = task / p->hkv, h = task % p->hkv, s = seqs[i];
            const int32_t *table = block_tables + s * p->bt_stride;
            float *rows = out + (i * p->hq + h * group) * p->dv;
            const int64_t end = row_lens[i], lo = p->window > 0 && end > p->window ? end - p->window : 0;
            if (dtype == 1)
                attend(p, q, k, v, table, sinks, lo, end, i, h, scores, rows, 1);
            else
                attend(p, q, k, v, table, sinks, lo, end, i, h, scores, rows, 0);
        }
        free(scores);
    }
}
