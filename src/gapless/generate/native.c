/* Native CPU kernels for the torch engine's decode step (see native.py for how they are built
 * and when they are used). fp32, contiguous row-major tensors, one call per layer.
 *
 * gl_rms_norm       out[r] = x[r] / sqrt(mean(x[r]^2) + eps): RMSNorm without its weight (the next
 *                   matmul carries it).
 * gl_head_norm      qwen3's per-head RMSNorm of the query and key heads, in place.
 * gl_decode_attend  for each running slot b and KV head h: RoPE on the new key and on the query
 *                   heads that share h, the key and value written into the slot's cache at its
 *                   position p[b], then softmax attention of those query heads over exactly the
 *                   positions 0..p[b] of the slot. No mask and no padding: each slot reads its
 *                   own length, so short rows never pay for long ones.
 * gl_linear         out = x @ W.T (+ bias) (+ residual), or silu(gate) * up of a stacked gate | up
 *                   W, for any row count, on W packed into panels of 16 columns (see its
 *                   comment): the engine's matmuls.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void gl_rms_norm(const float *x, float *out, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv;
    }
}

/* In place on rows of q | k | v (B, (heads + 2 kv_heads) * hd): each query and key head vector
 * x becomes w * (x / sqrt(mean(x^2) + eps)), w = q_w for query heads, k_w for key heads (qwen3's
 * per-head q/k norms, as HF computes them in fp32); values untouched. */
void gl_head_norm(float *qkv, const float *q_w, const float *k_w, int64_t rows, int64_t heads, int64_t kv_heads,
                  int64_t hd, float eps, int threads) {
    const int64_t normed = heads + kv_heads, stride = (heads + 2 * kv_heads) * hd;
#pragma omp parallel for num_threads(threads) if (rows * normed * hd >= 65536)
    for (int64_t t = 0; t < rows * normed; t++) {
        const int64_t r = t / normed, h = t % normed;
        float *x = qkv + r * stride + h * hd;
        const float *w = h < heads ? q_w : k_w;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hd; i++) squares += x[i] * x[i];
        const float inv = 1.0f / sqrtf(squares / (float)hd + eps);
        for (int64_t i = 0; i < hd; i++) x[i] = w[i] * (x[i] * inv);
    }
}

/* exp(x) for float, written so that loops calling it vectorize (libm's expf does not without
 * -ffast-math, nor does floorf here): x = k ln2 + r with k = round(x / ln2) (the 1.5 * 2^23
 * trick, exact under the default rounding mode) and |r| <= ln2 / 2 (Cody-Waite split of ln2),
 * exp(r) by Cephes' minimax polynomial for expf, 2^k put into the exponent bits. Relative error
 * about 1e-7 (1-2 ulp); x < -87 (where expf is below 2^-126) gives 0, and -inf gives 0 as it should;
 * x > 88 is clamped to 88. */
static inline float exp_approx(float x) {
    const float round = 12582912.0f;
    const float underflow = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = (x * 1.44269504088896341f + round) - round;
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * underflow;
}

/* x * cos + rotate_half(x) * sin, with sin_signed = [-sin_lo, sin_hi] (rotate_half as a roll) */
static inline void rope(const float *x, const float *cos, const float *sin_signed, float *out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin_signed[i];
    for (int64_t i = half; i < hd; i++) out[i] = x[i] * cos[i] + x[i - half] * sin_signed[i];
}

/* One slot b and KV head h of gl_decode_attend. Inlined with hd a constant for the common head
 * sizes, so the compiler unrolls the dot products and keeps the accumulators in registers.
 * Returns -1 when scratch memory could not be allocated. */
static inline __attribute__((always_inline)) int attend_slot(
    const float *row, const float *cos, const float *sin_signed, float *k_cache, float *v_cache, float *out,
    int64_t p, int64_t heads, int64_t kv_heads, int64_t h, int64_t group, const int64_t hd, float scale, int64_t window) {
    /* a sliding window of w tokens attends to positions p - w + 1 .. p; 0 = every position */
    const int64_t first = (window > 0 && p + 1 > window) ? p + 1 - window : 0, span = p + 1 - first;
    rope(row + (heads + h) * hd, cos, sin_signed, k_cache + p * hd, hd);
    memcpy(v_cache + p * hd, row + (heads + kv_heads + h) * hd, sizeof(float) * hd);
    k_cache += first * hd;
    v_cache += first * hd;
    float *scratch = malloc(sizeof(float) * group * (2 * hd + span));
    if (scratch == NULL) return -1;
    float *q = scratch, *acc = q + group * hd, *scores = acc + group * hd;
    for (int64_t g = 0; g < group; g++) rope(row + (h * group + g) * hd, cos, sin_signed, q + g * hd, hd);
    for (int64_t j = 0; j < span; j++) { /* each cached key is read once for the whole group */
        const float *k = k_cache + j * hd;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * hd;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < hd; i++) dot += qg[i] * k[i];
            scores[g * span + j] = dot * scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * span, top = -INFINITY, total = 0.f;
        for (int64_t j = 0; j < span; j++) top = sg[j] > top ? sg[j] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < span; j++) {
            sg[j] = exp_approx(sg[j] - top);
            total += sg[j];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t j = 0; j < span; j++) sg[j] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * hd);
    for (int64_t j = 0; j < span; j++) { /* and each cached value once */
        const float *v = v_cache + j * hd;
        for (int64_t g = 0; g < group; g++) {
            const float w = scores[g * span + j];
            float *a = acc + g * hd;
#pragma omp simd
            for (int64_t i = 0; i < hd; i++) a[i] += w * v[i];
        }
    }
    memcpy(out + h * group * hd, acc, sizeof(float) * group * hd);
    free(scratch);
    return 0;
}

/* qkv: (B, H + 2 KV, hd), the fused projection (query heads, then key heads, then value heads)
 * cos, sin_signed: (max_len, hd) rotary tables; positions: (B,)
 * keys, values: (slots >= B, KV, max_len, hd), one layer's cache; out: (B, H, hd)
 * window: sliding-window width in tokens (0: full attention)
 * Returns 0, or -1 when scratch memory could not be allocated. */
int gl_decode_attend(const float *qkv, const float *cos, const float *sin_signed, const int64_t *positions,
                     float *keys, float *values, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                     int64_t hd, int64_t max_len, float scale, int64_t window, int threads) {
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        const int64_t b = task / kv_heads, h = task % kv_heads, p = positions[b];
        const float *row = qkv + b * (heads + 2 * kv_heads) * hd;
        const float *c = cos + p * hd, *s = sin_signed + p * hd;
        float *k_cache = keys + (b * kv_heads + h) * max_len * hd;
        float *v_cache = values + (b * kv_heads + h) * max_len * hd;
        float *o = out + b * heads * hd;
        int status;
        if (hd == 64)
            status = attend_slot(row, c, s, k_cache, v_cache, o, p, heads, kv_heads, h, group, 64, scale, window);
        else if (hd == 128)
            status = attend_slot(row, c, s, k_cache, v_cache, o, p, heads, kv_heads, h, group, 128, scale, window);
        else
            status = attend_slot(row, c, s, k_cache, v_cache, o, p, heads, kv_heads, h, group, hd, scale, window);
        if (status) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* Inverse-CDF sampling without truncation, one token per row (sampling.py's sample_rows when no
 * row is greedy or truncated): p = softmax(logits / T) in vocabulary order, the token is the first
 * whose cumulative mass exceeds u * total (kept below total, so it lands on a token), and its
 * log-prob is log_softmax(logits / T) at that token. `scratch` holds rows x vocab floats. */
void gl_sample_rows(const float *logits, const float *temperature, const float *u, float *scratch,
                    int64_t *tokens, float *logprobs, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * vocab >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict l = logits + r * vocab;
        float *restrict e = scratch + r * vocab;
        const float inv_t = 1.0f / temperature[r];
        float top = -INFINITY, total = 0.f;
        for (int64_t j = 0; j < vocab; j++) top = l[j] * inv_t > top ? l[j] * inv_t : top;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < vocab; j++) {
            e[j] = exp_approx(l[j] * inv_t - top);
            total += e[j];
        }
        float target = u[r] * total;
        if (!(target < total)) target = nextafterf(total, 0.f);
        int64_t token = vocab - 1;
        float cumulative = 0.f;
        for (int64_t j = 0; j < vocab; j++) {
            cumulative += e[j];
            if (cumulative > target) {
                token = j;
                break;
            }
        }
        tokens[r] = token;
        logprobs[r] = (l[token] * inv_t - top) - logf(total);
    }
}

/* ---- matmul: out (M, N) = x (M, K) @ W.T (+ bias[N]) (+ residual (M, N)) ----
 * W (N, K) is packed (native.py `pack_linear`) as ceil(N / 16) panels of (K, 16): panel p holds
 * output columns 16p..16p+15 with their K weights interleaved, zero past N. A tile is up to
 * GL_ROWS rows x GL_TILE_PANELS adjacent panels, its accumulators held in vector registers (GCC
 * vector extensions) over a K block of 512, the panel block re-read from L1 / L2 by every row
 * tile. Where the compiler targets AVX-512 (32 vector registers of 16 floats) a tile is 8 rows x
 * 2 panels (16 accumulators); elsewhere (AVX2: 16 registers of 8 floats, or the target's own
 * vectors) 6 rows x 1 panel (12 accumulators). A thread owns whole tiles of panels. The point is
 * the decode shape: with few rows a matmul streams its weights once, and here every loaded weight
 * is used by every row of the tile. On this project's CPU (AVX-512) it ran at 1.2-1.9x the AVX2
 * tile's speed and above oneDNN's from 1 to 512 rows (docs/engine.md). Each panel row is one cache
 * line, prefetched GL_PREFETCH rows ahead: at 16 rows the weights stream from memory at ~20 GB/s,
 * and the hardware prefetcher alone left 3-7% on the table in a microbenchmark.
 * gated: the panels hold gate columns 8p..8p+7 then the matching up columns (`pack_linear(...,
 * gated=True)`, W = gate | up stacked, bias likewise), and the epilogue writes silu(gate) * up:
 * the gated MLP in one pass, no (M, 2N) intermediate.
 * Each output is one sum over k in increasing order (per K block, blocks in order): it does not
 * depend on the row count, the batch mates, the thread count or the tile shape. */
#define GL_PANEL 16
#define GL_KBLOCK 512
#define GL_MCHUNK 48
#define GL_PREFETCH 32 /* rows of a panel ahead (a prefetch never faults, even past the end) */
#if defined(__AVX512F__)
#define GL_LANES 16
#define GL_ROWS 8
#define GL_TILE_PANELS 2
#else
#define GL_LANES 8
#define GL_ROWS 6
#define GL_TILE_PANELS 1
#endif
#define GL_TILE_COLS (GL_TILE_PANELS * GL_PANEL)
#define GL_TILE_VECS (GL_TILE_COLS / GL_LANES)
typedef float gl_vec __attribute__((vector_size(GL_LANES * 4)));
typedef float gl_vecu __attribute__((vector_size(GL_LANES * 4), aligned(4), may_alias));

/* acc_out (rows, GL_TILE_COLS) += x[rows, k0:k1] @ the tile's `vecs` vectors of columns; `first`:
 * start from zero. `rows` and `vecs` are constants at every call site, so the loops unroll and the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void linear_tile(const float *x, int64_t ldx, const float *panel, int64_t K,
                                                              float *acc_out, int64_t k0, int64_t k1, const int rows,
                                                              const int vecs, int first) {
    gl_vec acc[GL_ROWS][GL_TILE_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) {
            if (first)
                acc[r][v] = (gl_vec){0};
            else
                acc[r][v] = *(const gl_vecu *)(acc_out + r * GL_TILE_COLS + v * GL_LANES);
        }
    for (int64_t k = k0; k < k1; k++) {
        gl_vec w[GL_TILE_VECS];
        for (int q = 0; q < vecs * GL_LANES / GL_PANEL; q++)  /* each panel's row k + 32: one cache line */
            __builtin_prefetch(panel + q * K * GL_PANEL + (k + GL_PREFETCH) * GL_PANEL);
        for (int v = 0; v < vecs; v++)  /* vector v: panel v * LANES / 16, columns (v * LANES) % 16 on */
            w[v] = *(const gl_vecu *)(panel + (v * GL_LANES / GL_PANEL) * K * GL_PANEL + k * GL_PANEL + (v * GL_LANES) % GL_PANEL);
        for (int r = 0; r < rows; r++) {
            const float s = x[r * ldx + k];
            for (int v = 0; v < vecs; v++) acc[r][v] += s * w[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) *(gl_vecu *)(acc_out + r * GL_TILE_COLS + v * GL_LANES) = acc[r][v];
}

#define GL_TILE_CASE(R)                                                     \
    case R:                                                                 \
        if (vecs == GL_TILE_VECS)                                           \
            linear_tile(xr, K, panel, K, a, k0, k1, R, GL_TILE_VECS, first); \
        else                                                                \
            linear_tile(xr, K, panel, K, a, k0, k1, R, GL_PANEL / GL_LANES, first); \
        break;

void gl_linear(const float *x, const float *packed, const float *bias, const float *residual, float *out,
               int64_t M, int64_t K, int64_t N, int gated, int threads) {
    const int64_t cols = gated ? GL_PANEL / 2 : GL_PANEL;  /* output columns per panel */
    const int64_t panels = (N + cols - 1) / cols, tiles = (panels + GL_TILE_PANELS - 1) / GL_TILE_PANELS;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K * N >= 65536)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t p0 = t * GL_TILE_PANELS;
        const int in_tile = panels - p0 < GL_TILE_PANELS ? (int)(panels - p0) : GL_TILE_PANELS;
        const int vecs = in_tile * GL_PANEL / GL_LANES;  /* a whole tile, or its last panel alone */
        const float *panel = packed + p0 * K * GL_PANEL;
        float acc[GL_MCHUNK * GL_TILE_COLS];
        for (int64_t m0 = 0; m0 < M; m0 += GL_MCHUNK) {
            int64_t m1 = m0 + GL_MCHUNK < M ? m0 + GL_MCHUNK : M;
            for (int64_t k0 = 0; k0 < K; k0 += GL_KBLOCK) {
                const int64_t k1 = k0 + GL_KBLOCK < K ? k0 + GL_KBLOCK : K;
                const int first = k0 == 0;
                for (int64_t r0 = m0; r0 < m1; r0 += GL_ROWS) {
                    const float *xr = x + r0 * K;
                    float *a = acc + (r0 - m0) * GL_TILE_COLS;
                    switch (m1 - r0 < GL_ROWS ? m1 - r0 : GL_ROWS) {  /* constant row counts: registers, unrolled */
#if GL_ROWS > 6
                        GL_TILE_CASE(8)
                        GL_TILE_CASE(7)
#endif
                        GL_TILE_CASE(6)
                        GL_TILE_CASE(5)
                        GL_TILE_CASE(4)
                        GL_TILE_CASE(3)
                        GL_TILE_CASE(2)
                        default: GL_TILE_CASE(1)
                    }
                }
            }
            for (int64_t r = m0; r < m1; r++)
                for (int q = 0; q < in_tile; q++) {
                    const float *a = acc + (r - m0) * GL_TILE_COLS + q * GL_PANEL;
                    const int64_t c0 = (p0 + q) * cols, width = N - c0 < cols ? N - c0 : cols;
                    float *o = out + r * N + c0;
                    if (gated) {  /* silu(gate) * up */
                        for (int64_t c = 0; c < width; c++) {
                            float g = a[c] + (bias ? bias[c0 + c] : 0.0f), u = a[cols + c] + (bias ? bias[N + c0 + c] : 0.0f);
                            o[c] = g / (1.0f + exp_approx(-g)) * u;
                        }
                        continue;
                    }
                    for (int64_t c = 0; c < width; c++) {
                        float v = a[c];
                        if (bias) v += bias[c0 + c];
                        if (residual) v += residual[r * N + c0 + c];
                        o[c] = v;
                    }
                }
        }
    }
}
