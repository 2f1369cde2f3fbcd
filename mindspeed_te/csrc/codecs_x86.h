/* The x86 vector forms of codecs.h that several kernel files use: the AVX2 FP8 encode, 8-element load and horizontal
 * max (cast.c, tiles.c, nvfp4.c), the AVX-512 FP8 encode in its three steps (cast.c, tiles_avx512.c), the bfloat16
 * rounding of 16 lanes (decode.c, epilogue.c), and the AVX512 target attribute. Each function carries its own target
 * attribute, so every file compiles with the same baseline flags (setup.py) and simd_level (simd.c) picks the code at
 * run time. Static inline, as in codecs.h; empty off x86-64. */
#ifndef MINDSPEED_TE_CODECS_X86_H
#define MINDSPEED_TE_CODECS_X86_H

#include "codecs.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* The AVX-512 subsets simd_level asks for before it answers SIMD_AVX512. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vbmi")))

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

/* to_e2m1 of 8 lanes: fp8_codes_avx2's rounding with E2M1's fields (a NaN as 6, whose code is 7), then the sign
 * moved from bit 7 to bit 3, and dropped for NaN (+6). */
__attribute__((target("avx2"))) static inline __m256i e2m1_codes_avx2(__m256 q) {
    const __m256i c = fp8_codes_avx2(q, 1, 127, 0x40C00000, 0);
    const __m256i a = _mm256_and_si256(_mm256_castps_si256(q), _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    const __m256i sign = _mm256_andnot_si256(nan, _mm256_srli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 4));
    return _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(0x7)), sign);
}

/* The largest of 8 non-negative int32 lanes (|x| bits: the signed max orders them). */
__attribute__((target("avx2"))) static inline uint32_t hmax_avx2(__m256i m) {
    __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(h);
}

/* 8 floats of the input from element i: float32, or bfloat16 widened. */
__attribute__((target("avx2"))) static inline __m256 load8_avx2(const void *in, int in_dtype, int64_t i) {
    if (in_dtype == IN_F32) return _mm256_loadu_ps((const float *)in + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)in + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* bf16_bits of 16 lanes. */
AVX512 static inline __m256i bf16_bits16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

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
#endif

#endif
