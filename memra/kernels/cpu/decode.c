/* memra's native CPU decode kernels: quantized GEMV with int8 activations.
 *
 * Compiled on first use by memra/kernels/cpu_native.py (cc -O3 -fopenmp, -mavx2 -mfma -mf16c
 * where the CPU has them) and called through ctypes; the torch twins of every function are in
 * that module and the tests compare them on random data.
 *
 * Weight formats (packed at load by cpu_native.pack_weight, row-major [N rows, K columns]):
 *   FMT_U4: 4-bit unsigned codes, 16 bytes per 32 weights (byte j of a block holds weight j in
 *           its low nibble and weight j + 16 in its high nibble, the GGUF Q4_0 order);
 *           w = scale * code + offset, one fp16 scale and offset per 32 weights.
 *   FMT_S8: int8 codes, 32 bytes per 32 weights; w = scale * code (+ offset), one fp16 scale
 *           per WB weights (WB = 32 or 16, Q6_K's sub-blocks) and, when offsets are given, one
 *           fp16 offset per 32 weights (WB = 32 only).
 * Activations are quantized per 32 values as llama.cpp's q8_1 does (ggml-quants.c
 * quantize_row_q8_1; the math only): d = max|x| / 127, q = round-half-even(x / d) with
 * x / d computed as x * (1 / d), and per block d * sum(q) kept for the offset term. Then
 *   y[t, n] = sum_b [ scale_nb * d_tb * dot(code_nb, q_tb) + offset_nb * d_tb * sum(q_tb) ] (+ bias)
 * with exact integer dot products (AVX2: maddubs / madd, |products| < 2^15 per pair).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MEMRA_AVX2 1
#endif

#define FMT_U4 0
#define FMT_S8 1
#define MODE_STORE 0   /* y = W x (+ bias) */
#define MODE_SWIGLU 1  /* rows [gate (N/2) | up (N/2)]: y[:, i] = silu(g_i) * u_i, [T, N/2] */

int memra_has_avx2(void) {
#ifdef MEMRA_AVX2
    return 1;
#else
    return 0;
#endif
}

static inline float f16_to_f32(uint16_t h) {
#ifdef MEMRA_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_x(const void *x, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* One 32-value block: q[32], returns d; *ds = d * sum(q). */
static inline float quantize_block(const void *x, int bf16, long base, int8_t *q, float *ds) {
    float v[32], amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < 32; i++) {
        v[i] = load_x(x, bf16, base + i);
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
        nan |= v[i] != v[i];
    }
    float d = amax / 127.0f, id = d > 0.0f && d < INFINITY ? 1.0f / d : 0.0f;
    if (nan || !(amax < INFINITY)) { /* a NaN or inf activation makes the products NaN, as a float GEMV's would */
        memset(q, 0, 32);
        *ds = NAN;
        return NAN;
    }
    int sum = 0;
    for (int i = 0; i < 32; i++) {
        int qi = (int)nearbyintf(v[i] * id);
        q[i] = (int8_t)qi;
        sum += qi;
    }
    *ds = d * (float)sum;
    return d;
}

/* Quantize T rows of K values (K % 32 == 0): q [T K], d and ds [T nbp] (blocks past K / 32 zero). */
void memra_quantize_q8(const void *x, int bf16, int T, int K, int nbp, int8_t *q, float *d, float *ds) {
    for (long t = 0; t < T; t++)
        for (long b = 0; b < nbp; b++) {
            long i = t * nbp + b;
            if (b < K / 32) d[i] = quantize_block(x, bf16, t * K + b * 32, q + t * K + b * 32, ds + i);
            else d[i] = ds[i] = 0.0f;
        }
}

/* ---------------------------------------------------------------------------------------- */
/* row dot products                                                                          */
/* Scale and offset rows are padded to a multiple of 8 blocks (zeros): a row's blocks go in   */
/* chunks of 8, whose scales are converted and multiplied by the activation scales 8 at once. */

typedef struct {
    const uint8_t *codes;    /* [N, K / 2] (U4) or [N, K] (S8) */
    const uint16_t *scales;  /* fp16 [N, NBP * 32 / wb] */
    const uint16_t *offsets; /* fp16 [N, NBP] or NULL */
    int fmt, wb, K, nbp;     /* nbp: blocks of 32 per row rounded up to a multiple of 8 */
} weight_t;

#ifdef MEMRA_AVX2
static inline __m256i unpack_u4(const uint8_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}
/* 8 int32 partial sums (lane l: weights 4l .. 4l + 3) of u8 codes w times s8 activations q. */
static inline __m256i dot_u8s8(__m256i w, __m256i q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, q);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, q);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1));
#endif
}
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define MEMRA_VNNI 1
#endif
/* s8 codes: |c| times q with c's sign (maddubs pairs stay below 2^15) */
static inline __m256i dot_s8s8(__m256i w, __m256i q) { return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w)); }
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 load_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

int memra_has_vnni(void) {
#ifdef MEMRA_VNNI
    return 1;
#else
    return 0;
#endif
}

/* out[t] = row r of W times activation t, for TT tokens (TT a literal at every call: unrolled).
 * q: int8 [TT, K]; d, ds: [TT, nbp] (activation scale and scale * sum(q) per block, zero-padded). */
static inline __attribute__((always_inline)) void row_dot(const weight_t *w, long r, int TT, const int8_t *q,
                                                          const float *d, const float *ds, float *out) {
    const int K = w->K, nb = K / 32, nbp = w->nbp, spb = 32 / w->wb;
    const uint16_t *sc = w->scales + r * (long)nbp * spb;
    const uint16_t *of = w->offsets ? w->offsets + r * (long)nbp : NULL;
    const uint8_t *cr = w->codes + r * (long)(w->fmt == FMT_U4 ? K / 2 : K);
#ifdef MEMRA_AVX2
    __m256 acc[4][2], offv[4];
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = offv[t] = _mm256_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 8) {
        float cs[4][16] __attribute__((aligned(32)));
        if (spb == 1) {
            __m256 s8 = load_f16x8(sc + b0);
            __m256 e8 = of ? load_f16x8(of + b0) : _mm256_setzero_ps();
            for (int t = 0; t < TT; t++) {
                _mm256_store_ps(cs[t], _mm256_mul_ps(s8, _mm256_loadu_ps(d + t * nbp + b0)));
                offv[t] = _mm256_fmadd_ps(e8, _mm256_loadu_ps(ds + t * nbp + b0), offv[t]);
            }
        } else { /* a scale per 16: sub-block 2j and 2j + 1 of block j share d[j] (S8, no offsets) */
            __m256 s_lo = load_f16x8(sc + 2 * b0), s_hi = load_f16x8(sc + 2 * b0 + 8);
            const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            for (int t = 0; t < TT; t++) {
                __m256 d8 = _mm256_loadu_ps(d + t * nbp + b0);
                _mm256_store_ps(cs[t], _mm256_mul_ps(s_lo, _mm256_permutevar8x32_ps(d8, lo)));
                _mm256_store_ps(cs[t] + 8, _mm256_mul_ps(s_hi, _mm256_permutevar8x32_ps(d8, hi)));
            }
        }
        const int jn = nb - b0 < 8 ? nb - b0 : 8;
        /* blocks in pairs feeding two accumulators per token (the FMA latency), whatever TT: a
         * token's result does not depend on the tokens beside it; the accumulators are indexed by
         * literals only, so they stay in registers */
#define MEMRA_BLOCK(J, A)                                                                                      \
    do {                                                                                                       \
        const int b = b0 + (J);                                                                                \
        __m256i wv = w->fmt == FMT_U4 ? unpack_u4(cr + b * 16) : _mm256_loadu_si256((const __m256i *)(cr + b * 32)); \
        for (int t = 0; t < TT; t++) {                                                                         \
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + (long)t * K + (long)b * 32));               \
            __m256i p = w->fmt == FMT_U4 ? dot_u8s8(wv, qv) : dot_s8s8(wv, qv);                                \
            __m256 s = spb == 1 ? _mm256_broadcast_ss(&cs[t][J])                                               \
                                : _mm256_set_m128(_mm_broadcast_ss(&cs[t][2 * (J) + 1]), _mm_broadcast_ss(&cs[t][2 * (J)])); \
            acc[t][A] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[t][A]);                                  \
        }                                                                                                      \
    } while (0)
        int j = 0;
        for (; j + 1 < jn; j += 2) {
            MEMRA_BLOCK(j, 0);
            MEMRA_BLOCK(j + 1, 1);
        }
        if (j < jn) MEMRA_BLOCK(j, 0);
#undef MEMRA_BLOCK
    }
    for (int t = 0; t < TT; t++) out[t] = hsum(_mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), offv[t]));
#else
    float acc[4] = {0, 0, 0, 0}, off[4] = {0, 0, 0, 0};
    for (int b = 0; b < nb; b++) {
        int8_t wq[32];
        if (w->fmt == FMT_U4) {
            const uint8_t *p = cr + b * 16;
            for (int j = 0; j < 16; j++) { wq[j] = (int8_t)(p[j] & 15); wq[j + 16] = (int8_t)(p[j] >> 4); }
        } else {
            memcpy(wq, cr + b * 32, 32);
        }
        float o = of ? f16_to_f32(of[b]) : 0.0f;
        for (int t = 0; t < TT; t++) {
            const int8_t *qb = q + (long)t * K + (long)b * 32;
            float db = d[t * nbp + b];
            for (int h = 0; h < spb; h++) {
                int s = 0;
                for (int j = h * w->wb; j < (h + 1) * w->wb; j++) s += (int)wq[j] * (int)qb[j];
                acc[t] += f16_to_f32(sc[b * spb + h]) * db * (float)s;
            }
            off[t] += o * ds[t * nbp + b];
        }
    }
    for (int t = 0; t < TT; t++) out[t] = acc[t] + off[t];
#endif
}

/* Prefetch row r of a weight: its codes (cb bytes a row), scales (sb) and offsets (ob; NULL: none).
 * Decode reads each weight once: the rows stream from the last-level cache or DRAM, and the
 * hardware prefetcher alone leaves the loads waiting. Into L2 (locality 1): measured best. */
static inline void prefetch_weight_row(const void *codes, long cb, const void *scales, long sb, const void *offsets,
                                       long ob, long r) {
#if defined(__GNUC__)
    const char *c = (const char *)codes + r * cb, *sc = (const char *)scales + r * sb;
    for (long i = 0; i < cb; i += 64) __builtin_prefetch(c + i, 0, 1);
    for (long i = 0; i < sb; i += 64) __builtin_prefetch(sc + i, 0, 1);
    if (offsets)
        for (long i = 0; i < ob; i += 64) __builtin_prefetch((const char *)offsets + r * ob + i, 0, 1);
#endif
}
static inline void prefetch_row(const weight_t *w, long r) { /* fp16 block parameters */
    prefetch_weight_row(w->codes, w->fmt == FMT_U4 ? w->K / 2 : w->K, w->scales, (long)w->nbp * (32 / w->wb) * 2,
                        w->offsets, (long)w->nbp * 2, r);
}
#define PREFETCH_ROWS 12

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* min(silu(g), limit) * clamp(u, -limit, limit), limit NaN: silu(g) * u (memra/kernels/fused.py
 * swiglu_torch; Step-3.5's clamp). */
static inline float swiglu(float g, float u, float limit) {
    float sg = silu(g);
    if (limit == limit) {
        sg = sg < limit ? sg : limit;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return sg * u;
}

/* The team for `rows` output rows (at least 64 rows a thread), and thread id's contiguous rows. */
static inline int team_size(long rows, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (rows < 64L * nthreads) nthreads = rows / 64 > 0 ? (int)(rows / 64) : 1;
    return nthreads;
}
static inline void thread_rows(long rows, long *r0, long *r1) {
    int nt = 1, id = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    id = omp_get_thread_num();
#endif
    long per = (rows + nt - 1) / nt;
    *r0 = id * per;
    *r1 = *r0 + per < rows ? *r0 + per : rows;
}

static inline void store(void *y, int y_bf16, long i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}

/* Rows [r0, r1) for the tokens t0 .. t0 + TT - 1. */
static inline __attribute__((always_inline)) void rows_block(const weight_t *w, int TT, long r0, long r1, int t0,
                                                             const int8_t *q, const float *d, const float *ds,
                                                             const float *bias, void *y, int y_bf16,
                                                             long N, int mode, float limit) {
    const int8_t *qt = q + (long)t0 * w->K;
    const float *dt = d + (long)t0 * w->nbp, *dst = ds + (long)t0 * w->nbp;
    float a[4], b[4];
    const long I = N / 2;
    for (long r = r0; r < r0 + PREFETCH_ROWS && r < r1; r++) { /* the first rows' prefetch */
        prefetch_row(w, r);
        if (mode == MODE_SWIGLU) prefetch_row(w, r + I);
    }
    if (mode == MODE_SWIGLU) {
        for (long i = r0; i < r1; i++) {
            if (i + PREFETCH_ROWS < r1) { prefetch_row(w, i + PREFETCH_ROWS); prefetch_row(w, i + I + PREFETCH_ROWS); }
            row_dot(w, i, TT, qt, dt, dst, a);
            row_dot(w, i + I, TT, qt, dt, dst, b);
            for (int t = 0; t < TT; t++) {
                store(y, y_bf16, (long)(t0 + t) * I + i,
                      swiglu(a[t] + (bias ? bias[i] : 0.0f), b[t] + (bias ? bias[i + I] : 0.0f), limit));
            }
        }
        return;
    }
    for (long r = r0; r < r1; r++) {
        if (r + PREFETCH_ROWS < r1) prefetch_row(w, r + PREFETCH_ROWS);
        row_dot(w, r, TT, qt, dt, dst, a);
        for (int t = 0; t < TT; t++) store(y, y_bf16, (long)(t0 + t) * N + r, a[t] + (bias ? bias[r] : 0.0f));
    }
}

/* Scratch of the calling thread (its OpenMP team reads it): q int8 [T, K], d and ds [T, nbp]. */
static __thread int8_t *tl_q;
static __thread float *tl_d;
static __thread long tl_cap_q, tl_cap_d;

static int scratch(long nq, long nd) {
    if (nq > tl_cap_q) {
        free(tl_q);
        tl_q = (int8_t *)aligned_alloc(64, (size_t)((nq + 63) / 64 * 64));
        tl_cap_q = tl_q ? nq : 0;
    }
    if (nd > tl_cap_d) {
        free(tl_d);
        tl_d = (float *)aligned_alloc(64, (size_t)((2 * nd * sizeof(float) + 63) / 64 * 64));
        tl_cap_d = tl_d ? nd : 0;
    }
    return (nq > 0 && !tl_q) || (nd > 0 && !tl_d) ? -1 : 0;
}

/* y = x W^T for x [T, K] (fp32 or bf16), W [N, K] packed (scale rows padded to nbp blocks of 32,
 * nbp a multiple of 8); y [T, N] (MODE_STORE) or [T, N / 2] (MODE_SWIGLU), fp32 or bf16.
 * Returns 0, or -1 if the scratch could not be allocated. */
/* ROWS(&v, tt) on a copy v of the weight w (struct TYPE) whose fmt / wb are literals the compiler
 * sees (U4/32, S8/32, S8/16; any other pair: w itself): the block loop then has no format branch
 * (measured 2x on Q4_1 rows against the runtime fields, NOTES.md session 10) */
#define WITH_LITERAL_FORMAT(TYPE, w, ROWS, tt)                                                        \
    do {                                                                                              \
        TYPE v_ = (w);                                                                                \
        if (v_.fmt == FMT_U4 && v_.wb == 32) { v_.fmt = FMT_U4, v_.wb = 32; ROWS(&v_, tt); }          \
        else if (v_.fmt == FMT_S8 && v_.wb == 32) { v_.fmt = FMT_S8, v_.wb = 32; ROWS(&v_, tt); }     \
        else if (v_.fmt == FMT_S8 && v_.wb == 16) { v_.fmt = FMT_S8, v_.wb = 16; ROWS(&v_, tt); }     \
        else ROWS(&v_, tt);                                                                           \
    } while (0)
/* rows_block for tt = 1 .. 4 tokens, each count a literal (the token loops unrolled) */
#define ROWS_BLOCK_TT(W, tt)                                                                          \
    switch (tt) {                                                                                     \
    case 1: rows_block(W, 1, r0, r1, t0, q, d, ds, bias, y, y_bf16, N, mode, limit); break;          \
    case 2: rows_block(W, 2, r0, r1, t0, q, d, ds, bias, y, y_bf16, N, mode, limit); break;          \
    case 3: rows_block(W, 3, r0, r1, t0, q, d, ds, bias, y, y_bf16, N, mode, limit); break;          \
    default: rows_block(W, 4, r0, r1, t0, q, d, ds, bias, y, y_bf16, N, mode, limit); break;         \
    }
int memra_gemv(const void *x, int x_bf16, int T, int K, long N, const uint8_t *codes, int fmt, int wb, int nbp,
               const uint16_t *scales, const uint16_t *offsets, const float *bias, void *y, int y_bf16, int mode,
               float limit, int nthreads) {
    if (scratch((long)T * K, (long)T * nbp)) return -1;
    int8_t *q = tl_q;
    float *d = tl_d, *ds = tl_d + (long)T * nbp;
    weight_t w = {codes, scales, offsets, fmt, wb, K, nbp};
    long rows = mode == MODE_SWIGLU ? N / 2 : N;
    nthreads = team_size(rows, nthreads);
    /* the activations are quantized by the calling thread (a few µs at decode): the parallel region
     * then has no barrier but its end (a barrier costs a time slice when the CPUs are oversubscribed) */
    memra_quantize_q8(x, x_bf16, T, K, nbp, q, d, ds);
#pragma omp parallel num_threads(nthreads)
    {
        long r0, r1;
        thread_rows(rows, &r0, &r1);
        for (int t0 = 0; t0 < T && r0 < r1; t0 += 4) {
            const int tt = T - t0 < 4 ? T - t0 : 4;
            WITH_LITERAL_FORMAT(weight_t, w, ROWS_BLOCK_TT, tt);
        }
    }
    return 0;
}
#undef ROWS_BLOCK_TT

/* ---------------------------------------------------------------------------------------- */
/* RMSNorm with the residual add: s = x + residual (fp32; residual NULL: s = x), written to s_out
 * (fp32 [T, D]), out = s * (1 / sqrt(mean(s^2) + eps)) * w rounded once to out's dtype. x [T, D]
 * fp32 or bf16; the mean of squares is summed in double. */
void memra_rmsnorm_add(const void *x, int x_bf16, const float *residual, float *s_out, const float *w, float eps,
                       int T, int D, void *out, int out_bf16) {
    for (int t = 0; t < T; t++) {
        float *s = s_out + (long)t * D;
        double ss = 0.0;
        for (int i = 0; i < D; i++) {
            float v = load_x(x, x_bf16, (long)t * D + i);
            if (residual) v += residual[(long)t * D + i];
            s[i] = v;
            ss += (double)v * v;
        }
        float r = 1.0f / sqrtf((float)(ss / D) + eps);
        for (int i = 0; i < D; i++) store(out, out_bf16, (long)t * D + i, s[i] * r * w[i]);
    }
}

/* NeoX (rotate-half) RoPE in place on the first nh heads of each row of x (bf16 or fp32; row r
 * starts at r * row_stride elements, head h at h * hd): for i < rot / 2,
 *   (x_i, x_{i + rot/2}) <- (x_i cos_i - x_{i+rot/2} sin_i, x_{i+rot/2} cos_{i+rot/2} + x_i sin_{i+rot/2})
 * in fp32, rounded once; dims >= rot pass through. cos, sin [T, rot], fp32 or bf16 (cs_bf16). */
void memra_rope(void *x, int x_bf16, int T, long row_stride, int nh, int hd, int rot, const void *cos_t,
                const void *sin_t, int cs_bf16) {
    const int half = rot / 2;
    for (int t = 0; t < T; t++) {
        const long cb = (long)t * rot;
        for (int h = 0; h < nh; h++) {
            long base = (long)t * row_stride + (long)h * hd;
            for (int i = 0; i < half; i++) {
                float a = load_x(x, x_bf16, base + i), b = load_x(x, x_bf16, base + i + half);
                float c0 = load_x(cos_t, cs_bf16, cb + i), c1 = load_x(cos_t, cs_bf16, cb + i + half);
                float s0 = load_x(sin_t, cs_bf16, cb + i), s1 = load_x(sin_t, cs_bf16, cb + i + half);
                store(x, x_bf16, base + i, a * c0 - b * s0);
                store(x, x_bf16, base + i + half, b * c1 + a * s1);
            }
        }
    }
}

/* exp of 8 floats <= 0 (the softmax's s - max): Cephes' expf method (exp(x) = 2^n exp(r), n =
 * round(x / ln 2), r by a two-part ln 2, a degree-5 polynomial; ~1 ulp), 0 below -87.3, NaN kept. */
#ifdef MEMRA_AVX2
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x); /* (lo > x ? lo : x): a NaN x stays NaN */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif

/* sh[j] = exp(sh[j] - m) for j < n; returns their sum (summed in 8 lanes, then the lanes in order). */
static inline float exp_shift_sum(float *sh, int n, float m) {
    int j = 0;
    float sum = 0.0f;
#ifdef MEMRA_AVX2
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
        _mm256_storeu_ps(sh + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; j < n; j++) {
        sh[j] = expf(sh[j] - m);
        sum += sh[j];
    }
    return sum;
}

/* Decode attention: one query per sequence over its keys, fp32.
 * q [B, H, D] (fp32 or bf16; sequence b's heads start at b * q_stride elements, memra_decode_attention:
 * H * D); keys / values are rows of kc / vc (fp32 [slots, KV, D]): sequence b's
 * j-th key is slot idx[b * L + j] (idx NULL: slot lo + j), for j < lens[b] (lens NULL: L).
 * out[b, h] = softmax_j(q[b, h] . k_j * scale) . v_j, GQA: query head h reads KV head h / (H / KV).
 * One task per (b, KV head) with its G = H / KV query heads (each key and value row read once for
 * all of them), a fixed order over j: a result does not depend on B, H or the threads.
 * k_new / v_new [B, KV, D] (fp32 or bf16, NULL: none; row b at b * new_stride, memra_decode_attention:
 * KV * D): this step's keys and values, written to slot
 * wslots[b] (wslots NULL: slot wpos, B = 1) before the attention reads them. Returns 0; -1 if the
 * scratch could not be allocated, -2 for a length outside [0, L], -3 for a slot outside [0, S)
 * (nothing is read or written then). A sequence with no keys gets zeros. */
static int attention_rows(const void *q, long q_stride, int q_bf16, int B, int H, int KV, int D, float *kc,
                          float *vc, long S, const int64_t *idx, long lo, int L, const int64_t *lens, float scale,
                          void *out, int out_bf16, const void *k_new, const void *v_new, long new_stride,
                          int new_bf16, const int64_t *wslots, long wpos, int nthreads) {
    const int G = H / KV;
    int err = 0;
    /* every slot read or written must lie in [0, S), every length in [0, L]: checked before any work */
    for (long b = 0; b < B; b++) {
        const long n = lens ? lens[b] : L;
        if (n < 0 || n > L) return -2;
        if (k_new && ((wslots ? wslots[b] : wpos) < 0 || (wslots ? wslots[b] : wpos) >= S)) return -3;
        for (long j = 0; j < n; j++) {
            const long slot = idx ? idx[b * L + j] : lo + j;
            if (slot < 0 || slot >= S) return -3;
        }
    }
    if (nthreads < 1) nthreads = 1;
    if ((long)B * KV < nthreads) nthreads = B * KV;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)G * (size_t)(L > 0 ? L : 1));
        float *qv = (float *)malloc(sizeof(float) * (size_t)G * D), *acc = (float *)malloc(sizeof(float) * (size_t)G * D);
        const int ok = sc && qv && acc;
        if (!ok) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (long task = 0; task < (long)B * KV; task++) {
            if (!ok) continue;
            const long b = task / KV, g = task % KV;
            const int n = lens ? (int)lens[b] : L;
            const long h0 = b * H + g * G; /* the group's first query head (row of out) */
            if (k_new) { /* this step's key and value of (b, g) into their slot first: the query sees them */
                const long ws = wslots ? wslots[b] : wpos;
                for (int i = 0; i < D; i++) {
                    kc[(ws * KV + g) * D + i] = load_x(k_new, new_bf16, b * new_stride + g * D + i);
                    vc[(ws * KV + g) * D + i] = load_x(v_new, new_bf16, b * new_stride + g * D + i);
                }
            }
            for (int h = 0; h < G; h++)
                for (int i = 0; i < D; i++) qv[h * D + i] = load_x(q, q_bf16, b * q_stride + (g * G + h) * D + i) * scale;
            for (int j = 0; j < n; j++) {
                const long slot = idx ? idx[b * L + j] : lo + j;
                const float *k = kc + (slot * KV + g) * D;
                for (int h = 0; h < G; h++) {
                    const float *qh = qv + h * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int i = 0; i < D; i++) s += qh[i] * k[i];
                    sc[(long)h * n + j] = s;
                }
            }
            for (int h = 0; h < G; h++) {
                float *sh = sc + (long)h * n, m = -INFINITY, sum = 0.0f;
                for (int j = 0; j < n; j++) m = sh[j] > m ? sh[j] : m;
                sum = exp_shift_sum(sh, n, m);
                const float inv = n > 0 ? 1.0f / sum : 0.0f;
                for (int j = 0; j < n; j++) sh[j] *= inv;
            }
            for (int i = 0; i < G * D; i++) acc[i] = 0.0f;
            for (int j = 0; j < n; j++) {
                const long slot = idx ? idx[b * L + j] : lo + j;
                const float *v = vc + (slot * KV + g) * D;
                for (int h = 0; h < G; h++) {
                    float *ah = acc + h * D;
                    const float p = sc[(long)h * n + j];
#pragma omp simd
                    for (int i = 0; i < D; i++) ah[i] += p * v[i];
                }
            }
            for (int h = 0; h < G; h++)
                for (int i = 0; i < D; i++) store(out, out_bf16, (h0 + h) * D + i, acc[h * D + i]);
        }
        free(sc);
        free(qv);
        free(acc);
    }
    return err ? -1 : 0;
}

int memra_decode_attention(const void *q, int q_bf16, int B, int H, int KV, int D, float *kc, float *vc, long S,
                           const int64_t *idx, long lo, int L, const int64_t *lens, float scale, void *out,
                           int out_bf16, const void *k_new, const void *v_new, int new_bf16, const int64_t *wslots,
                           long wpos, int nthreads) {
    return attention_rows(q, (long)H * D, q_bf16, B, H, KV, D, kc, vc, S, idx, lo, L, lens, scale, out, out_bf16,
                          k_new, v_new, (long)KV * D, new_bf16, wslots, wpos, nthreads);
}

/* The k largest values' indices of each row of y (fp32 [R, V]), largest first (ties: the lower
 * index first), k <= 64; NaN never enters. One pass per row with a sorted buffer of k. */
void memra_topk(const float *y, int R, long V, int k, int64_t *out, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (R < nthreads) nthreads = R > 0 ? R : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < R; r++) {
        const float *row = y + (long)r * V;
        float val[64];
        int64_t ix[64];
        int n = 0;
        for (long j = 0; j < V; j++) {
            const float v = row[j];
            if (n == k && !(v > val[k - 1])) continue; /* NaN fails every comparison */
            if (n < k && v != v) continue;
            int p = n < k ? n++ : k - 1;
            while (p > 0 && v > val[p - 1]) {
                val[p] = val[p - 1];
                ix[p] = ix[p - 1];
                p--;
            }
            val[p] = v;
            ix[p] = j;
        }
        for (int i = 0; i < k; i++) out[(long)r * k + i] = i < n ? ix[i] : 0;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The exact (float32) mode's GEMV: fp32 activations, the weights' block parameters in fp32, so the
 * weights fma(scale, code, offset) equal the gguf dequantizer's d * q + m bit for bit (a GGUF scale
 * has <= 17 significant bits, a code <= 8: their product is exact in fp32); the product is summed
 * per block as scale * sum(code x) + offset * sum(x) in fp32 (row_dot_f32).
 * scales fp32 [N, nbp * 32 / wb], offsets fp32 [N, nbp] or NULL; codes as in memra_gemv
 * (S8 codes signed, U4 codes unsigned). x, y fp32. */
typedef struct {
    const uint8_t *codes;
    const float *scales, *offsets;
    int fmt, wb, K, nbp;
} weight_f32_t;

/* Row r times TT activations; xs [TT, nb]: each activation block's sum (the offset term's factor).
 * Per block: sum_j (s c_j + o) x_j = s (sum_j c_j x_j) + o (sum_j x_j) with the block parameters
 * kept exactly (fp32) and every sum in fp32: the rounding error is that of fp32 sums of s c x and
 * o x terms (with cancellation where o ~ -8 s, as in Q4_0), not that of the weights. */
static inline __attribute__((always_inline)) void row_dot_f32(const weight_f32_t *w, long r, int TT, const float *x,
                                                              const float *xs, float *out) {
    const int K = w->K, nb = K / 32, spb = 32 / w->wb;
    const float *sc = w->scales + r * (long)w->nbp * spb;
    const float *of = w->offsets ? w->offsets + r * (long)w->nbp : NULL;
    const uint8_t *cr = w->codes + r * (long)(w->fmt == FMT_U4 ? K / 2 : K);
#ifdef MEMRA_AVX2
    __m256 acc[4][2];
    float off[4] = {0, 0, 0, 0};
    for (int t = 0; t < TT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i c32 = w->fmt == FMT_U4 ? unpack_u4(cr + b * 16) : _mm256_loadu_si256((const __m256i *)(cr + b * 32));
        __m128i lo = _mm256_castsi256_si128(c32), hi = _mm256_extracti128_si256(c32, 1);
        __m256 cf[4];
        if (w->fmt == FMT_U4) {
            cf[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            cf[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            cf[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            cf[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        } else {
            cf[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
            cf[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
            cf[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
            cf[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        }
        const int a = b & 1; /* two chains per token, whatever TT (a token's sum does not depend on the
                              * tokens beside it); never a runtime index into acc: branched below */
        for (int t = 0; t < TT; t++) {
            const float *xb = x + (long)t * K + b * 32;
            __m256 p = _mm256_mul_ps(cf[0], _mm256_loadu_ps(xb));
            p = _mm256_fmadd_ps(cf[1], _mm256_loadu_ps(xb + 8), p);
            if (spb == 2) { /* a scale per 16 */
                __m256 p2 = _mm256_mul_ps(cf[2], _mm256_loadu_ps(xb + 16));
                p2 = _mm256_fmadd_ps(cf[3], _mm256_loadu_ps(xb + 24), p2);
                __m256 s = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[2 * b]), _mm256_mul_ps(p2, _mm256_set1_ps(sc[2 * b + 1])));
                if (a) acc[t][1] = _mm256_add_ps(acc[t][1], s);
                else acc[t][0] = _mm256_add_ps(acc[t][0], s);
            } else {
                p = _mm256_fmadd_ps(cf[2], _mm256_loadu_ps(xb + 16), p);
                p = _mm256_fmadd_ps(cf[3], _mm256_loadu_ps(xb + 24), p);
                if (a) acc[t][1] = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[b]), acc[t][1]);
                else acc[t][0] = _mm256_fmadd_ps(p, _mm256_set1_ps(sc[b]), acc[t][0]);
            }
            if (of) off[t] += of[b] * xs[(long)t * nb + b];
        }
    }
    for (int t = 0; t < TT; t++) out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + off[t];
#else
    float acc[4] = {0, 0, 0, 0};
    for (int b = 0; b < nb; b++) {
        for (int t = 0; t < TT; t++) {
            float p[2] = {0, 0};
            for (int j = 0; j < 32; j++) {
                int c;
                if (w->fmt == FMT_U4) c = j < 16 ? (cr[b * 16 + j] & 15) : (cr[b * 16 + j - 16] >> 4);
                else c = (int8_t)cr[b * 32 + j];
                p[j >= 16] += (float)c * x[(long)t * K + b * 32 + j];
            }
            acc[t] += spb == 2 ? p[0] * sc[2 * b] + p[1] * sc[2 * b + 1] : (p[0] + p[1]) * sc[b];
            if (of) acc[t] += of[b] * xs[(long)t * nb + b];
        }
    }
    for (int t = 0; t < TT; t++) out[t] = acc[t];
#endif
}

static inline void prefetch_row_f32(const weight_f32_t *w, long r) { /* fp32 block parameters */
    prefetch_weight_row(w->codes, w->fmt == FMT_U4 ? w->K / 2 : w->K, w->scales, (long)w->nbp * (32 / w->wb) * 4,
                        w->offsets, (long)w->nbp * 4, r);
}

static inline __attribute__((always_inline)) void rows_block_f32(const weight_f32_t *w, int TT, long r0, long r1,
                                                                 int t0, const float *x, const float *xsum,
                                                                 const float *bias, float *y, long N, int mode,
                                                                 float limit) {
    const float *xt = x + (long)t0 * w->K, *xs = xsum + (long)t0 * (w->K / 32);
    float a[4], b[4];
    const long I = N / 2;
    for (long r = r0; r < r0 + PREFETCH_ROWS && r < r1; r++) {
        prefetch_row_f32(w, r);
        if (mode == MODE_SWIGLU) prefetch_row_f32(w, r + I);
    }
    for (long r = r0; r < r1; r++) {
        if (r + PREFETCH_ROWS < r1) {
            prefetch_row_f32(w, r + PREFETCH_ROWS);
            if (mode == MODE_SWIGLU) prefetch_row_f32(w, r + I + PREFETCH_ROWS);
        }
        row_dot_f32(w, r, TT, xt, xs, a);
        if (mode == MODE_SWIGLU) {
            row_dot_f32(w, r + I, TT, xt, xs, b);
            for (int t = 0; t < TT; t++) {
                y[(long)(t0 + t) * I + r] = swiglu(a[t] + (bias ? bias[r] : 0.0f), b[t] + (bias ? bias[r + I] : 0.0f),
                                                   limit);
            }
        } else {
            for (int t = 0; t < TT; t++) y[(long)(t0 + t) * N + r] = a[t] + (bias ? bias[r] : 0.0f);
        }
    }
}

#define ROWS_BLOCK_F32_TT(W, tt)                                                                      \
    switch (tt) {                                                                                     \
    case 1: rows_block_f32(W, 1, r0, r1, t0, x, xs, bias, y, N, mode, limit); break;                 \
    case 2: rows_block_f32(W, 2, r0, r1, t0, x, xs, bias, y, N, mode, limit); break;                 \
    case 3: rows_block_f32(W, 3, r0, r1, t0, x, xs, bias, y, N, mode, limit); break;                 \
    default: rows_block_f32(W, 4, r0, r1, t0, x, xs, bias, y, N, mode, limit); break;                \
    }
int memra_gemv_f32(const float *x, int T, int K, long N, const uint8_t *codes, int fmt, int wb, int nbp,
                   const float *scales, const float *offsets, const float *bias, float *y, int mode, float limit,
                   int nthreads) {
    weight_f32_t w = {codes, scales, offsets, fmt, wb, K, nbp};
    long rows = mode == MODE_SWIGLU ? N / 2 : N;
    const long nb = K / 32;
    if (scratch(0, (long)T * nb)) return -1;
    float *xs = tl_d; /* block sums of x */
    for (long tb = 0; tb < (long)T * nb; tb++) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += x[tb * 32 + i];
        xs[tb] = s;
    }
    nthreads = team_size(rows, nthreads);
#pragma omp parallel num_threads(nthreads)
    {
        long r0, r1;
        thread_rows(rows, &r0, &r1);
        for (int t0 = 0; t0 < T && r0 < r1; t0 += 4) {
            const int tt = T - t0 < 4 ? T - t0 : 4;
            WITH_LITERAL_FORMAT(weight_f32_t, w, ROWS_BLOCK_F32_TT, tt);
        }
    }
    return 0;
}
#undef ROWS_BLOCK_F32_TT

/* ---------------------------------------------------------------------------------------- */
/* A Llama-family decode step over every decoder layer in one call (memra/models/llama.py
 * LlamaForCausalLM.Layer; Qwen2's q/k/v biases included): per layer
 *     h = rmsnorm(s += x);  q|k|v = h Wqkv^T (+ b);  rope(q, k);  K/V written, o = attention(q)
 *     h = rmsnorm(s += o Wo^T);  x = swiglu(h Wgu^T) Wd^T
 * by the same functions, in the same order and with the same roundings as the layer-by-layer
 * path (memra_rmsnorm_add, memra_gemv / memra_gemv_f32, memra_rope, attention_rows): the results
 * are bit-identical to it, without its ~8 ctypes calls and the Python between them per layer. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets; /* fp16 (fast mode) or fp32 (exact: memra_gemv_f32) */
    const float *bias;            /* fp32 [N] or NULL */
    long N;
    int K, fmt, wb, nbp, exact;
} linear_t;

typedef struct {
    linear_t qkv, o, gate_up, down; /* qkv rows [q (H D) | k (KV D) | v (KV D)]; gate_up [gate | up] */
    const float *attn_norm, *ffn_norm;
    float attn_eps, ffn_eps, scale, limit; /* limit: SwiGLU clamp, NaN for none */
    int H, KV, D, rot, cache;              /* cache: the layer's K/V slot in kc / vc */
} decoder_layer_t;

static int linear_apply(const linear_t *l, const void *x, int bf16, int T, void *y, int mode, float limit,
                        int nthreads) {
    if (l->exact)
        return memra_gemv_f32((const float *)x, T, l->K, l->N, l->codes, l->fmt, l->wb, l->nbp,
                              (const float *)l->scales, (const float *)l->offsets, l->bias, (float *)y, mode, limit,
                              nthreads);
    return memra_gemv(x, bf16, T, l->K, l->N, l->codes, l->fmt, l->wb, l->nbp, (const uint16_t *)l->scales,
                      (const uint16_t *)l->offsets, l->bias, y, bf16, mode, limit, nthreads);
}

static __thread unsigned char *tl_work;
static __thread size_t tl_cap_work;

/* x [T, Dm] (bf16 or fp32, in place): in, the first layer's input (has_residual 0: the embeddings)
 * or the last sublayer's pending output; out, the last layer's MLP output. s fp32 [T, Dm]: the
 * residual stream (read when has_residual), x + s after the call being the stream. cos / sin
 * [T, rot] (cs_bf16). A layer's caches kc[cache] / vc[cache] (fp32 [S, KV, D]) and the attention's
 * addressing (idx, lo, L, lens, wslots, wpos) are those of memra_decode_attention, one for all
 * layers. Returns 0; -1 if scratch could not be allocated; -2 / -3 as memra_decode_attention (a
 * length or slot out of range: checked before layer 0 writes anything). */
int memra_decoder_layers(const decoder_layer_t *layers, int nl, int T, int Dm, int bf16, void *x, float *s,
                         int has_residual, const void *cos_t, const void *sin_t, int cs_bf16, float *const *kc,
                         float *const *vc, long S, const int64_t *idx, long lo, int L, const int64_t *lens,
                         const int64_t *wslots, long wpos, int nthreads) {
    const size_t es = bf16 ? 2 : 4;
    long nqkv = 0, natt = 0, nmid = 0;
    for (int l = 0; l < nl; l++) {
        const decoder_layer_t *ly = &layers[l];
        nqkv = ly->qkv.N > nqkv ? ly->qkv.N : nqkv;
        natt = (long)ly->H * ly->D > natt ? (long)ly->H * ly->D : natt;
        nmid = ly->gate_up.N / 2 > nmid ? ly->gate_up.N / 2 : nmid;
    }
    const size_t need = es * (size_t)T * (size_t)(Dm + nqkv + natt + nmid) + 256;
    if (need > tl_cap_work) {
        free(tl_work);
        tl_work = (unsigned char *)aligned_alloc(64, (need + 63) / 64 * 64);
        tl_cap_work = tl_work ? need : 0;
        if (!tl_work) return -1;
    }
    unsigned char *h = tl_work, *qkv = h + es * T * Dm, *att = qkv + es * T * nqkv, *mid = att + es * T * natt;
    int rc = 0;
    for (int l = 0; l < nl && rc == 0; l++) {
        const decoder_layer_t *ly = &layers[l];
        const int H = ly->H, KV = ly->KV, D = ly->D;
        const long N = ly->qkv.N;
        memra_rmsnorm_add(x, bf16, (l == 0 && !has_residual) ? NULL : s, s, ly->attn_norm, ly->attn_eps, T, Dm, h, bf16);
        if ((rc = linear_apply(&ly->qkv, h, bf16, T, qkv, MODE_STORE, NAN, nthreads))) break;
        memra_rope(qkv, bf16, T, N, H + KV, D, ly->rot, cos_t, sin_t, cs_bf16);
        rc = attention_rows(qkv, N, bf16, T, H, KV, D, kc[ly->cache], vc[ly->cache], S, idx, lo, L, lens, ly->scale, att, bf16,
                            qkv + es * (size_t)H * D, qkv + es * (size_t)(H + KV) * D, N, bf16, wslots, wpos, nthreads);
        if (rc) break;
        if ((rc = linear_apply(&ly->o, att, bf16, T, x, MODE_STORE, NAN, nthreads))) break;
        memra_rmsnorm_add(x, bf16, s, s, ly->ffn_norm, ly->ffn_eps, T, Dm, h, bf16);
        if ((rc = linear_apply(&ly->gate_up, h, bf16, T, mid, MODE_SWIGLU, ly->limit, nthreads))) break;
        rc = linear_apply(&ly->down, mid, bf16, T, x, MODE_STORE, NAN, nthreads);
    }
    return rc;
}
