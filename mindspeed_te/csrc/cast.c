/* The per-tensor quantize: amax and the saturating scaled cast to E4M3 / E5M2 / HiF8 (scaled_cast, amax, and
 * quantize: both passes with the scale between them; current_scale_inv), with their AVX2 / AVX-512 loops.
 *
 * torch runs `x / scale_inv`, the clamp and the cast as separate passes over memory; here each element is
 * read once, divided, rounded and written as one byte, on all of torch's threads. Results equal the torch
 * ops bit for bit (IEEE division, round-to-nearest-even for E4M3/E5M2, HiF8 by the same 65536-entry table
 * on the top 16 bits of the quotient), which the tests check against the torch path and the oracles.
 */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"

#include <math.h>
#include <stdint.h>

/* Locals and restrict: a uint8 store may alias anything, and without them the loops reload their bounds. */
#define CAST_LOOP(LOAD, CONVERT)                                                                         \
    for (int64_t i = begin; i < end; ++i) out[i] = CONVERT(LOAD / s);
#define TO_HIF8(q) to_hif8(table, q)
#define BF16(i) float_of((uint32_t)in16[i] << 16)

#if defined(__x86_64__)
/* 16 floats of the input from element i: float32, or bfloat16 widened. */
__attribute__((target("avx512f"))) static inline __m512 load16_avx512(const void *in, int in_dtype, int64_t i) {
    if (in_dtype == IN_F32) return _mm512_loadu_ps((const float *)in + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)in + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* E4M3 / E5M2 cast of [begin, end) 32 elements at a time; returns where the scalar loop takes over. */
__attribute__((target("avx2"))) static int64_t cast_fp8_avx2(const Job *j, int64_t begin, int64_t end) {
    const int e4m3 = j->out_format == OUT_E4M3;
    const int mbits = e4m3 ? 3 : 2;
    const int32_t min_normal = e4m3 ? 121 : 113, max_bits = e4m3 ? 0x43E00000 : 0x47600000;
    const int32_t nan_bit = e4m3 ? 0x00100000 : 0x00800000;
    const __m256 s = _mm256_set1_ps(j->scale_inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = begin;
    for (; i + 32 <= end; i += 32) {
        __m256i c[4];
        for (int k = 0; k < 4; ++k)
            c[k] = fp8_codes_avx2(_mm256_div_ps(load8_avx2(j->in, j->in_dtype, i + 8 * k), s), mbits, min_normal,
                                  max_bits, nan_bit);
        __m256i words = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(j->out + i), _mm256_permutevar8x32_epi32(words, order));
    }
    return i;
}

/* HiF8 codes by the 65536-entry table, 8 (AVX2) or 16 (AVX-512) elements at a time: each lane gathers the 4
 * table bytes ending at its index (so every read stays inside the table) and keeps the top one; indices 0..2,
 * which have no 3 bytes before them, take their codes from registers. Returns where the scalar loop takes
 * over. */
__attribute__((target("avx2"))) static int64_t cast_hif8_avx2(const Job *j, int64_t begin, int64_t end) {
    const __m256 s = _mm256_set1_ps(j->scale_inv);
    const int *base = (const int *)(const void *)(j->table - 3);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i first = _mm256_setr_epi32(j->table[0], j->table[1], j->table[2], 0, 0, 0, 0, 0);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        const __m256i idx = _mm256_srli_epi32(_mm256_castps_si256(_mm256_div_ps(load8_avx2(j->in, j->in_dtype, i), s)), 16);
        __m256i code = _mm256_srli_epi32(_mm256_i32gather_epi32(base, _mm256_max_epu32(idx, three), 1), 24);
        code = _mm256_blendv_epi8(code, _mm256_permutevar8x32_epi32(first, idx), _mm256_cmpgt_epi32(three, idx));
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64((__m128i *)(j->out + i), _mm_packus_epi16(words, words));
    }
    return i;
}

__attribute__((target("avx512f,avx512bw"))) static int64_t cast_hif8_avx512(const Job *j, int64_t begin, int64_t end) {
    const __m512 s = _mm512_set1_ps(j->scale_inv);
    const void *base = j->table - 3;
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i first = _mm512_setr_epi32(j->table[0], j->table[1], j->table[2], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0);
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        const __m512 x = load16_avx512(j->in, j->in_dtype, i);
        const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(_mm512_div_ps(x, s)), 16);
        __m512i code = _mm512_srli_epi32(_mm512_i32gather_epi32(_mm512_max_epu32(idx, three), base, 1), 24);
        code = _mm512_mask_permutexvar_epi32(code, _mm512_cmplt_epu32_mask(idx, three), idx, first);
        _mm_storeu_si128((__m128i *)(j->out + i), _mm512_cvtepi32_epi8(code));
    }
    return i;
}

/* The per-tensor E4M3 / E5M2 cast of [begin, end), 64 elements at a time with the tiles' code (magnitude16,
 * bytes64, with_signs: a quarter of the AVX2 loop's instructions per element); returns where the AVX2 loop
 * takes over. */
AVX512 static inline __attribute__((always_inline)) int64_t cast_fp8_64(const Job *j, int64_t begin, int64_t end,
                                                                         const int e4m3, const int f32) {
    const __m512 s = _mm512_set1_ps(j->scale_inv);
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) {
        __m512 x[4];
        __m512i c[4];
        for (int k = 0; k < 4; ++k) {
            x[k] = load16_avx512(j->in, f32 ? IN_F32 : IN_BF16, i + 16 * k);
            c[k] = magnitude16(_mm512_div_ps(x[k], s), e4m3, 1);
        }
#define X(k) _mm512_castps_si512(x[k])
        const __m512i signs = bytes64(X(0), X(1), X(2), X(3), 3);
#undef X
        _mm512_storeu_si512((void *)(j->out + i), with_signs(bytes64(c[0], c[1], c[2], c[3], 0), signs));
    }
    return i;
}

AVX512 static int64_t cast_fp8_avx512(const Job *j, int64_t begin, int64_t end) {
    const int e4m3 = j->out_format == OUT_E4M3;
    if (j->in_dtype == IN_F32) return e4m3 ? cast_fp8_64(j, begin, end, 1, 1) : cast_fp8_64(j, begin, end, 0, 1);
    return e4m3 ? cast_fp8_64(j, begin, end, 1, 0) : cast_fp8_64(j, begin, end, 0, 0);
}
#endif

static void cast_range(Job *j) {
    const float s = j->scale_inv;
    int64_t begin = j->begin;
    const int64_t end = j->end;
    uint8_t *restrict out = j->out;
    const uint8_t *restrict table = j->table;
#if defined(__x86_64__)
    if (simd_level() >= SIMD_AVX512)
        begin = j->out_format == OUT_HIF8 ? cast_hif8_avx512(j, begin, end) : cast_fp8_avx512(j, begin, end);
    if (has_avx2()) begin = j->out_format == OUT_HIF8 ? cast_hif8_avx2(j, begin, end) : cast_fp8_avx2(j, begin, end);
#endif
    if (j->in_dtype == IN_F32) {
        const float *restrict in = (const float *)j->in;
        if (j->out_format == OUT_E4M3) { CAST_LOOP(in[i], to_e4m3) }
        else if (j->out_format == OUT_E5M2) { CAST_LOOP(in[i], to_e5m2) }
        else { CAST_LOOP(in[i], TO_HIF8) }
    } else {
        const uint16_t *restrict in16 = (const uint16_t *)j->in;
        if (j->out_format == OUT_E4M3) { CAST_LOOP(BF16(i), to_e4m3) }
        else if (j->out_format == OUT_E5M2) { CAST_LOOP(BF16(i), to_e5m2) }
        else { CAST_LOOP(BF16(i), TO_HIF8) }
    }
}

/* max |x| as float32 bits: non-negative floats order like their bit patterns, and NaNs sort above Inf.
 * Plain C that compilers vectorize; AVX2 (when the CPU has it) brings the unsigned max SSE2 lacks. */
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
static void amax_range(Job *j) {
    uint32_t m = 0;
    const int64_t begin = j->begin, end = j->end;
    if (j->in_dtype == IN_F32) {
        const uint32_t *restrict in = (const uint32_t *)j->in;
        for (int64_t i = begin; i < end; ++i) { uint32_t a = in[i] & 0x7FFFFFFFu; m = a > m ? a : m; }
    } else {
        const uint16_t *restrict in = (const uint16_t *)j->in;
        uint16_t m16 = 0;
        for (int64_t i = begin; i < end; ++i) { uint16_t a = in[i] & 0x7FFFu; m16 = a > m16 ? a : m16; }
        m = (uint32_t)m16 << 16;
    }
    j->amax_bits = m;
}

/* max |in| over [0, n) on up to `threads` threads, as float32 (the canonical quiet NaN if any NaN). */
static float amax_of(const void *in, int in_dtype, int64_t n, int threads) {
    Job proto = {in, in_dtype, 0, 0, 1.0f, NULL, 0, NULL, 0, NULL, NULL, NULL};
    Job jobs[MAX_THREADS];
    int used;
    uint32_t m = 0;
    parallel(amax_range, &proto, n, threads, jobs, &used);
    for (int k = 0; k < used; ++k) m = jobs[k].amax_bits > m ? jobs[k].amax_bits : m;
    return float_of(m > 0x7F800000u ? 0x7FC00000u : m);
}

static void cast_all(const void *in, int in_dtype, int64_t n, float scale_inv, void *out, int out_format,
                     const void *table, int threads) {
    Job proto = {in, in_dtype, 0, 0, scale_inv, (uint8_t *)out, out_format, (const uint8_t *)table, 0, NULL, NULL,
                 NULL};
    Job jobs[MAX_THREADS];
    int used;
    parallel(cast_range, &proto, n, threads, jobs, &used);
}

int check_formats(int in_dtype, int out_format, unsigned long long table, long long n) {
    if ((in_dtype != IN_F32 && in_dtype != IN_BF16) || out_format < OUT_E4M3 || out_format > OUT_HIF8 ||
        (out_format == OUT_HIF8 && !table) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "bad input dtype, output format, size or missing HiF8 table");
        return 0;
    }
    return 1;
}

PyObject *py_scaled_cast(PyObject *self, PyObject *args) {
    unsigned long long in, scale_inv, out, table;
    long long n;
    int in_dtype, out_format, threads;
    if (!PyArg_ParseTuple(args, "KiLKKiKi", &in, &in_dtype, &n, &scale_inv, &out, &out_format, &table, &threads))
        return NULL;
    if (!check_formats(in_dtype, out_format, table, n)) return NULL;
    const float s = *(const float *)scale_inv;
    Py_BEGIN_ALLOW_THREADS
    cast_all((const void *)in, in_dtype, n, s, (void *)out, out_format, (const void *)table, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject *py_amax(PyObject *self, PyObject *args) {
    unsigned long long in, out;
    long long n;
    int in_dtype, threads;
    if (!PyArg_ParseTuple(args, "KiLKi", &in, &in_dtype, &n, &out, &threads)) return NULL;
    if (!check_formats(in_dtype, OUT_E4M3, 0, n)) return NULL;
    float m;
    Py_BEGIN_ALLOW_THREADS
    m = amax_of((const void *)in, in_dtype, n, threads);
    Py_END_ALLOW_THREADS
    *(float *)out = m;
    Py_RETURN_NONE;
}

PyObject *py_current_scale_inv(PyObject *self, PyObject *args) {
    unsigned long long amax, out;
    double fp8_max, eps;
    int pow2;
    if (!PyArg_ParseTuple(args, "KKddp", &amax, &out, &fp8_max, &eps, &pow2)) return NULL;
    *(float *)out = current_scale_inv(*(const float *)amax, (float)fp8_max, (float)eps, pow2);
    Py_RETURN_NONE;
}

/* A whole per-tensor quantize in one call: the amax pass, the scale, the cast pass. Delayed scaling
 * (scale given): max-accumulate the amax into *amax (NaN wins, as torch.maximum) and cast with 1 / *scale.
 * Current scaling (no scale): cast with current_scale_inv(amax). *scale_inv_out receives the scale used,
 * or NaN when the input holds NaN/Inf. */
PyObject *py_quantize(PyObject *self, PyObject *args) {
    unsigned long long in, out, table, amax, divisor, scale_inv_out;
    long long n;
    int in_dtype, out_format, threads, pow2;
    double fp8_max, eps;
    if (!PyArg_ParseTuple(args, "KiLKiKiKKKddp", &in, &in_dtype, &n, &out, &out_format, &table, &threads, &amax,
                          &divisor, &scale_inv_out, &fp8_max, &eps, &pow2))
        return NULL;
    if (!check_formats(in_dtype, out_format, table, n)) return NULL;
    float scale_inv, m;
    Py_BEGIN_ALLOW_THREADS
    m = amax_of((const void *)in, in_dtype, n, threads);
    if (divisor) { /* delayed scaling: the divisor comes with the scale, the amax goes to the history */
        float old = *(float *)amax;
        *(float *)amax = (isnan(old) || isnan(m)) ? NAN : (m > old ? m : old);
        scale_inv = *(const float *)divisor;
    } else {
        scale_inv = current_scale_inv(m, (float)fp8_max, (float)eps, pow2);
    }
    cast_all((const void *)in, in_dtype, n, scale_inv, (void *)out, out_format, (const void *)table, threads);
    Py_END_ALLOW_THREADS
    /* NaN/Inf data: the codes come from a finite cast, the scale_inv that travels with them is NaN, so the
     * tensor dequantizes to NaN (mindspeed_te.scaling.mark_nonfinite). */
    *(float *)scale_inv_out = isfinite(m) ? scale_inv : NAN;
    Py_RETURN_NONE;
}
