/* Fused CPU kernels for the quantize hot path: amax and saturating scaled cast to E4M3 / E5M2 / HiF8.
 *
 * torch runs `x / scale_inv`, the clamp and the cast as separate passes over memory; here each element is
 * read once, divided, rounded and written as one byte, on all of torch's threads. Results equal the torch
 * ops bit for bit (IEEE division, round-to-nearest-even for E4M3/E5M2, HiF8 by the same 65536-entry table
 * on the top 16 bits of the quotient), which the tests check against the torch path and the oracles.
 *
 * The functions take raw addresses of contiguous CPU tensors (Tensor.data_ptr()) and release the GIL.
 * Build: setup.py compiles this as the optional extension mindspeed_te._fused_cast, with OpenMP where the
 * compiler has it (the jobs then run on torch's OpenMP threads; `openmp` in the module says which), else with
 * pthreads; without it the package uses the torch ops (mindspeed_te.fused_cast decides).
 */
#include "kernels.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_OPENMP)
#include <pthread.h>
#endif

enum { IN_F32 = 0, IN_BF16 = 1 };
enum { OUT_E4M3 = 0, OUT_E5M2 = 1, OUT_HIF8 = 2 };
#define MIN_PER_THREAD (1 << 16)

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Saturating round-to-nearest-even of q to an OCP 8-bit float with `mbits` mantissa bits whose smallest
 * normal has float32 exponent field `min_normal` and whose largest finite value has float32 bits `max_bits`.
 *
 * One float addition does the rounding: adding 2^(e + 23 - mbits), with e the binade of |q| (at least the
 * smallest normal one), leaves exactly the mantissa bits the format keeps, rounded to nearest even, in
 * the sum's low bits, subnormals included. The code is then the binade's code plus that count.
 * Branch-free so that it vectorizes. A NaN becomes the next value past max_bits (its `nan_bit` set),
 * which is the format's NaN code 0x7F. */
static inline uint8_t to_fp8(float q, int32_t mbits, int32_t min_normal, int32_t max_bits, int32_t nan_bit) {
    uint32_t u = bits_of(q);
    int32_t a = (int32_t)(u & 0x7FFFFFFFu);
    int32_t nan = -(int32_t)(a > 0x7F800000) & nan_bit;
    a = (a < max_bits ? a : max_bits) | nan;
    int32_t e = a >> 23;
    e = e > min_normal ? e : min_normal;
    int32_t magic = (e + 23 - mbits) << 23;
    int32_t count = (int32_t)bits_of(float_of((uint32_t)a) + float_of((uint32_t)magic)) - magic;
    return (uint8_t)((((e - min_normal) << mbits) + count) | (int32_t)((u >> 24) & 0x80u));
}

/* E4M3: 3 mantissa bits, smallest normal 2^-6, max 448, NaN 0x7F (no Inf). */
static inline uint8_t to_e4m3(float q) { return to_fp8(q, 3, 121, 0x43E00000, 0x00100000); }
/* E5M2: 2 mantissa bits, smallest normal 2^-14, max 57344, NaN 0x7F. */
static inline uint8_t to_e5m2(float q) { return to_fp8(q, 2, 113, 0x47600000, 0x00800000); }

typedef struct {
    const void *in;
    int in_dtype;
    int64_t begin, end;
    float scale_inv;
    uint8_t *out;
    int out_format;
    const uint8_t *table;
    uint32_t amax_bits;
    const float *values; /* decode: the value of each of the 256 codes */
    float *decoded;
    const struct Bf16Planes *planes; /* decode: values as byte planes, or NULL (see decode_vbmi) */
} Job;

/* Locals and restrict: a uint8 store may alias anything, and without them the loops reload their bounds. */
#define CAST_LOOP(LOAD, CONVERT)                                                                         \
    for (int64_t i = begin; i < end; ++i) out[i] = CONVERT(LOAD / s);

static inline uint8_t to_hif8(const uint8_t *restrict table, float q) { return table[bits_of(q) >> 16]; }
#define TO_HIF8(q) to_hif8(table, q)
#define BF16(i) float_of((uint32_t)in16[i] << 16)

#if defined(__x86_64__)
#include <immintrin.h>
/* to_fp8 on 8 lanes, returning the codes in int32 lanes. Written with one shift (Zen 2 has a single vector
 * shift pipe): the binade stays in place as exponent bits, and the sign comes from a compare. */
__attribute__((target("avx2"))) static inline __m256i fp8_codes_avx2(__m256 q, int mbits, int32_t min_normal,
                                                                      int32_t max_bits, int32_t nan_bit) {
    const __m256i u = _mm256_castps_si256(q);
    __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i nan = _mm256_and_si256(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)), _mm256_set1_epi32(nan_bit));
    a = _mm256_or_si256(_mm256_min_epi32(a, _mm256_set1_epi32(max_bits)), nan);
    __m256i e = _mm256_max_epi32(_mm256_and_si256(a, _mm256_set1_epi32(0x7F800000)), _mm256_set1_epi32(min_normal << 23));
    __m256i magic = _mm256_add_epi32(e, _mm256_set1_epi32((23 - mbits) << 23));
    __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic));
    __m256i count = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
    __m256i binade = _mm256_srli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(min_normal << 23)), 23 - mbits);
    __m256i sign = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), u), _mm256_set1_epi32(0x80));
    return _mm256_or_si256(_mm256_add_epi32(binade, count), sign);
}

/* 8 floats of the input from element i: float32, or bfloat16 widened. */
__attribute__((target("avx2"))) static inline __m256 load8_avx2(const void *in, int in_dtype, int64_t i) {
    if (in_dtype == IN_F32) return _mm256_loadu_ps((const float *)in + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)in + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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

#endif

/* The vector code a CPU runs: the widest it has, at most simd_limit (set_simd lowers the limit so that the
 * tests also run the narrower paths, which machines without AVX-512 or AVX2 take). */
enum { SIMD_NONE = 0, SIMD_AVX2 = 1, SIMD_AVX512 = 2 };
static int simd_limit = SIMD_AVX512;

static int simd_level(void) {
    static int cpu = -1;
    if (cpu < 0) {
        cpu = SIMD_NONE;
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx2")) cpu = SIMD_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vbmi"))
            cpu = SIMD_AVX512;
#endif
    }
    return cpu < simd_limit ? cpu : simd_limit;
}

#if defined(__x86_64__)
static int has_avx2(void) { return simd_level() >= SIMD_AVX2; }
/* The AVX-512 subsets simd_level asks for before it answers SIMD_AVX512. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vbmi")))
#endif

#if defined(__x86_64__)
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
#endif

#if defined(__x86_64__)
static int64_t cast_fp8_avx512(const Job *j, int64_t begin, int64_t end);
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

#if defined(__x86_64__)
/* values[in[i]] * s over [begin, end), 8 codes at a time: one gather from the 256 values (1 KiB, in L1) per 8
 * codes, where the scalar loop pays a load and a store per code. Returns where the scalar loop takes over.
 * (x * 1 is x, NaN stays NaN: the plain decode passes s = 1.) The AVX-512 gather of 16 was measured no
 * faster (the loop is bound by the float32 stores), so AVX-512 CPUs run this one too. */
__attribute__((target("avx2"))) static inline int64_t decode_avx2(const uint8_t *in, const float *values, float *out,
                                                           int64_t begin, int64_t end, float s) {
    const __m256 scale = _mm256_set1_ps(s);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(values, idx, 4), scale));
    }
    return i;
}
#endif

/* A 256-entry table of bfloat16 values (float32 values whose low 16 bits are 0, as every FP8 and HiF8 value
 * is) split into the low and high bytes of each value's top half, for decode_vbmi. */
typedef struct Bf16Planes { uint8_t lo[256], hi[256]; } Bf16Planes;

/* bfloat16 bits of x, rounded to nearest even; NaN as 0x7FC0 (torch's float32 -> bfloat16 cast). */
static inline uint16_t bf16_bits(float x) {
    const uint32_t u = bits_of(x);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

#if defined(__x86_64__)
/* bf16_bits of 16 lanes. */
AVX512 static inline __m256i bf16_bits16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* The powers of two 2^d, d in [lo, hi], that take every nonzero finite value of a table to a normal number:
 * multiplying by one is then exact (decode64_bf16_pow2 adds d to the exponent field). lo > hi when a value is
 * subnormal (no exponent field to add to). */
typedef struct { int lo, hi; } Pow2Range;

/* d when s = 2^d with d in r (a positive normal power of two), else 0 through *ok. */
static inline int pow2_shift(float s, Pow2Range r, int *ok) {
    const uint32_t u = bits_of(s);
    const int e = (int)(u >> 23), d = e - 127;
    *ok = (u & 0x807FFFFFu) == 0 && e != 0 && e != 0xFF && d >= r.lo && d <= r.hi;
    return *ok ? d : 0;
}

/* Fills p from values; 0 when some value is not a bfloat16 value (then the gather decodes). */
static int bf16_planes(const float *values, Bf16Planes *p) {
    for (int i = 0; i < 256; ++i) {
        const uint32_t u = bits_of(values[i]);
        if (u & 0xFFFFu) return 0;
        p->lo[i] = (uint8_t)(u >> 16);
        p->hi[i] = (uint8_t)(u >> 24);
    }
    return 1;
}

static Pow2Range pow2_range(const Bf16Planes *p) {
    int emin = 0xFE, emax = 1;
    for (int i = 0; i < 256; ++i) {
        const int word = p->lo[i] | (p->hi[i] << 8), e = (word >> 7) & 0xFF;
        if ((word & 0x7FFF) == 0 || e == 0xFF) continue; /* zeros, Infs and NaNs keep their words */
        if (e == 0) return (Pow2Range){1, 0};
        emin = e < emin ? e : emin;
        emax = e > emax ? e : emax;
    }
    return (Pow2Range){1 - emin, 0xFE - emax};
}

#if defined(__x86_64__)
/* Decoding 64 codes at a time with byte permutes instead of gathers: each of the two byte planes is looked up
 * with two 128-entry VPERMI2B (the code's top bit picks the half), the planes are interleaved into bfloat16
 * words and the words widened to float32 by placing them in the top half of each lane. The unpacks
 * interleave within 128-bit lanes, so the codes are first permuted into the order that makes the 4 float32
 * vectors come out consecutive. VbmiTable holds the registers: that permutation and the planes' quarters. */
typedef struct { __m512i order, word_order, lo[4], hi[4]; } VbmiTable;

AVX512 static inline VbmiTable vbmi_table(const Bf16Planes *p) {
    uint8_t order[64], word_order[64];
    for (int lane = 0; lane < 4; ++lane)
        for (int g = 0; g < 4; ++g)
            for (int b = 0; b < 4; ++b) order[lane * 16 + g * 4 + b] = (uint8_t)(g * 16 + lane * 4 + b);
    /* For decode64_bf16_pow2: the byte unpacks of lane L then give the words of codes 8L.. and 32 + 8L.. */
    for (int lane = 0; lane < 4; ++lane)
        for (int b = 0; b < 8; ++b) {
            word_order[lane * 16 + b] = (uint8_t)(8 * lane + b);
            word_order[lane * 16 + 8 + b] = (uint8_t)(32 + 8 * lane + b);
        }
    VbmiTable t;
    t.order = _mm512_loadu_si512(order);
    t.word_order = _mm512_loadu_si512(word_order);
    for (int q = 0; q < 4; ++q) {
        t.lo[q] = _mm512_loadu_si512(p->lo + 64 * q);
        t.hi[q] = _mm512_loadu_si512(p->hi + 64 * q);
    }
    return t;
}

/* The bfloat16 words of the 64 codes at `in`, permuted by `order` first, as two vectors of 32: the planes'
 * bytes looked up and interleaved within 128-bit lanes. */
AVX512 static inline __attribute__((always_inline)) void plane_words(const VbmiTable *t, __m512i order,
                                                                      const uint8_t *in, __m512i words[2]) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(in));
    const __mmask64 top = _mm512_movepi8_mask(c);
    const __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t->lo[0], c, t->lo[1]),
                                              _mm512_permutex2var_epi8(t->lo[2], c, t->lo[3]));
    const __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t->hi[0], c, t->hi[1]),
                                              _mm512_permutex2var_epi8(t->hi[2], c, t->hi[3]));
    words[0] = _mm512_unpacklo_epi8(lo, hi);
    words[1] = _mm512_unpackhi_epi8(lo, hi);
}

/* out[0..64) = values[in[0..64)], the 16 values from out + 16 g on multiplied by s[g]; as float32, or as
 * bfloat16 (bf16_bits of the float32 product) when bf16. */
AVX512 static inline __attribute__((always_inline)) void decode64_vbmi(const VbmiTable *t, const uint8_t *in,
                                                                        void *out, const __m512 s[4], const int bf16) {
    __m512i w[2];
    plane_words(t, t->order, in, w);
    const __m512i w0 = w[0], w1 = w[1], zero = _mm512_setzero_si512();
    const __m512 v[4] = {_mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w0)), s[0]),
                         _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w0)), s[1]),
                         _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w1)), s[2]),
                         _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w1)), s[3])};
    for (int g = 0; g < 4; ++g) {
        if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + 16 * g), bf16_bits16(v[g]));
        else _mm512_storeu_ps((float *)out + 16 * g, v[g]);
    }
}

/* The bfloat16 words of out[0..64) = values[in[0..64)] * 2^d[g] for the 16 codes from 16 g on, where every
 * product is a normal bfloat16 number or a zero, Inf or NaN of the table (the caller's check, `Pow2Range`):
 * the product is then exact, so adding d to the exponent field gives the bits bf16_bits gives the float32
 * product, without the float32 detour. `inc[0]` holds d[0] << 7 in words 0-15 and d[1] << 7 in words 16-31,
 * `inc[1]` d[2] and d[3] likewise. Zeros and Infs keep their words, NaNs become 0x7FC0 (as bf16_bits). */
AVX512 static inline __attribute__((always_inline)) void decode64_bf16_pow2(const VbmiTable *t, const uint8_t *in,
                                                                            uint16_t *out, const __m512i inc[2]) {
    __m512i words[2];
    plane_words(t, t->word_order, in, words);
    const __m512i magnitude_mask = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
    for (int h = 0; h < 2; ++h) {
        const __m512i mag = _mm512_and_si512(words[h], magnitude_mask);
        const __mmask32 keep = _mm512_cmpeq_epi16_mask(mag, _mm512_setzero_si512()) | _mm512_cmpeq_epi16_mask(mag, inf);
        __m512i r = _mm512_mask_mov_epi16(_mm512_add_epi16(words[h], inc[h]), keep, words[h]);
        r = _mm512_mask_mov_epi16(r, _mm512_cmpgt_epu16_mask(mag, inf), _mm512_set1_epi16(0x7FC0));
        _mm512_storeu_si512(out + 32 * h, r);
    }
}

/* values[in[i]] over [begin, end), 64 codes at a time; returns where the next loop takes over. */
AVX512 static int64_t decode_vbmi(const uint8_t *in, const Bf16Planes *p, float *out, int64_t begin, int64_t end) {
    const VbmiTable t = vbmi_table(p);
    const __m512 one[4] = {_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f)};
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) decode64_vbmi(&t, in + i, out + i, one, 0);
    return i;
}
#endif

/* Codes to values through a 256-entry table: the exact decode of any 8-bit format. */
static void decode_range(Job *j) {
    int64_t begin = j->begin;
    const int64_t end = j->end;
    const uint8_t *restrict in = (const uint8_t *)j->in;
    const float *restrict values = j->values;
    float *restrict out = j->decoded;
#if defined(__x86_64__)
    if (j->planes && simd_level() >= SIMD_AVX512) begin = decode_vbmi(in, j->planes, out, begin, end);
    if (has_avx2()) begin = decode_avx2(in, values, out, begin, end, 1.0f);
#endif
    for (int64_t i = begin; i < end; ++i) out[i] = values[in[i]];
}

typedef void (*RangeFn)(Job *);
typedef struct { RangeFn fn; Job *job; } Task;

static void *run_task(void *arg) { Task *t = (Task *)arg; t->fn(t->job); return NULL; }

/* Runs worker on each of the t jobs (job_size bytes apart) and returns when all are done. Built with OpenMP,
 * the jobs run on the team of the OpenMP runtime torch has loaded (the same libgomp.so.1): its workers are
 * still spinning after the last torch op, so they start at once instead of a new thread competing with them
 * for a core. Without OpenMP: jobs 1.. on new threads (here when no thread can be started), job 0 on the
 * caller's thread. */
void run_jobs(void *(*worker)(void *), void *jobs, size_t job_size, int64_t t) {
    char *job = (char *)jobs;
#if defined(_OPENMP)
    if (t < 2) { /* no region at all: the caller's thread alone (as in a forked child, where torch uses one) */
        worker(job);
        return;
    }
#pragma omp parallel for num_threads((int)t) schedule(static, 1)
    for (int64_t i = 0; i < t; ++i) worker(job + i * job_size);
#else
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t i = 1; i < t; ++i) {
        started[i] = pthread_create(&ids[i], NULL, worker, job + i * job_size) == 0;
        if (!started[i]) worker(job + i * job_size);
    }
    worker(job);
    for (int64_t i = 1; i < t; ++i) if (started[i]) pthread_join(ids[i], NULL);
#endif
}

/* Splits [0, n) over up to `threads` threads (the caller's thread takes the first range). */
static void parallel(RangeFn fn, const Job *proto, int64_t n, int threads, Job *jobs, int *used) {
    int64_t by_size = n / MIN_PER_THREAD;
    int t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (by_size < t) t = by_size < 1 ? 1 : (int)by_size;
    int64_t step = ((n + t - 1) / t + 63) & ~(int64_t)63;
    Task tasks[MAX_THREADS];
    for (int k = 0; k < t; ++k) {
        jobs[k] = *proto;
        jobs[k].begin = k * step < n ? k * step : n;
        jobs[k].end = (k + 1) * step < n ? (k + 1) * step : n;
        tasks[k] = (Task){fn, &jobs[k]};
    }
    run_jobs(run_task, tasks, sizeof(Task), t);
    *used = t;
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

static int check_formats(int in_dtype, int out_format, unsigned long long table, long long n) {
    if ((in_dtype != IN_F32 && in_dtype != IN_BF16) || out_format < OUT_E4M3 || out_format > OUT_HIF8 ||
        (out_format == OUT_HIF8 && !table) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "bad input dtype, output format, size or missing HiF8 table");
        return 0;
    }
    return 1;
}

static PyObject *py_scaled_cast(PyObject *self, PyObject *args) {
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

static PyObject *py_amax(PyObject *self, PyObject *args) {
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

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long in, values, out;
    long long n;
    int threads;
    if (!PyArg_ParseTuple(args, "KLKKi", &in, &n, &values, &out, &threads)) return NULL;
    if (n < 0 || !values) {
        PyErr_SetString(PyExc_ValueError, "decode: bad size or missing table");
        return NULL;
    }
    Bf16Planes planes;
    Job proto = {(const void *)in, 0, 0, 0, 1.0f, NULL, 0, NULL, 0, (const float *)values, (float *)out,
                 bf16_planes((const float *)values, &planes) ? &planes : NULL};
    Job jobs[MAX_THREADS];
    int used;
    Py_BEGIN_ALLOW_THREADS
    parallel(decode_range, &proto, n, threads, jobs, &used);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Current scaling's decode scale from an amax, as mindspeed_te.scaling.current_scale_inv computes it with
 * tensor ops (float32 throughout): max(amax, eps) / fp8_max, at least 1/FLT_MAX, and 1 for an amax that is
 * 0, Inf or NaN; with pow2, the reciprocal of the scale fp8_max / max(amax, eps) (FLT_MAX at most) rounded
 * down to a power of two. One call instead of half a dozen tensor ops on one element. */
static float current_scale_inv(float amax, float fp8_max, float eps, int pow2) {
    if (eps > 0 && amax < eps) amax = eps;
    if (!(amax > 0) || amax == INFINITY) return 1.0f;
    if (pow2) {
        float scale = fp8_max / amax;
        if (scale > FLT_MAX) scale = FLT_MAX;
        return 1.0f / float_of(bits_of(scale) & 0x7F800000u);
    }
    float scale_inv = amax / fp8_max;
    const float min_scale_inv = (float)(1.0 / FLT_MAX);
    return scale_inv < min_scale_inv ? min_scale_inv : scale_inv;
}

static PyObject *py_current_scale_inv(PyObject *self, PyObject *args) {
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
static PyObject *py_quantize(PyObject *self, PyObject *args) {
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

/* ---- Block scaling (1xB / 128x128 tiles) and MX (1x32 blocks, E8M0 scales) ---------------------------
 * One call quantizes the rowwise layout (blocks along the last dim) and, when asked, the columnwise one
 * (blocks of the 2-D transpose, i.e. along the first dim). The input is walked in strips of rows, each strip
 * in chunks of columns that fit in L2 (tile_range): both layouts are made from a chunk while it is in cache,
 * so main memory is read once. Amax and E4M3/E5M2 casts run 8 lanes wide
 * with AVX2 when the CPU has it (scalar loops otherwise, and for HiF8's table encode); with AVX-512 the
 * E4M3/E5M2 quantizes take the tiles further below instead (the code chosen at run time: simd_level). The block scale rules
 * are those of mindspeed_te.scaling (current_scale_inv for blockwise, mx_scale_exponent for MX);
 * power-of-two scales are applied as a multiplication by 2^-e, which rounds exactly as the division by 2^e
 * does. */
enum { MODE_BLOCK = 0, MODE_MX_CEIL = 1, MODE_MX_FLOOR = 2 };
#define CHUNK 128 /* columns per pass of the columnwise loops (their code tile: STRIP_ROWS x CHUNK bytes) */
#define MAX_BLOCK 128
#define MAX_CHUNK 4096 /* columns per chunk at most */
#define STRIP_BLOCKS 16 /* blocks of rows per strip at most */
#define STRIP_ROWS 256
#define TILE_BYTES (1 << 20) /* input bytes per chunk: half of a core's L2 on current x86 */

typedef struct {
    const void *in;
    int in_dtype, out_format, mode, pow2, emax;
    int64_t m, k;
    int tile_rows, block;
    int use_mul;   /* power-of-two scales: multiply by 2^-e (else divide by scale_inv) */
    int avx2;      /* the CPU has AVX2 (amax) */
    int avx2_cast; /* ... and the output is E4M3/E5M2 (the cast; HiF8 goes through its table) */
    float fp8_max, eps;
    const uint8_t *table;
    uint8_t *row_data, *col_data;
    void *row_scale, *col_scale; /* float32 (blockwise) or uint8 E8M0 codes (MX) */
    int64_t strip_begin, strip_end;
    int64_t ld, r_org, c_org; /* input (r, c) is in[(r - r_org) * ld + c - c_org]: the tensor or a tile's copy */
    int avx512;    /* the AVX-512 tiles take the job, with `work` (a Tile512) as their work space */
    int64_t *next_strip; /* ... taking strips from this counter (shared by the threads of a call) */
    int stream;    /* ... and write whole cache lines of codes past the caches (outputs too large to stay) */
    void *work;
} TileJob;

static inline int64_t at(const TileJob *j, int64_t r, int64_t c) { return (r - j->r_org) * j->ld + c - j->c_org; }

static inline float load_elem(const TileJob *j, int64_t i) {
    return j->in_dtype == IN_F32 ? ((const float *)j->in)[i] : float_of((uint32_t)((const uint16_t *)j->in)[i] << 16);
}

static inline uint8_t encode(const TileJob *j, float q) {
    return j->out_format == OUT_E4M3 ? to_e4m3(q) : j->out_format == OUT_E5M2 ? to_e5m2(q) : to_hif8(j->table, q);
}

static inline uint32_t abs_bits(const TileJob *j, int64_t i) {
    if (j->in_dtype == IN_F32) return ((const uint32_t *)j->in)[i] & 0x7FFFFFFFu;
    return ((uint32_t)(((const uint16_t *)j->in)[i] & 0x7FFFu)) << 16;
}

/* 2^e for -127 <= e <= 127 (2^-127 is a float32 subnormal). */
static inline float exp2_int(int e) { return e > -127 ? float_of((uint32_t)(e + 127) << 23) : float_of(0x00400000u); }

/* floor(log2(x)) of a float32 x > 0 given by its bits, and in *fraction the 23 fraction bits of x / 2^that. */
static inline int log2_floor_bits(uint32_t bits, uint32_t *fraction) {
    if (bits >= 0x00800000u) {
        *fraction = bits & 0x7FFFFFu;
        return (int)(bits >> 23) - 127;
    }
    const int top = 31 - __builtin_clz(bits); /* a subnormal: its leading one becomes the implicit bit */
    *fraction = (bits << (23 - top)) & 0x7FFFFFu;
    return top - 149;
}

/* The MX scale exponent of a finite amax > 0 (mindspeed_te.scaling.mx_scale_exponent), from bits instead
 * of frexp. floor: floor(log2(amax)) - emax. ceil: ceil(log2(amax / fp8_max)); with amax = a 2^ea and
 * fp8_max = f 2^ef (a, f in [1, 2)), a / f lies in (1/2, 2), so that is ea - ef, one more when a > f. The
 * reference's float64 quotient gives the same: a / f of two 24-bit significands is 1 or at least 2^-25
 * away from 1, 1/2 and 2, far beyond a float64 rounding. */
static inline int mx_exponent(const TileJob *j, uint32_t amax_bits) {
    uint32_t fa, ff;
    const int ea = log2_floor_bits(amax_bits, &fa);
    if (j->mode == MODE_MX_CEIL) return ea - log2_floor_bits(bits_of(j->fp8_max), &ff) + (fa > ff);
    return ea - j->emax;
}

/* The block's cast factor from its amax bits (|x| as float32 bits, above 0x7F800000 for NaN): 2^-e to
 * multiply by (use_mul) or the scale_inv to divide by. Stores the block's scale at `slot`. */
static inline float block_scale(const TileJob *j, uint32_t amax_bits, void *scale, int64_t slot) {
    const int finite = amax_bits < 0x7F800000u;
    if (j->mode == MODE_BLOCK) {
        const float amax = float_of(amax_bits > 0x7F800000u ? 0x7FC00000u : amax_bits);
        const float sinv = current_scale_inv(amax, j->fp8_max, j->eps, j->pow2);
        ((float *)scale)[slot] = finite ? sinv : NAN; /* a tile holding NaN/Inf dequantizes to NaN */
        return j->use_mul ? 1.0f / sinv : sinv;
    }
    int e = !finite ? 0 : amax_bits == 0 ? -127 : mx_exponent(j, amax_bits);
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    ((uint8_t *)scale)[slot] = finite ? (uint8_t)(e + 127) : 0xFF;
    return exp2_int(-e);
}

/* Scalar forms of the loops (and the tails of the AVX2 ones). */
static uint32_t span_amax_scalar(const TileJob *j, int64_t i, int64_t n) {
    uint32_t m = 0;
    for (int64_t t = i; t < i + n; ++t) { const uint32_t a = abs_bits(j, t); m = a > m ? a : m; }
    return m;
}

/* Codes of elements [i, i + n) into out, element t scaled by f[t * fstep]: fstep 0 for one factor (a rowwise
 * block), 1 for a factor per column (the columnwise blocks crossing a row). */
static void span_cast_scalar(const TileJob *j, int64_t i, int64_t n, const float *f, int fstep,
                             uint8_t *restrict out) {
    for (int64_t t = 0; t < n; ++t) {
        const float x = load_elem(j, i + t), ft = f[t * fstep];
        out[t] = encode(j, j->use_mul ? x * ft : x / ft);
    }
}

/* max |x| down columns [c0, c0 + w) of rows [r0, r1) into m[0, w), row by row so that reads are contiguous. */
static void col_amax_scalar(const TileJob *j, int64_t r0, int64_t r1, int64_t c0, int64_t w, uint32_t *m) {
    for (int64_t c = 0; c < w; ++c) m[c] = 0;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < w; ++c) { const uint32_t a = abs_bits(j, at(j, r, c0 + c)); m[c] = a > m[c] ? a : m[c]; }
}

/* Rows [r0, r1) x columns [c0, c1) of a tile of codes (buf, w bytes a row) into the columnwise output, where
 * the tile's row r and column c (input row t0 + r, column s0 + c) land at output row s0 + c, column t0 + r. */
static void transpose_scalar(const TileJob *j, const uint8_t *buf, int64_t w, int64_t r0, int64_t r1, int64_t c0,
                             int64_t c1, int64_t t0, int64_t s0) {
    for (int64_t c = c0; c < c1; ++c) {
        uint8_t *restrict out = j->col_data + (s0 + c) * j->m + t0;
        for (int64_t r = r0; r < r1; ++r) out[r] = buf[r * w + c];
    }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static inline __m256i abs8_avx2(const TileJob *j, int64_t i) {
    return _mm256_and_si256(_mm256_castps_si256(load8_avx2(j->in, j->in_dtype, i)), _mm256_set1_epi32(0x7FFFFFFF));
}

/* 8 codes of x scaled by f, in int32 lanes. */
__attribute__((target("avx2"))) static inline __m256i codes8_avx2(const TileJob *j, __m256 x, __m256 f) {
    const __m256 q = j->use_mul ? _mm256_mul_ps(x, f) : _mm256_div_ps(x, f);
    return j->out_format == OUT_E4M3 ? fp8_codes_avx2(q, 3, 121, 0x43E00000, 0x00100000)
                                     : fp8_codes_avx2(q, 2, 113, 0x47600000, 0x00800000);
}

/* Four vectors of codes as 32 bytes in element order. */
__attribute__((target("avx2"))) static inline void store32_avx2(uint8_t *out, __m256i c0, __m256i c1, __m256i c2,
                                                                __m256i c3) {
    const __m256i words = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

__attribute__((target("avx2"))) static inline void store8_avx2(uint8_t *out, __m256i c) {
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(w, w));
}

/* The largest of 8 non-negative int32 lanes (|x| bits: the signed max orders them). */
__attribute__((target("avx2"))) static inline uint32_t hmax_avx2(__m256i m) {
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(h);
}

__attribute__((target("avx2"))) static uint32_t span_amax_avx2(const TileJob *j, int64_t i, int64_t n) {
    __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        m0 = _mm256_max_epi32(m0, abs8_avx2(j, i + t));
        m1 = _mm256_max_epi32(m1, abs8_avx2(j, i + t + 8));
    }
    for (; t + 8 <= n; t += 8) m0 = _mm256_max_epi32(m0, abs8_avx2(j, i + t));
    const uint32_t m = hmax_avx2(_mm256_max_epi32(m0, m1)), rest = t < n ? span_amax_scalar(j, i + t, n - t) : 0;
    return m > rest ? m : rest;
}

__attribute__((target("avx2"))) static inline __m256 factors8_avx2(const float *f, int fstep, int64_t t) {
    return fstep ? _mm256_loadu_ps(f + t) : _mm256_set1_ps(f[0]);
}

__attribute__((target("avx2"))) static void span_cast_avx2(const TileJob *j, int64_t i, int64_t n, const float *f,
                                                           int fstep, uint8_t *out) {
    int64_t t = 0;
    for (; t + 32 <= n; t += 32)
        store32_avx2(out + t, codes8_avx2(j, load8_avx2(j->in, j->in_dtype, i + t), factors8_avx2(f, fstep, t)),
                     codes8_avx2(j, load8_avx2(j->in, j->in_dtype, i + t + 8), factors8_avx2(f, fstep, t + 8)),
                     codes8_avx2(j, load8_avx2(j->in, j->in_dtype, i + t + 16), factors8_avx2(f, fstep, t + 16)),
                     codes8_avx2(j, load8_avx2(j->in, j->in_dtype, i + t + 24), factors8_avx2(f, fstep, t + 24)));
    for (; t + 8 <= n; t += 8)
        store8_avx2(out + t, codes8_avx2(j, load8_avx2(j->in, j->in_dtype, i + t), factors8_avx2(f, fstep, t)));
    if (t < n) span_cast_scalar(j, i + t, n - t, f + t * fstep, fstep, out + t);
}

/* A rowwise block of n <= MAX_BLOCK elements read once: its vectors stay in registers from the amax to the
 * cast. The scale goes to scale[slot]. */
__attribute__((target("avx2"))) static void span_quantize_avx2(const TileJob *j, int64_t i, int64_t n, void *scale,
                                                               int64_t slot, uint8_t *out) {
    __m256 v[MAX_BLOCK / 8];
    const int64_t n8 = n / 8, rest = n - 8 * n8;
    __m256i m = _mm256_setzero_si256();
    for (int64_t t = 0; t < n8; ++t) {
        v[t] = load8_avx2(j->in, j->in_dtype, i + 8 * t);
        m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(v[t]), _mm256_set1_epi32(0x7FFFFFFF)));
    }
    const uint32_t head = hmax_avx2(m), tail = rest ? span_amax_scalar(j, i + 8 * n8, rest) : 0;
    const float f = block_scale(j, head > tail ? head : tail, scale, slot);
    const __m256 fv = _mm256_set1_ps(f);
    int64_t t = 0;
    for (; t + 4 <= n8; t += 4)
        store32_avx2(out + 8 * t, codes8_avx2(j, v[t], fv), codes8_avx2(j, v[t + 1], fv), codes8_avx2(j, v[t + 2], fv),
                     codes8_avx2(j, v[t + 3], fv));
    for (; t < n8; ++t) store8_avx2(out + 8 * t, codes8_avx2(j, v[t], fv));
    if (rest) span_cast_scalar(j, i + 8 * n8, rest, &f, 0, out + 8 * n8);
}

/* col_amax 8 columns a vector, the running maxima in m (L1) while the rows stream by. */
__attribute__((target("avx2"))) static void col_amax_avx2(const TileJob *j, int64_t r0, int64_t r1, int64_t c0,
                                                          int64_t w, uint32_t *m) {
    const int64_t w8 = w & ~(int64_t)7;
    for (int64_t c = 0; c < w8; c += 8) _mm256_storeu_si256((__m256i *)(m + c), _mm256_setzero_si256());
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < w8; c += 8) {
            __m256i *acc = (__m256i *)(m + c);
            _mm256_storeu_si256(acc, _mm256_max_epi32(_mm256_loadu_si256(acc), abs8_avx2(j, at(j, r, c0 + c))));
        }
    if (w8 < w) col_amax_scalar(j, r0, r1, c0 + w8, w - w8, m + w8);
}

/* transpose_tile 16 x 16 bytes at a time (SSE2, in every x86-64). Interleaving the bytes of registers q and
 * q + 8 into registers 2q, 2q + 1 rotates the 8-bit (register, byte) index of each byte left by one; after
 * four rounds register c holds column c, so a square's rows become its columns. */
static void transpose_sse2(const TileJob *j, const uint8_t *buf, int64_t h, int64_t w, int64_t t0, int64_t s0) {
    const int64_t h16 = h & ~(int64_t)15, w16 = w & ~(int64_t)15;
    for (int64_t c = 0; c < w16; c += 16)
        for (int64_t r = 0; r < h16; r += 16) {
            __m128i a[16], b[16];
            for (int q = 0; q < 16; ++q) a[q] = _mm_loadu_si128((const __m128i *)(buf + (r + q) * w + c));
            for (int round = 0; round < 4; ++round) {
                for (int q = 0; q < 8; ++q) {
                    b[2 * q] = _mm_unpacklo_epi8(a[q], a[q + 8]);
                    b[2 * q + 1] = _mm_unpackhi_epi8(a[q], a[q + 8]);
                }
                memcpy(a, b, sizeof a);
            }
            for (int q = 0; q < 16; ++q) _mm_storeu_si128((__m128i *)(j->col_data + (s0 + c + q) * j->m + t0 + r), a[q]);
        }
    transpose_scalar(j, buf, w, h16, h, 0, w16, t0, s0);
    transpose_scalar(j, buf, w, 0, h, w16, w, t0, s0);
}
#endif

static inline uint32_t span_amax(const TileJob *j, int64_t i, int64_t n) {
#if defined(__x86_64__)
    if (j->avx2) return span_amax_avx2(j, i, n);
#endif
    return span_amax_scalar(j, i, n);
}

static inline void span_cast(const TileJob *j, int64_t i, int64_t n, const float *f, int fstep, uint8_t *out) {
#if defined(__x86_64__)
    if (j->avx2_cast) { span_cast_avx2(j, i, n, f, fstep, out); return; }
#endif
    span_cast_scalar(j, i, n, f, fstep, out);
}

/* One rowwise 1xB block: amax, scale (stored at scale[slot]), codes. */
static inline void span_quantize(const TileJob *j, int64_t i, int64_t n, void *scale, int64_t slot, uint8_t *out) {
#if defined(__x86_64__)
    if (j->avx2_cast) { span_quantize_avx2(j, i, n, scale, slot, out); return; }
#endif
    const float f = block_scale(j, span_amax(j, i, n), scale, slot);
    span_cast(j, i, n, &f, 0, out);
}

static inline void col_amax(const TileJob *j, int64_t r0, int64_t r1, int64_t c0, int64_t w, uint32_t *m) {
#if defined(__x86_64__)
    if (j->avx2) { col_amax_avx2(j, r0, r1, c0, w, m); return; }
#endif
    col_amax_scalar(j, r0, r1, c0, w, m);
}

/* A tile of h x w codes (buf, row-major; input rows t0.., columns s0..) into the columnwise output. */
static inline void transpose_tile(const TileJob *j, const uint8_t *buf, int64_t h, int64_t w, int64_t t0, int64_t s0) {
#if defined(__x86_64__)
    transpose_sse2(j, buf, h, w, t0, s0);
#else
    transpose_scalar(j, buf, w, 0, h, 0, w, t0, s0);
#endif
}

/* Asks for elements [i, i + n) in cache ahead of use: the strips are read in row segments too short for the
 * hardware prefetcher to ramp up. */
static inline void prefetch_span(const TileJob *j, int64_t i, int64_t n) {
    const int64_t elem = j->in_dtype == IN_F32 ? 4 : 2;
    const char *p = (const char *)j->in + i * elem;
    for (int64_t b = 0; b < n * elem; b += 64) __builtin_prefetch(p + b);
}

/* Copies rows [r0, r1) x columns [c0, c1) of the input to `tile` (row-major, c1 - c0 elements a row), with
 * the rowwise 1xB blocks quantized on the way when asked (quantize): the input is then read once. */
static void copy_chunk(const TileJob *j, int64_t r0, int64_t r1, int64_t c0, int64_t c1, char *tile, int quantize) {
    const int64_t k = j->k, bl = j->block, nb = (k + bl - 1) / bl, elem = j->in_dtype == IN_F32 ? 4 : 2;
    const int64_t step = quantize ? bl : c1 - c0;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b0 = c0; b0 < c1; b0 += step) {
            const int64_t n = b0 + step < c1 ? step : c1 - b0;
            if (r + 1 < r1) prefetch_span(j, at(j, r + 1, b0), n);
            if (quantize) span_quantize(j, at(j, r, b0), n, j->row_scale, r * nb + b0 / bl, j->row_data + r * k + b0);
            if (tile)
                memcpy(tile + ((r - r0) * (c1 - c0) + b0 - c0) * elem, (const char *)j->in + at(j, r, b0) * elem,
                       (size_t)(n * elem));
        }
}

/* Rowwise tiles of tile_rows > 1 rows: rows [r0, r1) (one tile) x columns [c0, c1) (whole blocks). */
static void chunk_tiles(const TileJob *j, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    const int64_t k = j->k, bl = j->block, nb = (k + bl - 1) / bl;
    uint32_t amax[MAX_CHUNK]; /* one tile of all the rows per block of columns */
    for (int64_t b = 0; b < (c1 - c0 + bl - 1) / bl; ++b) amax[b] = 0;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b0 = c0; b0 < c1; b0 += bl) {
            const uint32_t a = span_amax(j, at(j, r, b0), b0 + bl < c1 ? bl : c1 - b0);
            uint32_t *m = &amax[(b0 - c0) / bl];
            *m = a > *m ? a : *m;
        }
    float f[MAX_CHUNK];
    for (int64_t b0 = c0; b0 < c1; b0 += bl)
        f[(b0 - c0) / bl] = block_scale(j, amax[(b0 - c0) / bl], j->row_scale, (r0 / j->tile_rows) * nb + b0 / bl);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b0 = c0; b0 < c1; b0 += bl)
            span_cast(j, at(j, r, b0), b0 + bl < c1 ? bl : c1 - b0, &f[(b0 - c0) / bl], 0, j->row_data + r * k + b0);
}

/* Columnwise: each block of rows in [r0, r1) is one block of every column in [c0, c1); output (K, M) rows.
 * CHUNK columns at a time, everything along the input's rows (contiguous reads): the column maxima, then the
 * codes, gathered row-major in buf and transposed into the output, so that each output row (an input
 * column) is written as one run of the strip's length. */
static void chunk_columnwise(const TileJob *j, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    const int64_t m_all = j->m, bl = j->block, nb = (m_all + bl - 1) / bl;
    uint32_t amax[CHUNK];
    float f[CHUNK];
    uint8_t buf[STRIP_ROWS * CHUNK];
    for (int64_t s0 = c0; s0 < c1; s0 += CHUNK) {
        const int64_t w = s0 + CHUNK < c1 ? CHUNK : c1 - s0;
        for (int64_t b0 = r0; b0 < r1; b0 += bl) {
            const int64_t b1 = b0 + bl < r1 ? b0 + bl : r1;
            col_amax(j, b0, b1, s0, w, amax);
            for (int64_t c = 0; c < w; ++c) f[c] = block_scale(j, amax[c], j->col_scale, (s0 + c) * nb + b0 / bl);
            for (int64_t r = b0; r < b1; ++r) span_cast(j, at(j, r, s0), w, f, 1, buf + (r - r0) * w);
        }
        transpose_tile(j, buf, r1 - r0, w, r0, s0);
    }
}

#if defined(__x86_64__)
/* ---- AVX-512 tiles (E4M3 / E5M2 out, block dividing 128, multiple of 16) -----------------------------
 * A strip of 128 rows is walked in tiles of 128 x 128 elements, each holding whole blocks of both layouts.
 * Pass 1 reads the tile from memory once: a float32 copy into a contiguous buffer (L2; the tensor's rows
 * are often a power of two apart and would evict each other), the rowwise block maxima and the column
 * maxima. The scales of all the tile's blocks are then computed 16 at a time, and pass 2 casts the buffer:
 * rowwise codes straight to the output, columnwise codes into a byte tile that is transposed in registers
 * (16 x 16 bytes in each 128-bit lane) into the (K, M) output. Pass 1 waits on memory and pass 2 on the
 * vector units, so pass 2 prefetches the next tile. Same arithmetic as the scalar code (the tests compare
 * every path with the torch ops), 16 lanes at a time. */
#define T512 128 /* rows and columns of a tile */
/* From this many elements on the codes are written with streaming stores: an output of several MiB leaves
 * the caches anyway, and a normal store first reads the line it writes, a third more memory traffic. */
#define STREAM_MIN_ELEMENTS (1 << 22)
#define PREFETCH_ROWS 8 /* rows ahead: the tile's short row segments do not wake the hardware prefetcher */

/* to_fp8 of 16 lanes without the sign (format E4M3 when e4m3, else E5M2; constants after inlining): byte 0 of
 * each lane is the code of |q|, the other bytes are not cleared. The scalar code's rounding, with two
 * shortcuts: VRANGEPS takes min(|q|, max) in one instruction, and the magic number carries the binade's
 * code in its fraction bits, so that the sum's low bits are the whole code (magic = 2^(e + 23 - mbits) +
 * binade has the same ulp as the power of two and an even fraction, so the addition rounds |q| to the same
 * count of ulps, ties to even included). Lanes holding NaN get 0x7F when `nan` (else garbage: callers pass
 * nan = 0 only for tiles without NaN). */
AVX512 static inline __m512i magnitude16(__m512 q, const int e4m3, const int nan) {
    const int mbits = e4m3 ? 3 : 2, min_normal = e4m3 ? 121 : 113;
    const __m512 m = _mm512_range_ps(q, _mm512_castsi512_ps(_mm512_set1_epi32(e4m3 ? 0x43E00000 : 0x47600000)),
                                     0x0A); /* 0b10: the smaller magnitude; 0b10 << 2: sign cleared */
    const __m512i e = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(0x7F800000)),
                                       _mm512_set1_epi32(min_normal << 23));
    /* e + ((23 - mbits) << 23) + ((e - (min_normal << 23)) >> (23 - mbits)) */
    const __m512i magic = _mm512_add_epi32(_mm512_add_epi32(e, _mm512_srli_epi32(e, 23 - mbits)),
                                           _mm512_set1_epi32(((23 - mbits) << 23) - (min_normal << mbits)));
    const __m512i sum = _mm512_castps_si512(_mm512_add_ps(m, _mm512_castsi512_ps(magic)));
    return nan ? _mm512_mask_mov_epi32(sum, _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F)) : sum;
}

/* Byte `byte` of every lane of four vectors: 64 bytes in element order. */
AVX512 static inline __m512i bytes64(__m512i a, __m512i b, __m512i c, __m512i d, const int byte) {
    const __m512i idx = _mm512_add_epi8(_mm512_setr_epi32(0x0C080400, 0x1C181410, 0x2C282420, 0x3C383430,
                                                          0x4C484440, 0x5C585450, 0x6C686460, 0x7C787470,
                                                          0, 0, 0, 0, 0, 0, 0, 0),
                                        _mm512_set1_epi8((char)byte));
    return _mm512_shuffle_i64x2(_mm512_permutex2var_epi8(a, idx, b), _mm512_permutex2var_epi8(c, idx, d),
                                _MM_SHUFFLE(1, 0, 1, 0));
}

/* 64 codes: magnitudes from byte 0 of `codes`' lanes, signs (bit 7) from `signs` (bytes64 of the input's
 * byte 3: q = x * f with f > 0 has x's sign). Ternary-logic table C ? A : B with C = 0x7F. */
AVX512 static inline __m512i with_signs(__m512i magnitudes, __m512i signs) {
    return _mm512_ternarylogic_epi32(magnitudes, signs, _mm512_set1_epi8(0x7F), 0xE4);
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

/* The scale rules of block_scale on 16 amaxes (|x| bits) at once: the cast factors, and the stored scales
 * (float32 bits for blockwise, E8M0 codes for MX) in int32 lanes. */
AVX512 static inline __m512 scales16(const TileJob *j, __m512i amax_bits, __m512i *stored) {
    const __mmask16 finite = _mm512_cmplt_epu32_mask(amax_bits, _mm512_set1_epi32(0x7F800000));
    if (j->mode == MODE_BLOCK) {
        __m512 amax = _mm512_castsi512_ps(amax_bits);
        const __m512 eps = _mm512_set1_ps(j->eps);
        if (j->eps > 0) amax = _mm512_mask_mov_ps(amax, _mm512_cmp_ps_mask(amax, eps, _CMP_LT_OQ), eps);
        /* current_scale_inv returns 1 unless 0 < amax < Inf (a NaN fails both) */
        const __mmask16 regular = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ) &
                                  _mm512_cmp_ps_mask(amax, _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ);
        const __m512 fp8_max = _mm512_set1_ps(j->fp8_max), one = _mm512_set1_ps(1.0f);
        __m512 sinv;
        if (j->pow2) {
            const __m512 scale = _mm512_min_ps(_mm512_div_ps(fp8_max, amax), _mm512_set1_ps(FLT_MAX));
            const __m512i pow = _mm512_and_si512(_mm512_castps_si512(scale), _mm512_set1_epi32(0x7F800000));
            sinv = _mm512_div_ps(one, _mm512_castsi512_ps(pow));
        } else {
            sinv = _mm512_max_ps(_mm512_div_ps(amax, fp8_max), _mm512_set1_ps((float)(1.0 / FLT_MAX)));
        }
        sinv = _mm512_mask_mov_ps(one, regular, sinv);
        *stored = _mm512_mask_mov_epi32(_mm512_castps_si512(_mm512_set1_ps(NAN)), finite, _mm512_castps_si512(sinv));
        return j->use_mul ? _mm512_div_ps(one, sinv) : sinv;
    }
    /* mx_exponent from bits; a subnormal's leading one found by its leading-zero count */
    const __mmask16 normal = _mm512_cmpge_epu32_mask(amax_bits, _mm512_set1_epi32(0x00800000));
    const __m512i lz = _mm512_lzcnt_epi32(amax_bits); /* top = 31 - lz */
    __m512i ea = _mm512_mask_sub_epi32(_mm512_sub_epi32(_mm512_set1_epi32(31 - 149), lz), normal,
                                       _mm512_srli_epi32(amax_bits, 23), _mm512_set1_epi32(127));
    __m512i e;
    if (j->mode == MODE_MX_CEIL) {
        uint32_t ff;
        const int ef = log2_floor_bits(bits_of(j->fp8_max), &ff);
        /* fraction: normal bits & 0x7FFFFF; subnormal (bits << (23 - top)) & 0x7FFFFF = bits << (lz - 8) */
        const __m512i fa = _mm512_and_si512(
            _mm512_mask_mov_epi32(_mm512_sllv_epi32(amax_bits, _mm512_sub_epi32(lz, _mm512_set1_epi32(8))), normal,
                                  amax_bits),
            _mm512_set1_epi32(0x7FFFFF));
        e = _mm512_sub_epi32(ea, _mm512_set1_epi32(ef));
        e = _mm512_mask_add_epi32(e, _mm512_cmpgt_epu32_mask(fa, _mm512_set1_epi32((int)ff)), e, _mm512_set1_epi32(1));
    } else {
        e = _mm512_sub_epi32(ea, _mm512_set1_epi32(j->emax));
    }
    e = _mm512_mask_mov_epi32(e, _mm512_cmpeq_epi32_mask(amax_bits, _mm512_setzero_si512()), _mm512_set1_epi32(-127));
    e = _mm512_maskz_mov_epi32(finite, e);
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    *stored = _mm512_mask_mov_epi32(_mm512_set1_epi32(0xFF), finite, _mm512_add_epi32(e, _mm512_set1_epi32(127)));
    /* exp2_int(-e): 2^-e as a normal float, or the subnormal 2^-127 when e = 127 */
    const __m512i f = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), e), 23);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(f, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(127)),
                                                     _mm512_set1_epi32(0x00400000)));
}

/* Factors and stored scales of n amaxes (n a multiple of 16). */
AVX512 static void scales_of(const TileJob *j, const uint32_t *amax, int n, float *factor, uint32_t *stored) {
    for (int i = 0; i < n; i += 16) {
        __m512i s;
        _mm512_storeu_ps(factor + i, scales16(j, _mm512_loadu_si512(amax + i), &s));
        _mm512_storeu_si512(stored + i, s);
    }
}

static inline void store_scale(const TileJob *j, void *scale, int64_t slot, uint32_t value) {
    if (j->mode == MODE_BLOCK) ((uint32_t *)scale)[slot] = value;
    else ((uint8_t *)scale)[slot] = (uint8_t)value;
}

/* Whether rows of whole tiles from p on, `stride` bytes apart, start on cache lines (for streaming stores). */
static inline int streamable(const uint8_t *p, int64_t stride) { return ((uintptr_t)p & 63) == 0 && stride % 64 == 0; }

/* Lanes of columns [16 i, 16 i + 16) that lie below w. */
static inline __mmask16 lanes16(int w, int i) {
    const int n = w - 16 * i;
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

static inline __mmask64 lanes64(int w, int i) {
    const int n = w - 64 * i;
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1);
}

AVX512 static inline __m512 load16(const TileJob *j, int64_t i, __mmask16 lanes, const int f32) {
    if (f32) return _mm512_maskz_loadu_ps(lanes, (const float *)j->in + i);
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)j->in + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Per-thread work space of the AVX-512 tiles. */
typedef struct {
    float buf[T512 * T512];          /* the tile, float32, row-major */
    uint8_t codes[T512 * T512];      /* columnwise codes, row-major, before the transpose */
    uint8_t codes_t[T512 * T512];    /* ... and after it: [column][row] */
    uint32_t row_amax[T512 * 8];     /* rowwise 1xB: [row][block]; 128x128: [block of rows][block] */
    uint32_t col_amax[8 * T512];     /* [block of rows][column] */
    float row_f[T512 * 8], col_f[8 * T512];
    uint32_t row_s[T512 * 8], col_s[8 * T512];
    const char *next;                /* the next tile's first row in the input (NULL: none), prefetched by pass 2 */
    int64_t next_stride;             /* its rows' distance in bytes */
    int next_bytes;                  /* and length */
} __attribute__((aligned(64))) Tile512; /* one per thread, side by side: each on a cache line */

/* The maxima of a row's nbr blocks (a: its 8 vectors of |x| bits) into out[0, nbr). Four blocks (MX) are
 * reduced together, halving the lanes of two vectors at a time. */
AVX512 static inline __attribute__((always_inline)) void row_block_max(const __m512i *a, int nbr, uint32_t *out) {
#define MAX(x, y) _mm512_max_epu32(x, y)
    const __m512i p0 = MAX(a[0], a[1]), p1 = MAX(a[2], a[3]), p2 = MAX(a[4], a[5]), p3 = MAX(a[6], a[7]);
    if (nbr == 4) {
        const __m512i t0 = MAX(_mm512_shuffle_i32x4(p0, p1, 0x44), _mm512_shuffle_i32x4(p0, p1, 0xEE));
        const __m512i t1 = MAX(_mm512_shuffle_i32x4(p2, p3, 0x44), _mm512_shuffle_i32x4(p2, p3, 0xEE));
        __m512i u = MAX(_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xDD)); /* lane b: block b */
        u = MAX(u, _mm512_shuffle_epi32(u, (_MM_PERM_ENUM)0x4E));
        u = MAX(u, _mm512_shuffle_epi32(u, (_MM_PERM_ENUM)0xB1));
        const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm_storeu_si128((__m128i *)out, _mm512_castsi512_si128(_mm512_permutexvar_epi32(first, u)));
    } else if (nbr == 1) {
        out[0] = _mm512_reduce_max_epu32(MAX(MAX(p0, p1), MAX(p2, p3)));
    } else if (nbr == 2) {
        out[0] = _mm512_reduce_max_epu32(MAX(p0, p1));
        out[1] = _mm512_reduce_max_epu32(MAX(p2, p3));
    } else {
        for (int i = 0; i < 8; ++i) out[i] = _mm512_reduce_max_epu32(a[i]);
    }
#undef MAX
}

/* Pass 1 over rows [r0, r0 + h) x columns [c0, c0 + w) of the input (float32 when f32, else bfloat16). */
AVX512 static inline __attribute__((always_inline)) void tile_read(const TileJob *j, Tile512 *t, int64_t r0, int h,
                                                                    int64_t c0, int w, const int f32) {
    const int row_blocks = j->row_data && j->tile_rows == 1, col_max = j->col_data || j->tile_rows > 1;
    const int bl = j->block, nbr = T512 / bl, elem = f32 ? 4 : 2;
    __mmask16 lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = lanes16(w, i);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int b0 = 0; b0 < h; b0 += bl) {
        __m512i cm[8];
        for (int i = 0; i < 8; ++i) cm[i] = _mm512_setzero_si512();
        const int b1 = b0 + bl < h ? b0 + bl : h;
        for (int r = b0; r < b1; ++r) {
            const int64_t i0 = (r0 + r) * j->k + c0;
            if (r + PREFETCH_ROWS < h)
                for (int b = 0; b < w * elem; b += 64)
                    _mm_prefetch((const char *)j->in + (i0 + PREFETCH_ROWS * j->k) * elem + b, _MM_HINT_T0);
            __m512i a[8];
            for (int i = 0; i < 8; ++i) {
                const __m512 v = load16(j, i0 + 16 * i, lanes[i], f32);
                _mm512_store_ps(t->buf + r * T512 + 16 * i, v);
                a[i] = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
                if (col_max) cm[i] = _mm512_max_epu32(cm[i], a[i]);
            }
            if (row_blocks) row_block_max(a, nbr, t->row_amax + r * nbr);
        }
        if (col_max)
            for (int i = 0; i < 8; ++i) _mm512_store_si512(t->col_amax + b0 / bl * T512 + 16 * i, cm[i]);
    }
}

/* Pass 2: the codes of the buffered tile (format, mul or divide and NaN handling fixed per instantiation). */
AVX512 static inline __attribute__((always_inline)) void tile_cast(const TileJob *j, Tile512 *t, int64_t r0, int h,
                                                                    int64_t c0, int w, const int e4m3,
                                                                    const int use_mul, const int nan) {
    const int bl = j->block, tiles = j->tile_rows > 1;
    const int lg = __builtin_ctz((unsigned)bl / 16), nbr = 8 >> lg; /* vector i is in block i >> lg of its row */
    const __mmask64 out_lanes0 = lanes64(w, 0), out_lanes1 = lanes64(w, 1);
    const int stream_rows = j->stream && w == T512 && streamable(j->row_data + r0 * j->k + c0, j->k);
#define SCALED(x, f) (use_mul ? _mm512_mul_ps(x, f) : _mm512_div_ps(x, f))
    for (int b0 = 0, cb = 0; b0 < h; b0 += bl, ++cb) {
        const int b1 = b0 + bl < h ? b0 + bl : h;
        __m512 cf[8];
        for (int i = 0; i < 8; ++i) cf[i] = j->col_data ? _mm512_load_ps(t->col_f + cb * T512 + 16 * i) : _mm512_setzero_ps();
        for (int r = b0; r < b1; ++r) {
            if (t->next) /* the casts are compute-bound: the memory system can fetch the next tile meanwhile */
                for (int b = 0; b < t->next_bytes; b += 64) _mm_prefetch(t->next + r * t->next_stride + b, _MM_HINT_T1);
            __m512 v[8];
            __m512i c[8];
            for (int i = 0; i < 8; ++i) v[i] = _mm512_load_ps(t->buf + r * T512 + 16 * i);
#define V(i) _mm512_castps_si512(v[i])
            const __m512i s0 = bytes64(V(0), V(1), V(2), V(3), 3), s1 = bytes64(V(4), V(5), V(6), V(7), 3);
#undef V
            if (j->row_data) {
                for (int i = 0; i < 8; ++i)
                    c[i] = magnitude16(SCALED(v[i], _mm512_set1_ps(t->row_f[(tiles ? cb : r) * nbr + (i >> lg)])),
                                       e4m3, nan);
                uint8_t *out = j->row_data + (r0 + r) * j->k + c0;
                const __m512i lo = with_signs(bytes64(c[0], c[1], c[2], c[3], 0), s0);
                const __m512i hi = with_signs(bytes64(c[4], c[5], c[6], c[7], 0), s1);
                if (stream_rows) {
                    _mm512_stream_si512((void *)out, lo);
                    _mm512_stream_si512((void *)(out + 64), hi);
                } else {
                    _mm512_mask_storeu_epi8(out, out_lanes0, lo);
                    _mm512_mask_storeu_epi8(out + 64, out_lanes1, hi);
                }
            }
            if (j->col_data) {
                for (int i = 0; i < 8; ++i) c[i] = magnitude16(SCALED(v[i], cf[i]), e4m3, nan);
                _mm512_store_si512(t->codes + r * T512, with_signs(bytes64(c[0], c[1], c[2], c[3], 0), s0));
                _mm512_store_si512(t->codes + r * T512 + 64, with_signs(bytes64(c[4], c[5], c[6], c[7], 0), s1));
            }
        }
    }
#undef SCALED
}

/* The passes with the input dtype, the format, mul or divide and NaN handling fixed at compile time. */
typedef void (*TilePass)(const TileJob *, Tile512 *, int64_t, int, int64_t, int);
#define TILE_PASS(NAME, CALL) \
    AVX512 static void NAME(const TileJob *j, Tile512 *t, int64_t r0, int h, int64_t c0, int w) { CALL; }
#define TILE_CASTS(FMT, E4M3) \
    TILE_PASS(cast_##FMT##_div, tile_cast(j, t, r0, h, c0, w, E4M3, 0, 0)) \
    TILE_PASS(cast_##FMT##_mul, tile_cast(j, t, r0, h, c0, w, E4M3, 1, 0)) \
    TILE_PASS(cast_##FMT##_div_nan, tile_cast(j, t, r0, h, c0, w, E4M3, 0, 1)) \
    TILE_PASS(cast_##FMT##_mul_nan, tile_cast(j, t, r0, h, c0, w, E4M3, 1, 1))
TILE_PASS(read_f32, tile_read(j, t, r0, h, c0, w, 1))
TILE_PASS(read_bf16, tile_read(j, t, r0, h, c0, w, 0))
TILE_CASTS(e4m3, 1)
TILE_CASTS(e5m2, 0)
/* [format][use_mul][the tile holds NaN] */
static const TilePass tile_casts[2][2][2] = {{{cast_e4m3_div, cast_e4m3_div_nan}, {cast_e4m3_mul, cast_e4m3_mul_nan}},
                                             {{cast_e5m2_div, cast_e5m2_div_nan}, {cast_e5m2_mul, cast_e5m2_mul_nan}}};

/* Whether any of n amaxes (|x| bits) is a NaN. */
static int any_nan(const uint32_t *amax, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; ++i) m = amax[i] > m ? amax[i] : m;
    return m > 0x7F800000u;
}

/* The columnwise codes of the tile (h x w, row-major in t->codes) into the (K, M) output. The transpose runs
 * 16 rows x 64 columns at a time, four 16 x 16 byte squares side by side in the 128-bit lanes (see
 * transpose_sse2), into t->codes_t (column-major, in L1); each output row then gets its h bytes in whole
 * cache lines (16-byte pieces straight to 128 output rows a page apart stall on the stores). */
AVX512 static void tile_transpose(const TileJob *j, Tile512 *t, int64_t r0, int h, int64_t c0, int w) {
    for (int rg = 0; rg < h; rg += 16)
        for (int cg = 0; cg < w; cg += 64) {
            __m512i a[16], b[16];
            for (int q = 0; q < 16; ++q) a[q] = _mm512_load_si512(t->codes + (rg + q) * T512 + cg);
            for (int round = 0; round < 4; ++round) {
                for (int q = 0; q < 8; ++q) {
                    b[2 * q] = _mm512_unpacklo_epi8(a[q], a[q + 8]);
                    b[2 * q + 1] = _mm512_unpackhi_epi8(a[q], a[q + 8]);
                }
                memcpy(a, b, sizeof a);
            }
            uint8_t *out = t->codes_t + cg * T512 + rg;
            for (int q = 0; q < 16; ++q) {
                _mm_store_si128((__m128i *)(out + q * T512), _mm512_castsi512_si128(a[q]));
                _mm_store_si128((__m128i *)(out + (q + 16) * T512), _mm512_extracti32x4_epi32(a[q], 1));
                _mm_store_si128((__m128i *)(out + (q + 32) * T512), _mm512_extracti32x4_epi32(a[q], 2));
                _mm_store_si128((__m128i *)(out + (q + 48) * T512), _mm512_extracti32x4_epi32(a[q], 3));
            }
        }
    const __mmask64 lanes0 = lanes64(h, 0), lanes1 = lanes64(h, 1);
    uint8_t *out = j->col_data + c0 * j->m + r0;
    const int64_t m = j->m;
    if (j->stream && h == T512 && streamable(out, m)) {
        for (int c = 0; c < w; ++c) {
            _mm512_stream_si512((void *)(out + c * m), _mm512_load_si512(t->codes_t + c * T512));
            _mm512_stream_si512((void *)(out + c * m + 64), _mm512_load_si512(t->codes_t + c * T512 + 64));
        }
        return;
    }
    for (int c = 0; c < w; ++c) {
        _mm512_mask_storeu_epi8(out + c * m, lanes0, _mm512_load_si512(t->codes_t + c * T512));
        _mm512_mask_storeu_epi8(out + c * m + 64, lanes1, _mm512_load_si512(t->codes_t + c * T512 + 64));
    }
}

/* One tile: read, scales, casts, transpose. */
AVX512 static void tile512(const TileJob *j, Tile512 *t, int64_t r0, int h, int64_t c0, int w) {
    const int bl = j->block, tiles = j->tile_rows > 1, row_blocks = j->row_data && !tiles;
    const int64_t k_blocks = (j->k + bl - 1) / bl, m_blocks = (j->m + bl - 1) / bl;
    const int nbw = (w + bl - 1) / bl, nbh = (h + bl - 1) / bl, nbr = T512 / bl;
    (j->in_dtype == IN_F32 ? read_f32 : read_bf16)(j, t, r0, h, c0, w);
    if (row_blocks) {
        scales_of(j, t->row_amax, (h * nbr + 15) & ~15, t->row_f, t->row_s);
        for (int r = 0; r < h; ++r)
            for (int b = 0; b < nbw; ++b)
                store_scale(j, j->row_scale, (r0 + r) * k_blocks + c0 / bl + b, t->row_s[r * nbr + b]);
    }
    if (tiles) { /* one amax per bl x bl tile: the maxima of its columns' maxima, [block of rows][block] */
        const int per = bl / 16;
        for (int cb = 0; cb < nbh; ++cb) {
            uint32_t m[8];
            for (int b = 0; b < 8 / per; ++b) {
                __m512i v = _mm512_load_si512(t->col_amax + cb * T512 + b * bl);
                for (int i = 1; i < per; ++i) v = _mm512_max_epu32(v, _mm512_load_si512(t->col_amax + cb * T512 + b * bl + 16 * i));
                m[b] = _mm512_reduce_max_epu32(v);
            }
            memcpy(t->row_amax + cb * nbr, m, sizeof(uint32_t) * (size_t)nbr);
        }
        scales_of(j, t->row_amax, (nbh * nbr + 15) & ~15, t->row_f, t->row_s);
        for (int cb = 0; cb < nbh; ++cb)
            for (int b = 0; b < nbw; ++b)
                store_scale(j, j->row_scale, (r0 / bl + cb) * k_blocks + c0 / bl + b, t->row_s[cb * nbr + b]);
    } else if (j->col_data) {
        scales_of(j, t->col_amax, nbh * T512, t->col_f, t->col_s); /* columns past w: amax 0, unused */
        for (int cb = 0; cb < nbh; ++cb)
            for (int c = 0; c < w; ++c)
                store_scale(j, j->col_scale, (c0 + c) * m_blocks + r0 / bl + cb, t->col_s[cb * T512 + c]);
    }
    const int64_t elem = j->in_dtype == IN_F32 ? 4 : 2;
    t->next = NULL;
    if (c0 + T512 < j->k) { /* the strip's next tile */
        t->next = (const char *)j->in + (r0 * j->k + c0 + T512) * elem;
        t->next_bytes = (int)((j->k - c0 - T512 < T512 ? j->k - c0 - T512 : T512) * elem);
    } else if (r0 + h < j->m && h == T512) { /* the next strip's first tile (its rows past m not read) */
        t->next = (const char *)j->in + (r0 + T512) * j->k * elem;
        t->next_bytes = (int)((j->k < T512 ? j->k : T512) * elem);
        if (j->m - r0 - T512 < T512) t->next = NULL; /* a short last strip: no row-count bookkeeping */
    }
    t->next_stride = j->k * elem;
    const int nan = j->col_data || tiles ? any_nan(t->col_amax, nbh * T512) : any_nan(t->row_amax, h * nbr);
    tile_casts[j->out_format][j->use_mul][nan](j, t, r0, h, c0, w);
    if (j->col_data && !tiles) tile_transpose(j, t, r0, h, c0, w);
}

/* tile_range on AVX-512: strips of 128 rows (strip_begin unused), tiles of 128 columns. */
static void tile_range_avx512(TileJob *j) {
    Tile512 *t = j->work;
    /* Strips are taken one at a time from the shared counter: a thread that loses its core to another
     * process then delays the call by one strip at most, not by half of the tensor. */
    for (int64_t s; (s = __atomic_fetch_add(j->next_strip, 1, __ATOMIC_RELAXED)) < j->strip_end;) {
        const int64_t r0 = s * T512;
        const int h = (int)(j->m - r0 < T512 ? j->m - r0 : T512);
        for (int64_t c0 = 0; c0 < j->k; c0 += T512) tile512(j, t, r0, h, c0, (int)(j->k - c0 < T512 ? j->k - c0 : T512));
    }
    if (j->stream) _mm_sfence(); /* the streamed codes are visible to the thread that joins this one */
}
#endif

/* Rows per strip: one tile, or up to STRIP_ROWS rows of 1xB blocks (at most STRIP_BLOCKS blocks), so that the
 * columnwise output, one page per column for 4096 tokens, is written in runs of STRIP_ROWS bytes. */
static int64_t strip_rows(int tile_rows, int block) {
    if (tile_rows > 1) return tile_rows;
    const int64_t blocks = STRIP_ROWS / block < STRIP_BLOCKS ? STRIP_ROWS / block : STRIP_BLOCKS;
    return blocks * block;
}

/* A strip of rows in chunks of columns (TILE_BYTES of input at most). The tensor is read once: the rowwise
 * 1xB blocks are quantized as they are read, and for the columnwise layout the chunk is copied to `tile` on
 * the way, from where the columnwise loops read it again in cache (in the tensor its rows are often a power
 * of two apart, which maps them onto a few cache sets, so they would be evicted before that second read).
 * Without the copy (no memory for it) the columnwise loops read the tensor: same codes, slower. */
static void tile_range(TileJob *j) {
#if defined(__x86_64__)
    if (j->avx512) { tile_range_avx512(j); return; }
#endif
    const int64_t bl = j->block, strip = strip_rows(j->tile_rows, j->block);
    const int64_t elem = j->in_dtype == IN_F32 ? 4 : 2;
    int64_t chunk = TILE_BYTES / (strip * elem);
    chunk = (chunk < MAX_CHUNK ? chunk : MAX_CHUNK) / bl * bl;
    chunk = chunk < bl ? bl : chunk;
    const int64_t tile_elems = (strip < j->m ? strip : j->m) * (chunk < j->k ? chunk : j->k);
    char *tile = j->col_data ? malloc((size_t)(tile_elems * elem)) : NULL;
    const int blocks_1xb = j->row_data && j->tile_rows == 1;
    for (int64_t s = j->strip_begin; s < j->strip_end; ++s) {
        const int64_t r0 = s * strip, r1 = r0 + strip < j->m ? r0 + strip : j->m;
        for (int64_t c0 = 0; c0 < j->k; c0 += chunk) {
            const int64_t c1 = c0 + chunk < j->k ? c0 + chunk : j->k;
            if (blocks_1xb || tile) copy_chunk(j, r0, r1, c0, c1, tile, blocks_1xb);
            if (j->row_data && !blocks_1xb) chunk_tiles(j, r0, r1, c0, c1);
            if (!j->col_data) continue;
            TileJob t = *j;
            if (tile) t.in = tile, t.ld = c1 - c0, t.r_org = r0, t.c_org = c0;
            chunk_columnwise(&t, r0, r1, c0, c1);
        }
    }
    free(tile);
}

static void *run_tile(void *arg) { tile_range((TileJob *)arg); return NULL; }

static PyObject *py_quantize_tiles(PyObject *self, PyObject *args) {
    TileJob proto;
    unsigned long long in, table, row_data, row_scale, col_data, col_scale;
    long long m, k;
    int threads;
    double fp8_max, eps;
    memset(&proto, 0, sizeof proto);
    if (!PyArg_ParseTuple(args, "KiLLiKiiiiddpKKKKi", &in, &proto.in_dtype, &m, &k, &proto.out_format, &table,
                          &proto.mode, &proto.tile_rows, &proto.block, &proto.emax, &fp8_max, &eps, &proto.pow2,
                          &row_data, &row_scale, &col_data, &col_scale, &threads))
        return NULL;
    if (!check_formats(proto.in_dtype, proto.out_format, table, m * k) || m < 0 || k < 0 || proto.block < 1 ||
        proto.block > MAX_BLOCK || (proto.tile_rows != 1 && proto.tile_rows != proto.block) ||
        proto.mode < MODE_BLOCK || proto.mode > MODE_MX_FLOOR || (proto.mode != MODE_BLOCK && proto.out_format == OUT_HIF8)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "quantize_tiles: bad tile, block or mode");
        return NULL;
    }
    proto.in = (const void *)in;
    proto.m = m;
    proto.k = k;
    proto.fp8_max = (float)fp8_max;
    proto.eps = (float)eps;
    proto.table = (const uint8_t *)table;
    proto.row_data = (uint8_t *)row_data;
    proto.row_scale = (void *)row_scale;
    proto.col_data = (uint8_t *)col_data;
    proto.col_scale = (void *)col_scale;
    proto.ld = k;
    proto.use_mul = proto.mode != MODE_BLOCK || proto.pow2;
#if defined(__x86_64__)
    proto.avx2 = has_avx2();
    proto.avx2_cast = proto.avx2 && proto.out_format != OUT_HIF8;
    proto.avx512 = simd_level() >= SIMD_AVX512 && proto.out_format != OUT_HIF8 && T512 % proto.block == 0 &&
                   proto.block % 16 == 0;
    proto.stream = m * k >= STREAM_MIN_ELEMENTS;
#endif
    int64_t strip = proto.avx512 ? 128 : strip_rows(proto.tile_rows, proto.block);
    int64_t strips = (m + strip - 1) / strip;
    int64_t t = m * k / MIN_PER_THREAD;
    if (t > threads) t = threads;
    if (t > strips) t = strips;
    if (t > MAX_THREADS) t = MAX_THREADS;
    if (t < 1) t = 1;
    TileJob jobs[MAX_THREADS];
    char *work = NULL;
#if defined(__x86_64__)
    if (proto.avx512 && !(work = aligned_alloc(64, (size_t)t * sizeof(Tile512)))) { /* no memory: the other path */
        proto.avx512 = 0;
        strip = strip_rows(proto.tile_rows, proto.block);
        strips = (m + strip - 1) / strip;
        t = t < strips ? t : strips;
    }
#endif
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (strips + t - 1) / t;
    int64_t next_strip = 0;
    for (int64_t i = 0; i < t; ++i) {
        jobs[i] = proto;
#if defined(__x86_64__)
        if (work) jobs[i].work = work + i * sizeof(Tile512);
#endif
        jobs[i].strip_begin = i * step < strips ? i * step : strips;
        jobs[i].strip_end = (i + 1) * step < strips ? (i + 1) * step : strips;
        if (proto.avx512) jobs[i].next_strip = &next_strip, jobs[i].strip_end = strips;
    }
    run_jobs(run_tile, jobs, sizeof(TileJob), t);
    Py_END_ALLOW_THREADS
    free(work);
    Py_RETURN_NONE;
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    int limit;
    if (!PyArg_ParseTuple(args, "i", &limit)) return NULL;
    if (limit < SIMD_NONE || limit > SIMD_AVX512) {
        PyErr_SetString(PyExc_ValueError, "set_simd: limit must be 0 (scalar), 1 (AVX2) or 2 (AVX-512)");
        return NULL;
    }
    simd_limit = limit;
    return PyLong_FromLong(simd_level());
}

/* ---- Dequantize of block-scaled data: out[r, c] = values[code[r, c]] * scale[r / rows, c / cols] ----------
 * One pass (torch decodes, then multiplies by the expanded scales), the same float32 product; written as float32 or
 * as bfloat16 (that product rounded to nearest even, as torch's cast rounds it: exact for FP8 values times
 * power-of-2 scales in bfloat16's range, the operands of a bfloat16 GEMM). */
typedef struct {
    const uint8_t *codes;
    const float *values;
    const void *scales; /* float32, or E8M0 bytes when e8m0 */
    void *out;          /* float32, or bfloat16 when bf16 */
    int64_t k, scale_cols, rows, cols, row_begin, row_end;
    int e8m0, bf16;
    const Bf16Planes *planes; /* values as byte planes, or NULL (see decode_vbmi) */
    Pow2Range shifts;         /* the tile scales decode64_bf16_pow2 may apply (pow2_range of planes) */
} DequantJob;

/* The float32 value 2^(b - 127) of an E8M0 byte (b = 0 gives the subnormal 2^-127, 0xFF NaN), as torch's
 * float8_e8m0fnu cast gives it. */
static inline float e8m0_value(uint8_t b) {
    return b == 0xFF ? float_of(0x7FC00000u) : b == 0 ? float_of(0x00400000u) : float_of((uint32_t)b << 23);
}

/* Threads for a job split by rows: one per MIN_PER_THREAD elements, at most `threads`, `m` and MAX_THREADS. */
static int64_t row_threads(int64_t m, int64_t numel, int threads) {
    int64_t t = numel / MIN_PER_THREAD;
    t = t > threads ? threads : t;
    t = t > m ? m : t;
    return t > MAX_THREADS ? MAX_THREADS : t < 1 ? 1 : t;
}

/* A tile's scale as float32 (stored as float32 or as an E8M0 byte). */
static inline float tile_scale(const DequantJob *j, int64_t i) {
    return j->e8m0 ? e8m0_value(((const uint8_t *)j->scales)[i]) : ((const float *)j->scales)[i];
}

/* Columns [c0, c1) of row r, all in the tile of scale s, one code at a time. */
static inline void dequant_span(const DequantJob *j, int64_t r, int64_t c0, int64_t c1, float s) {
    const uint8_t *restrict in = j->codes + r * j->k;
    const float *restrict values = j->values;
    if (j->bf16) {
        uint16_t *restrict out = (uint16_t *)j->out + r * j->k;
        for (int64_t c = c0; c < c1; ++c) out[c] = bf16_bits(values[in[c]] * s);
    } else {
        float *restrict out = (float *)j->out + r * j->k;
        for (int64_t c = c0; c < c1; ++c) out[c] = values[in[c]] * s;
    }
}

#if defined(__x86_64__)
/* dequant_rows with the decode gathered 8 codes at a time (decode_avx2), inlined so that MX's 32-wide tiles
 * pay no call per tile. float32 output only. */
__attribute__((target("avx2"))) static void dequant_rows_avx2(const DequantJob *j) {
    const int64_t k = j->k, cols = j->cols;
    for (int64_t r = j->row_begin; r < j->row_end; ++r) {
        const uint8_t *in = j->codes + r * k;
        const int64_t first = (r / j->rows) * j->scale_cols;
        float *out = (float *)j->out + r * k;
        for (int64_t c0 = 0, tile = first; c0 < k; c0 += cols, ++tile) {
            const int64_t c1 = c0 + cols < k ? c0 + cols : k;
            const float s = tile_scale(j, tile);
            for (int64_t c = decode_avx2(in, j->values, out, c0, c1, s); c < c1; ++c) out[c] = j->values[in[c]] * s;
        }
    }
}

/* dequant_rows through decode64_vbmi, for tiles whose width is a multiple of 16: each 16 codes of a 64-code
 * step lie in one tile and are multiplied by its scale (the tile is counted along, not divided for: an integer
 * division per 16 codes cost more than the decode). A bfloat16 step whose tiles all have scales that
 * decode64_bf16_pow2 can apply takes that path. A row's last codes (fewer than 64) go one at a time. */
AVX512 static inline __attribute__((always_inline)) void dequant_rows_vbmi(const DequantJob *j, const int bf16) {
    const VbmiTable t = vbmi_table(j->planes);
    const int64_t k = j->k, cols = j->cols, elem = bf16 ? 2 : 4;
    for (int64_t r = j->row_begin; r < j->row_end; ++r) {
        const uint8_t *in = j->codes + r * k;
        const int64_t first = (r / j->rows) * j->scale_cols;
        char *out = (char *)j->out + r * k * elem;
        int64_t c0 = 0, tile = 0, left = cols; /* the tile of the next 16 codes, and its codes still to come */
        float scale_f = tile_scale(j, first);
        __m512 scale = _mm512_set1_ps(scale_f);
        int pow2, shift = pow2_shift(scale_f, j->shifts, &pow2); /* bfloat16: the scale as an exponent shift */
        for (; c0 + 64 <= k; c0 += 64) {
            __m512 s[4];
            int shifts[4], fast = bf16;
            for (int g = 0; g < 4; ++g) {
                s[g] = scale;
                shifts[g] = shift;
                fast &= pow2;
                if ((left -= 16) == 0 && ++tile * cols < k) {
                    left = cols;
                    scale_f = tile_scale(j, first + tile);
                    scale = _mm512_set1_ps(scale_f);
                    shift = pow2_shift(scale_f, j->shifts, &pow2);
                }
            }
            if (fast) {
                const __m512i inc[2] = {
                    _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(shifts[0] << 7)),
                                            _mm512_set1_epi16((short)(shifts[1] << 7))),
                    _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(shifts[2] << 7)),
                                            _mm512_set1_epi16((short)(shifts[3] << 7)))};
                decode64_bf16_pow2(&t, in + c0, (uint16_t *)out + c0, inc);
            } else {
                decode64_vbmi(&t, in + c0, out + c0 * elem, s, bf16);
            }
        }
        for (int64_t c1; c0 < k; c0 = c1) {
            c1 = (c0 / cols + 1) * cols < k ? (c0 / cols + 1) * cols : k;
            dequant_span(j, r, c0, c1, tile_scale(j, first + c0 / cols));
        }
    }
}

AVX512 static void dequant_rows_vbmi_f32(const DequantJob *j) { dequant_rows_vbmi(j, 0); }
AVX512 static void dequant_rows_vbmi_bf16(const DequantJob *j) { dequant_rows_vbmi(j, 1); }
#endif

static void dequant_rows(DequantJob *j) {
#if defined(__x86_64__)
    if (j->planes && j->cols % 16 == 0 && simd_level() >= SIMD_AVX512) {
        (j->bf16 ? dequant_rows_vbmi_bf16 : dequant_rows_vbmi_f32)(j);
        return;
    }
    if (has_avx2() && !j->bf16) {
        dequant_rows_avx2(j);
        return;
    }
#endif
    for (int64_t r = j->row_begin; r < j->row_end; ++r) {
        const int64_t first = (r / j->rows) * j->scale_cols;
        for (int64_t c0 = 0, tile = first; c0 < j->k; c0 += j->cols, ++tile)
            dequant_span(j, r, c0, c0 + j->cols < j->k ? c0 + j->cols : j->k, tile_scale(j, tile));
    }
}

static void *run_dequant(void *arg) { dequant_rows((DequantJob *)arg); return NULL; }

static PyObject *py_dequantize_tiles(PyObject *self, PyObject *args) {
    unsigned long long codes, values, scales, out;
    long long m, k, scale_cols, rows, cols;
    int threads, e8m0, bf16;
    if (!PyArg_ParseTuple(args, "KLLKKLLLKiii", &codes, &m, &k, &values, &scales, &scale_cols, &rows, &cols, &out,
                          &threads, &e8m0, &bf16))
        return NULL;
    if (m < 0 || k < 0 || rows < 1 || cols < 1 || scale_cols < (k + cols - 1) / cols || !values || !scales) {
        PyErr_SetString(PyExc_ValueError, "dequantize_tiles: bad shape, tile or table");
        return NULL;
    }
    const int64_t t = row_threads(m, m * k, threads);
    DequantJob jobs[MAX_THREADS];
    Bf16Planes planes;
    const Bf16Planes *have_planes = bf16_planes((const float *)values, &planes) ? &planes : NULL;
    const Pow2Range shifts = have_planes ? pow2_range(have_planes) : (Pow2Range){1, 0};
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (m + t - 1) / t;
    for (int64_t i = 0; i < t; ++i) {
        jobs[i] = (DequantJob){(const uint8_t *)codes, (const float *)values, (const void *)scales, (void *)out,
                               k, scale_cols, rows, cols, i * step < m ? i * step : m,
                               (i + 1) * step < m ? (i + 1) * step : m, e8m0, bf16 != 0, have_planes, shifts};
    }
    run_jobs(run_dequant, jobs, sizeof(DequantJob), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- GEMM epilogue: out = cast((acc * scale_b) * scale_a + bias[c]) ------------------------------------------
 * The float32 sum of a per-tensor scaled GEMM dequantized in the order aclnnQuantMatmulV5 documents (x2's
 * scale, then x1's), the bias added in float32, and the result written as float32, as bfloat16 (round to
 * nearest even, NaN as 0x7FC0, as torch's scalar cast) or added to a float32 `out`: one pass where torch
 * makes one per op. Built with -ffp-contract=off, so no multiply and add are fused into one rounding. */
enum { EPI_F32 = 0, EPI_BF16 = 1, EPI_ACCUMULATE = 2 };
typedef struct {
    const float *acc, *bias;
    void *out;
    int64_t cols, row_begin, row_end;
    float scale_b, scale_a;
    int kind;
} EpilogueJob;

#if defined(__x86_64__)
/* The bfloat16 epilogue of one row, 16 columns at a time (the compiler's own vectors of the loop below run at
 * half this speed); returns where the scalar loop takes over. */
AVX512 static int64_t epilogue_bf16_avx512(const float *acc, const float *bias, uint16_t *out, int64_t cols,
                                           float sb, float sa) {
    const __m512 vb = _mm512_set1_ps(sb), va = _mm512_set1_ps(sa);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(acc + c), vb), va);
        if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + c));
        _mm256_storeu_si256((__m256i *)(out + c), bf16_bits16(y));
    }
    return c;
}
#endif

#if defined(__x86_64__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void epilogue_rows(EpilogueJob *j) {
    const int64_t cols = j->cols;
    const float sb = j->scale_b, sa = j->scale_a;
#if defined(__x86_64__)
    const int avx512 = simd_level() >= SIMD_AVX512;
#endif
    for (int64_t r = j->row_begin; r < j->row_end; ++r) {
        const float *restrict acc = j->acc + r * cols;
        const float *restrict bias = j->bias;
        if (j->kind == EPI_ACCUMULATE) {
            float *restrict out = (float *)j->out + r * cols;
            for (int64_t c = 0; c < cols; ++c) out[c] += acc[c] * sb * sa;
        } else if (j->kind == EPI_F32) { /* may write over acc: no restrict here */
            const float *in = j->acc + r * cols;
            float *out = (float *)j->out + r * cols;
            if (bias) for (int64_t c = 0; c < cols; ++c) out[c] = in[c] * sb * sa + bias[c];
            else for (int64_t c = 0; c < cols; ++c) out[c] = in[c] * sb * sa;
        } else {
            uint16_t *restrict out = (uint16_t *)j->out + r * cols;
            int64_t c = 0;
#if defined(__x86_64__)
            if (avx512) c = epilogue_bf16_avx512(acc, bias, out, cols, sb, sa);
#endif
            if (bias) for (; c < cols; ++c) out[c] = bf16_bits(acc[c] * sb * sa + bias[c]);
            else for (; c < cols; ++c) out[c] = bf16_bits(acc[c] * sb * sa);
        }
    }
}

static void *run_epilogue(void *arg) { epilogue_rows((EpilogueJob *)arg); return NULL; }

static PyObject *py_gemm_epilogue(PyObject *self, PyObject *args) {
    unsigned long long acc, bias, out, scale_b, scale_a;
    long long m, n;
    int kind, threads;
    if (!PyArg_ParseTuple(args, "KLLKKKKii", &acc, &m, &n, &scale_b, &scale_a, &bias, &out, &kind, &threads))
        return NULL;
    if (m < 0 || n < 0 || kind < EPI_F32 || kind > EPI_ACCUMULATE || (kind == EPI_ACCUMULATE && bias)) {
        PyErr_SetString(PyExc_ValueError, "gemm_epilogue: bad shape or kind, or a bias with accumulation");
        return NULL;
    }
    const float sb = scale_b ? *(const float *)scale_b : 1.0f, sa = scale_a ? *(const float *)scale_a : 1.0f;
    const int64_t t = row_threads(m, m * n, threads);
    EpilogueJob jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (m + t - 1) / t;
    for (int64_t i = 0; i < t; ++i)
        jobs[i] = (EpilogueJob){(const float *)acc, (const float *)bias, (void *)out, n,
                                i * step < m ? i * step : m, (i + 1) * step < m ? (i + 1) * step : m, sb, sa, kind};
    run_jobs(run_epilogue, jobs, sizeof(EpilogueJob), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gemm_bf16_supported(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(gemm_bf16_supported());
}

static PyMethodDef methods[] = {
    {"scaled_cast", py_scaled_cast, METH_VARARGS,
     "scaled_cast(in, in_dtype, n, scale_inv, out, out_format, table, threads): out = sat(in / *scale_inv)"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(in, in_dtype, n, out, out_format, table, threads, amax, divisor, scale_inv_out, fp8_max, eps, pow2)"},
    {"amax", py_amax, METH_VARARGS, "amax(in, in_dtype, n, out, threads): *out = max |in| (NaN if any)"},
    {"decode", py_decode, METH_VARARGS, "decode(in, n, values, out, threads): out = values[in] (uint8 codes)"},
    {"quantize_tiles", py_quantize_tiles, METH_VARARGS,
     "quantize_tiles(in, in_dtype, m, k, out_format, table, mode, tile_rows, block, emax, fp8_max, eps, pow2, "
     "row_data, row_scale, col_data, col_scale, threads): block / MX quantize, rowwise and/or columnwise"},
    {"dequantize_tiles", py_dequantize_tiles, METH_VARARGS,
     "dequantize_tiles(codes, m, k, values, scales, scale_cols, rows, cols, out, threads, e8m0, bf16): out = "
     "values[codes] * scales[r / rows, c / cols] (scales float32, or E8M0 bytes when e8m0; out bfloat16 when bf16)"},
    {"gemm_epilogue", py_gemm_epilogue, METH_VARARGS,
     "gemm_epilogue(acc, m, n, scale_b, scale_a, bias, out, kind, threads): out = (acc * *scale_b) * *scale_a + "
     "bias as float32 (kind 0) or bfloat16 (1), or out += (acc * *scale_b) * *scale_a (2)"},
    {"gemm_bf16", py_gemm_bf16, METH_VARARGS,
     "gemm_bf16(a, b, c, m, n, k, threads): c = a . b^T in float32, a and b given as (data, rs, cs, kind, table) "
     "with kind 0 bfloat16, 1 float32 holding bfloat16 values, 2 uint8 codes of the 256 float32 values at table"},
    {"gemm_bf16_supported", py_gemm_bf16_supported, METH_NOARGS, "whether this CPU runs gemm_bf16 (AVX-512 BF16)"},
    {"set_simd", py_set_simd, METH_VARARGS,
     "set_simd(limit): use vector code up to 0 (scalar), 1 (AVX2) or 2 (AVX-512); returns the level in effect"},
    {"current_scale_inv", py_current_scale_inv, METH_VARARGS,
     "current_scale_inv(amax, out, fp8_max, eps, pow2): *out = the current-scaling scale_inv of *amax"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_cast", "Fused CPU quantize kernels.", -1, methods};

PyMODINIT_FUNC PyInit__fused_cast(void) {
    PyObject *m = PyModule_Create(&module);
#if defined(_OPENMP)
    const long openmp = 1;
#else
    const long openmp = 0;
#endif
    if (m && PyModule_AddIntConstant(m, "openmp", openmp) < 0) Py_CLEAR(m);
    return m;
}
