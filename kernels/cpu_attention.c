/* Decode attention on a CPU, read straight from the KV pages (kernels/cpu_attention.py builds and calls it).
 *
 * One query row per sequence. For each (sequence, KV head), the query heads of its group score every context token
 * of that head, take the softmax, and sum the value rows: one pass over the keys, one over the values, each row read
 * once from its page. Nothing is gathered into a copy first, as the pure-torch reference (kernels/reference.py) must
 * before it can call SDPA.
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

typedef struct {
    int64_t n, hq, hkv, dk, dv, block_size, bt_stride;
    int64_t k_page, k_token, k_head, v_page, v_token, v_head;
    float scale;
    int threads;
} Shape;

/* One (sequence i, KV head h) task; `bf16` is a constant at each call site, so each page dtype gets its own loop. */
ALWAYS_INLINE void attend(const Shape *p, const float *q, const void *k, const void *v, const int32_t *table,
                          int64_t len, int64_t i, int64_t h, float *scores, float *best, float *total, float *out,
                          int bf16) {
    const int64_t group = p->hq / p->hkv, dk = p->dk, dv = p->dv;
    const float *qrows = q + (i * p->hq + h * group) * dk;
    for (int64_t g = 0; g < group; g++) best[g] = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        const int64_t row = table[t / p->block_size] * p->k_page + (t % p->block_size) * p->k_token + h * p->k_head;
        for (int64_t g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < dk; d++) dot += qrows[g * dk + d] * load(k, row + d, bf16);
            dot *= p->scale;
            scores[g * len + t] = dot;
            if (dot > best[g]) best[g] = dot;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) sum += (scores[g * len + t] = expf(scores[g * len + t] - best[g]));
        total[g] = sum;
    }
    memset(out, 0, sizeof(float) * group * dv);
    for (int64_t t = 0; t < len; t++) {
        const int64_t row = table[t / p->block_size] * p->v_page + (t % p->block_size) * p->v_token + h * p->v_head;
        for (int64_t g = 0; g < group; g++) {
            const float weight = scores[g * len + t];
            for (int64_t d = 0; d < dv; d++) out[g * dv + d] += weight * load(v, row + d, bf16);
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dv; d++) out[g * dv + d] /= total[g];
}

/* dtype: 0 = float32 pages, 1 = bfloat16 pages. seqs[i] is the sequence (row of block_tables / context_lens) that
 * query row i belongs to. */
void paged_decode_attention(int dtype, const Shape *p, const float *q, const void *k, const void *v,
                            const int32_t *block_tables, const int32_t *context_lens, const int32_t *seqs,
                            float *out) {
    const int64_t group = p->hq / p->hkv;
    int64_t longest = 1;
    for (int64_t i = 0; i < p->n; i++)
        if (context_lens[seqs[i]] > longest) longest = context_lens[seqs[i]];
#pragma omp parallel num_threads(p->threads)
    {
        float *scores = malloc(sizeof(float) * group * (longest + 2));
        float *best = scores + group * longest, *total = best + group;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < p->n * p->hkv; task++) {
            const int64_t i = task / p->hkv, h = task % p->hkv, s = seqs[i];
            const int32_t *table = block_tables + s * p->bt_stride;
            float *rows = out + (i * p->hq + h * group) * p->dv;
            if (dtype == 1)
                attend(p, q, k, v, table, context_lens[s], i, h, scores, best, total, rows, 1);
            else
                attend(p, q, k, v, table, context_lens[s], i, h, scores, best, total, rows, 0);
        }
        free(scores);
    }
}
