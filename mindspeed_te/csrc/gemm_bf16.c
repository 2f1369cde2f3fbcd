/* a · bᵀ with float32 sums of exact products, for operands whose values are all bfloat16 values: FP8/HiF8 codes
 * (read through their format's table), bfloat16 tensors, or float32 tensors holding bfloat16 values.
 *
 * Why: a per-tensor FP8 GEMM must give the float32 sum of the decoded codes before its scales are applied, and
 * CPU torch has no bfloat16 x bfloat16 -> float32 matmul; its float32 matmul (even on oneDNN's bf16 kernel)
 * costs twice the bfloat16 one on a CPU with AVX-512 BF16. This GEMM runs VDPBF16PS, reads the codes straight
 * into its packed panels (no decoded copy) and, for a GPT's linears, costs about 1.1x torch's bfloat16 GEMM
 * (the packing is most of the difference). Matrix-vector products are slower here; the caller keeps those.
 *
 * The sum is defined exactly: every output is one float32 accumulator that, for k = 0, 2, 4, ..., adds the
 * product of k + 1 and then that of k, each addition rounded to nearest even (VDPBF16PS's order, Intel SDM;
 * inputs and results below float32's normal range count as zero). Blocking over k reloads the accumulator and
 * goes on in the same order, so the result does not depend on blocking, threads or layout.
 *
 * C (M, N) is float32, contiguous. An operand is (rows, K) elements at rs * r + cs * k of its buffer. Needs
 * AVX-512 BF16 (gemm_bf16_supported); the caller uses another GEMM without it.
 */
#include "kernels.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OP_BF16 = 0, OP_F32 = 1, OP_CODES = 2 };

typedef struct {
    const void *data;
    int64_t rs, cs;     /* element strides of rows and of k */
    int kind;           /* OP_BF16, OP_F32 (the top 16 bits of each float32) or OP_CODES (uint8) */
    uint16_t lut[256];  /* OP_CODES: the bfloat16 bits of each code's value */
} Operand;

/* The top half of a float32 holding a bfloat16 value; a NaN whose payload lies in the low half only would
 * become Inf there, so NaNs keep their sign and become the quiet NaN. */
static inline uint16_t f32_to_bf16_bits(uint32_t u) {
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((u >> 16) | 0x7FC0u) : (uint16_t)(u >> 16);
}

#define MR 12   /* rows of a and columns of b per micro-kernel call */
#define NR 32
#ifndef KC
#define KC 256  /* k per block (even) */
#endif
#ifndef MC
#define MC 96   /* rows of a per packed block (a multiple of MR) */
#endif
_Static_assert(KC % 2 == 0 && MC % MR == 0 && NR == 32 && MR <= 16, "the blocking the packing and kernel assume");

#if defined(MINDSPEED_HAVE_AVX512BF16)
#include <immintrin.h>

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* The bfloat16 bits of element (r, k). */
static inline uint16_t element(const Operand *o, int64_t r, int64_t k) {
    const int64_t i = r * o->rs + k * o->cs;
    if (o->kind == OP_CODES) return o->lut[((const uint8_t *)o->data)[i]];
    if (o->kind == OP_F32) { uint32_t u; memcpy(&u, (const float *)o->data + i, 4); return f32_to_bf16_bits(u); }
    return ((const uint16_t *)o->data)[i];
}

/* Any layout: out[p * w + i] = elements (r0 + i, k0 + 2p) low and (r0 + i, k0 + 2p + 1) high, zero outside
 * `rows` and `kc`. */
static void pack_any(uint32_t *out, int w, const Operand *o, int64_t r0, int64_t rows, int64_t k0, int64_t kc) {
    for (int64_t p = 0; p < (kc + 1) / 2; ++p)
        for (int i = 0; i < w; ++i) {
            uint32_t lo = 0, hi = 0;
            if (i < rows) {
                lo = element(o, r0 + i, k0 + 2 * p);
                if (2 * p + 1 < kc) hi = element(o, r0 + i, k0 + 2 * p + 1);
            }
            out[p * w + i] = lo | hi << 16;
        }
}


/* f32_to_bf16_bits of 16 lanes, in the low half of each. */
AVX512BF16 static inline __m512i top_halves(__m512i u) {
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i top = _mm512_srli_epi32(u, 16);
    return _mm512_mask_or_epi32(top, nan, top, _mm512_set1_epi32(0x7FC0));
}

/* n (<= 32) contiguous elements from p as 32 bfloat16 bit patterns, zero past n. */
AVX512BF16 static inline __m512i load32(const Operand *o, const void *p, int n) {
    const __mmask32 m = n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1);
    if (o->kind == OP_BF16) return _mm512_maskz_loadu_epi16(m, p);
    if (o->kind == OP_F32) {
        const float *f = (const float *)p;
        const __m512i lo = top_halves(_mm512_castps_si512(_mm512_maskz_loadu_ps((__mmask16)m, f)));
        const __m512i hi = top_halves(_mm512_castps_si512(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), f + 16)));
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
    }
    /* codes: 4 lookups of 64 entries (bits 0..5 of each code), chosen by bits 6 and 7 */
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p));
    const __m512i *t = (const __m512i *)o->lut;
    const __m512i q0 = _mm512_permutex2var_epi16(_mm512_loadu_si512(t), idx, _mm512_loadu_si512(t + 1));
    const __m512i q1 = _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 2), idx, _mm512_loadu_si512(t + 3));
    const __m512i q2 = _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 4), idx, _mm512_loadu_si512(t + 5));
    const __m512i q3 = _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 6), idx, _mm512_loadu_si512(t + 7));
    const __mmask32 b6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(64));
    const __mmask32 b7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(128));
    const __m512i lo = _mm512_mask_blend_epi16(b6, q0, q1), hi = _mm512_mask_blend_epi16(b6, q2, q3);
    const __m512i v = _mm512_mask_blend_epi16(b7, lo, hi);
    return _mm512_maskz_mov_epi16(m, v);
}

static inline const void *at(const Operand *o, int64_t r, int64_t k) {
    const int64_t i = r * o->rs + k * o->cs;
    const int size = o->kind == OP_BF16 ? 2 : o->kind == OP_F32 ? 4 : 1;
    return (const char *)o->data + i * size;
}

/* Rows contiguous along k (cs == 1): 16 rows x 16 pairs are loaded and transposed per step. */
AVX512BF16 static void pack_rows(uint32_t *out, int w, const Operand *o, int64_t r0, int64_t rows, int64_t k0,
                                 int64_t kc) {
    const int64_t pairs = (kc + 1) / 2;
    for (int i0 = 0; i0 < w; i0 += 16) {
        const int64_t in_panel = w - i0 < 16 ? w - i0 : 16;
        const int64_t n_rows = rows - i0 < 0 ? 0 : rows - i0 > in_panel ? in_panel : rows - i0;
        const __mmask16 keep = (__mmask16)((1u << (w - i0 < 16 ? w - i0 : 16)) - 1);
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const int n = (int)(kc - 2 * p0 < 32 ? kc - 2 * p0 : 32);
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = i < n_rows ? load32(o, at(o, r0 + i0 + i, k0 + 2 * p0), n) : _mm512_setzero_si512();
            /* 16 x 16 dword transpose */
            __m512i t[16], u[16];
            for (int i = 0; i < 16; i += 2) {
                t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int i = 0; i < 16; i += 4) {
                u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
                u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
                u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
                u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            for (int i = 0; i < 4; ++i) {
                t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
                t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xDD);
                t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
                t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xDD);
            }
            for (int i = 0; i < 8; ++i) {
                r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
                r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
            }
            for (int q = 0; q < 16 && p0 + q < pairs; ++q) /* r[q]: pair q of rows i0..i0+15 */
                _mm512_mask_storeu_epi32(out + (p0 + q) * w + i0, keep, r[q]);
        }
    }
}

/* Rows contiguous along r (rs == 1): elements k and k + 1 of w consecutive rows, interleaved. */
AVX512BF16 static void pack_cols(uint32_t *out, int w, const Operand *o, int64_t r0, int64_t rows, int64_t k0,
                                 int64_t kc) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    const int n = (int)(rows < w ? rows : w);
    for (int64_t p = 0; p < (kc + 1) / 2; ++p) {
        const __m512i even = load32(o, at(o, r0, k0 + 2 * p), n);
        const __m512i odd = 2 * p + 1 < kc ? load32(o, at(o, r0, k0 + 2 * p + 1), n) : _mm512_setzero_si512();
        _mm512_mask_storeu_epi32(out + p * w, (__mmask16)(w >= 16 ? 0xFFFF : (1u << w) - 1),
                                 _mm512_permutex2var_epi16(even, first, odd));
        if (w > 16) _mm512_storeu_si512(out + p * w + 16, _mm512_permutex2var_epi16(even, second, odd));
    }
}

static void pack(uint32_t *out, int w, const Operand *o, int64_t r0, int64_t rows, int64_t k0, int64_t kc) {
    if (o->cs == 1) pack_rows(out, w, o, r0, rows, k0, kc);
    else if (o->rs == 1) pack_cols(out, w, o, r0, rows, k0, kc);
    else pack_any(out, w, o, r0, rows, k0, kc);
}

/* c[0:rows, 0:cols] (row stride ldc) = (first ? 0 : c) + the pairs of packed a (MR wide) and b (NR wide). */
AVX512BF16 static void micro_kernel(const uint32_t *a, const uint32_t *b, int64_t pairs, float *c, int64_t ldc,
                                    int rows, int cols, int first) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    __m512 acc[MR][2];
    for (int i = 0; i < MR; ++i) {
        const int load = !first && i < rows;
        acc[i][0] = load ? _mm512_maskz_loadu_ps(m0, c + i * ldc) : _mm512_setzero_ps();
        acc[i][1] = load ? _mm512_maskz_loadu_ps(m1, c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * NR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * NR + 16);
        for (int i = 0; i < MR; ++i) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[p * MR + i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, b1);
        }
    }
    for (int i = 0; i < rows; ++i) {
        _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
        _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
    }
}

/* Both operands are packed once, before any product, by all threads: panels of MR rows of a and of NR rows of
 * b, per block of KC k (k block kb starts at pairs offset kb * KC / 2 of every panel's run of blocks). */
typedef struct {
    uint32_t *data;
    int64_t panels;  /* ceil(rows / width) */
    int width;
} Packed;

static inline uint32_t *panel(const Packed *p, int64_t k0, int64_t pairs, int64_t q) {
    return p->data + p->panels * p->width * (k0 / 2) + q * p->width * pairs;
}

typedef struct {
    const Operand *a, *b;
    const Packed *ap, *bp;
    float *c;
    int64_t m, n, k;
    int64_t a0, a1, b0, b1;  /* packing: panels [a0, a1) of a and [b0, b1) of b */
    int64_t m0, m1, n0, n1;  /* products: rows [m0, m1) and columns [n0, n1) of c (m0, n0: multiples of MR, NR) */
} GemmJob;

static void pack_job(GemmJob *j) {
    for (int64_t k0 = 0; k0 < j->k; k0 += KC) {
        const int64_t kc = j->k - k0 < KC ? j->k - k0 : KC, pairs = (kc + 1) / 2;
        for (int64_t q = j->a0; q < j->a1; ++q) pack(panel(j->ap, k0, pairs, q), MR, j->a, q * MR, j->m - q * MR, k0, kc);
        for (int64_t q = j->b0; q < j->b1; ++q) pack(panel(j->bp, k0, pairs, q), NR, j->b, q * NR, j->n - q * NR, k0, kc);
    }
}

/* For each k block: MC rows of a at a time against every panel of b, so that those rows stay in cache. */
static void product_job(GemmJob *j) {
    for (int64_t k0 = 0; k0 < j->k; k0 += KC) {
        const int64_t kc = j->k - k0 < KC ? j->k - k0 : KC, pairs = (kc + 1) / 2;
        for (int64_t i0 = j->m0; i0 < j->m1; i0 += MC) {
            const int64_t i1 = j->m1 - i0 < MC ? j->m1 : i0 + MC;
            for (int64_t c0 = j->n0; c0 < j->n1; c0 += NR) {
                const int cols = (int)(j->n1 - c0 < NR ? j->n1 - c0 : NR);
                for (int64_t r = i0; r < i1; r += MR)
                    micro_kernel(panel(j->ap, k0, pairs, r / MR), panel(j->bp, k0, pairs, c0 / NR), pairs,
                                 j->c + r * j->n + c0, j->n, (int)(i1 - r < MR ? i1 - r : MR), cols, k0 == 0);
            }
        }
    }
}

static void *run_pack(void *arg) { pack_job((GemmJob *)arg); return NULL; }
static void *run_product(void *arg) { product_job((GemmJob *)arg); return NULL; }

/* [i * step, (i + 1) * step) clipped to [0, n). */
/* c = a · bᵀ on t threads: the packing split by panels, the products by the longer side of c. */
static int gemm_run(const Operand *a, const Operand *b, float *c, int64_t m, int64_t n, int64_t k, int64_t t) {
    const int64_t pairs = (k + 1) / 2;
    Packed ap = {NULL, (m + MR - 1) / MR, MR}, bp = {NULL, (n + NR - 1) / NR, NR};
    ap.data = malloc((size_t)(ap.panels * MR * pairs) * 4);
    bp.data = malloc((size_t)(bp.panels * NR * pairs) * 4);
    if (!ap.data || !bp.data) { free(ap.data); free(bp.data); return 0; }
    GemmJob jobs[MAX_THREADS];
    const int64_t a_step = (ap.panels + t - 1) / t, b_step = (bp.panels + t - 1) / t;
    const int split_m = m >= n;
    const int64_t side = split_m ? m : n, tile = split_m ? MR : NR;
    const int64_t step = ((side + t - 1) / t + tile - 1) / tile * tile;
    for (int64_t i = 0; i < t; ++i) {
        const int64_t s0 = job_start(i, step, side), s1 = job_start(i + 1, step, side);
        jobs[i] = (GemmJob){a, b, &ap, &bp, c, m, n, k, job_start(i, a_step, ap.panels), job_start(i + 1, a_step, ap.panels),
                            job_start(i, b_step, bp.panels), job_start(i + 1, b_step, bp.panels),
                            split_m ? s0 : 0, split_m ? s1 : m, split_m ? 0 : s0, split_m ? n : s1};
    }
    run_jobs(run_pack, jobs, sizeof(GemmJob), t);
    run_jobs(run_product, jobs, sizeof(GemmJob), t);
    free(ap.data);
    free(bp.data);
    return 1;
}

int gemm_bf16_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
#else
int gemm_bf16_supported(void) { return 0; }
#endif

/* Reads one operand's arguments: (data, rs, cs, kind, table): table is the address of the 256 float32 values of
 * the codes (OP_CODES only). */
static int parse_operand(PyObject *args, Operand *o) {
    unsigned long long data, table;
    long long rs, cs;
    if (!PyArg_ParseTuple(args, "KLLiK", &data, &rs, &cs, &o->kind, &table)) return 0;
    if (o->kind < OP_BF16 || o->kind > OP_CODES || (o->kind == OP_CODES && !table)) {
        PyErr_SetString(PyExc_ValueError, "gemm_bf16: an operand's kind must be 0, 1 or 2 (codes, with a table)");
        return 0;
    }
    o->data = (const void *)data;
    o->rs = rs;
    o->cs = cs;
    if (o->kind == OP_CODES)
        for (int i = 0; i < 256; ++i) {
            uint32_t u;
            memcpy(&u, (const float *)table + i, 4);
            o->lut[i] = f32_to_bf16_bits(u);
        }
    return 1;
}

PyObject *py_gemm_bf16(PyObject *self, PyObject *args) {
    PyObject *a_args, *b_args;
    unsigned long long c;
    long long m, n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "O!O!KLLLi", &PyTuple_Type, &a_args, &PyTuple_Type, &b_args, &c, &m, &n, &k,
                          &threads))
        return NULL;
    if (!gemm_bf16_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "gemm_bf16: this CPU has no AVX-512 BF16");
        return NULL;
    }
    if (m < 0 || n < 0 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "gemm_bf16: negative shape");
        return NULL;
    }
    Operand ops[2];
    if (!parse_operand(a_args, &ops[0]) || !parse_operand(b_args, &ops[1])) return NULL;
    int done = 1;
#if defined(MINDSPEED_HAVE_AVX512BF16)
    /* threads that each get 2^17 multiply-adds or more, and a row of micro-tiles */
    int64_t t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    const int64_t tiles = m >= n ? (m + MR - 1) / MR : (n + NR - 1) / NR;
    if (t > tiles) t = tiles;
    if (t > 1 && m * n * k < (t << 17)) t = 1;
    Py_BEGIN_ALLOW_THREADS
    if (k == 0) memset((void *)c, 0, (size_t)(m * n) * sizeof(float));
    else done = gemm_run(&ops[0], &ops[1], (float *)c, m, n, k, t);
    Py_END_ALLOW_THREADS
#else
    (void)threads;
#endif
    if (!done) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
