/* One decode step of attention for one layer, with shared prompt keys and values (float32, CPU).
 *
 * For each row r (one completion) with prompt u = row_prompt[r] and n = row_length[r] response tokens so far, and
 * each query head h with kv head kh = h / (H / K):
 *   1. rotary position embedding (Hugging Face's half-split layout) of the new query and key at the row's
 *      position; the new key and value are written at response column n of the row's cache;
 *   2. scores = [q . prompt_key[u, kh, p] for the prompt's m = prompt_length[u] columns P - m .. P - 1]
 *             + [q . response_key[r, kh, j] for j <= n], times `scale`;
 *   3. out[r, h] = softmax(scores) . [those prompt values ; response_value[r, kh, :n + 1]].
 * Each row reads its own prompt's live columns and its own response so far, nothing else.
 *
 * The same computation as lmrl.engine.llama's PyTorch attention, as one call instead of about twenty small
 * tensor operations per layer and step. Rows and heads are split across OpenMP threads (torch's own OpenMP
 * runtime, already loaded in the process).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float w, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += w * x[i];
}

/* x rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]] */
static inline void rotate(float *dst, const float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) dst[i] = x[i] * cos[i] - x[i + half] * sin[i];
#pragma omp simd
    for (int64_t i = half; i < d; i++) dst[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* qkv:           [b, (H + 2K) * D]   the fused q / k / v projection of the new token of each row
 * cos, sin:      [L, D]              rotary tables by position; position: [b] row positions
 * prompt_*:      [U, K, P, D]        keys / values of the prompts, each right-aligned (its last column is P - 1)
 * prompt_length: [U]                 live columns of each prompt
 * response_*:    [R, K, capacity, D] each row's response keys / values (rows 0 .. b - 1 used), written here
 * row_prompt:    [b]                 prompt (0..U-1) of each row; row_length: [b] its response tokens so far
 * out:           [b, H * D]
 * Every position must lie in [0, L), every row_prompt in [0, U), every prompt_length in [0, P] and every
 * row_length in [0, capacity). Returns 0; 1 when scratch memory could not be allocated; 2 when an index is out
 * of range (nothing is written then). */
int lmrl_decode_attention(const float *qkv, const float *cos, const float *sin, const int64_t *position,
                          const float *prompt_keys, const float *prompt_values, const int64_t *prompt_length,
                          float *response_keys, float *response_values, const int64_t *row_prompt,
                          const int64_t *row_length, float *out, int64_t b, int64_t H, int64_t K, int64_t D,
                          int64_t P, int64_t capacity, float scale, int64_t L, int64_t U) {
    const int64_t width = (H + 2 * K) * D, group = H / K;
    int failed = 0;
    for (int64_t r = 0; r < b; r++)
        if (position[r] < 0 || position[r] >= L || row_prompt[r] < 0 || row_prompt[r] >= U || row_length[r] < 0 ||
            row_length[r] >= capacity || prompt_length[row_prompt[r]] < 0 || prompt_length[row_prompt[r]] > P)
            return 2;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < b; r++) {
            const float *row = qkv + r * width;
            const float *c = cos + position[r] * D, *s = sin + position[r] * D;
            for (int64_t kh = 0; kh < K; kh++) {
                int64_t at = ((r * K + kh) * capacity + row_length[r]) * D;
                rotate(response_keys + at, row + (H + kh) * D, c, s, D);
                const float *v = row + (H + K + kh) * D;
                for (int64_t i = 0; i < D; i++) response_values[at + i] = v[i];
            }
        }
        /* implicit barrier: every row's new key and value are in place */
        float *scratch = malloc(sizeof(float) * (size_t)(P + capacity + 2 * D));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *scores = scratch, *q = scratch + P + capacity, *acc = q + D;
#pragma omp for collapse(2) schedule(static)
            for (int64_t r = 0; r < b; r++) {
                for (int64_t h = 0; h < H; h++) {
                    const int64_t kh = h / group, u = row_prompt[r], m = prompt_length[u], n = row_length[r] + 1;
                    rotate(q, qkv + r * width + h * D, cos + position[r] * D, sin + position[r] * D, D);
                    const float *pk = prompt_keys + ((u * K + kh) * P + P - m) * D;
                    const float *pv = prompt_values + ((u * K + kh) * P + P - m) * D;
                    const float *rk = response_keys + (r * K + kh) * capacity * D;
                    const float *rv = response_values + (r * K + kh) * capacity * D;
                    float top = -INFINITY;
                    for (int64_t p = 0; p < m; p++) {
                        scores[p] = dot(q, pk + p * D, D) * scale;
                        top = scores[p] > top ? scores[p] : top;
                    }
                    for (int64_t j = 0; j < n; j++) {
                        scores[m + j] = dot(q, rk + j * D, D) * scale;
                        top = scores[m + j] > top ? scores[m + j] : top;
                    }
                    float total = 0.0f;
                    for (int64_t j = 0; j < m + n; j++) {
                        scores[j] = expf(scores[j] - top);
                        total += scores[j];
                    }
                    for (int64_t i = 0; i < D; i++) acc[i] = 0.0f;
                    for (int64_t p = 0; p < m; p++) axpy(acc, scores[p], pv + p * D, D);
                    for (int64_t j = 0; j < n; j++) axpy(acc, scores[m + j], rv + j * D, D);
                    float *o = out + (r * H + h) * D, inv = 1.0f / total;
                    for (int64_t i = 0; i < D; i++) o[i] = acc[i] * inv;
                }
            }
        }
        free(scratch);
    }
    return failed;
}

/* RMSNorm of `rows` rows of width n: out = weight * x / sqrt(mean(x^2) + eps), in one thread (a decode
 * step's [b, hidden] activations are too small for a parallel region to pay). */
void lmrl_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float ss = dot(xr, xr, n);
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}
