/* NVFP4 quantize (quantize_nvfp4), dequantize (dequantize_nvfp4) and the columnwise random Hadamard transform
 * (hadamard_columns), TransformerEngine's rules as mindspeed_te.fp4 has them (nvfp4_block_scales, e2m1_encode,
 * nvfp4_decode_scale, random_hadamard_transform), in the same float32 operations.
 *
 * The quantize makes one form of a 2-D float32 / bfloat16 tensor: blocks of 16 along its rows (or 16x16 tiles),
 * per block decode = amax * (S_enc / 6) clamped to 448, scale = E4M3(decode), encode = min(1 / (scale * S_dec),
 * FLT_MAX), codes = E2M1(x * encode) rounded to nearest even or stochastically with the caller's random bytes,
 * packed two a byte; 16x16 tiles rounded to nearest even can also come in the transpose's layout, from the same
 * codes. The dequantize reads the packed codes and E4M3 scales: code * ((scale * amax) * 1 / 2688), as float32 or
 * bfloat16. The transform writes the Hadamard-transformed transpose the columnwise form is quantized from, with
 * its amax and the input's.
 * Scalar, AVX2 and AVX-512 loops, chosen at run time, give the same bits. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"

#include <stdint.h>
#include <string.h>

#define NV_BLOCK 16
#define NV_CHUNK 256 /* blocks of a strip of 16x16 tiles handled at a time (their scales on the stack) */

typedef struct {
    const void *in;
    int in_dtype, tile, simd;
    int64_t m, k, row_begin, row_end;
    float decode_factor, s_dec;   /* S_enc * float32(1/6), 1 / S_enc */
    const uint8_t *rbits;         /* one random byte per element (row-major), or NULL: round to nearest even */
    uint8_t *data, *scale;        /* packed codes (m, k / 2), E4M3 scale bytes (m, k / 16) */
    uint8_t *col_data, *col_scale; /* 16x16 tiles only, or NULL: the transpose's, (k, m / 2) and (k, m / 16) */
} Nvfp4Job;

/* The value of an E4M3 code (0x7F, 0xFF: NaN), exact. */
static inline float e4m3_value(uint8_t c) {
    if ((c & 0x7F) == 0x7F) return float_of(0x7FC00000u);
    const uint32_t e = (c >> 3) & 0xFu, mantissa = c & 7u;
    const float v = e ? float_of(((e + 120u) << 23) | (mantissa << 20)) : (float)mantissa * 0x1p-9f;
    return c & 0x80 ? -v : v;
}

/* A block's E4M3 scale byte (*scale) and float32 encode multiplier from its amax bits (|x| as float32 bits, above
 * 0x7F800000 for NaN). The comparisons keep a NaN, as torch.minimum and clamp do: a block holding NaN gets the
 * NaN scale 0xFF (nvfp4_block_scales' byte) and NaN codes. */
static inline float block_encode(const Nvfp4Job *j, uint32_t amax_bits, uint8_t *scale) {
    float decode = float_of(amax_bits > 0x7F800000u ? 0x7FC00000u : amax_bits) * j->decode_factor;
    decode = decode > 448.0f ? 448.0f : decode;
    *scale = decode == decode ? to_e4m3(decode) : 0xFF;
    const float encode = 1.0f / (e4m3_value(*scale) * j->s_dec);
    return encode > FLT_MAX ? FLT_MAX : encode;
}

/* The E2M1 grid's spacing at magnitude a: 0.5 below 2, 1 below 4, else (NaN too) 2. */
static inline float grid_step(float a) { return a < 2.0f ? 0.5f : a < 4.0f ? 1.0f : 2.0f; }

/* The code of q, rounded down onto the grid after adding r / 256 of the spacing at |q| (mindspeed_te.fp4's
 * stochastic rounding): a grid value with q's sign, saturated by to_e2m1. */
static inline uint8_t sr_e2m1(float q, uint8_t r) {
    const float a = fabsf(q), t = a + (float)r * (1.0f / 256.0f) * grid_step(a), step = grid_step(t);
    return to_e2m1(copysignf(floorf(t / step) * step, q));
}

static uint32_t block_amax_scalar(const Nvfp4Job *j, int64_t i) {
    uint32_t m = 0;
    for (int t = 0; t < NV_BLOCK; ++t) {
        const uint32_t a = input_abs_bits(j->in, j->in_dtype, i + t);
        m = a > m ? a : m;
    }
    return m;
}

/* The 16 codes (one a byte) of the 16 elements from i scaled by f, rounded to nearest even. */
static void block_code_bytes_scalar(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    for (int t = 0; t < NV_BLOCK; ++t) out[t] = to_e2m1(input_value(j->in, j->in_dtype, i + t) * f);
}

/* The 8 packed bytes of the 16 elements from i scaled by f. */
static void block_codes_scalar(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    uint8_t c[NV_BLOCK];
    for (int t = 0; t < NV_BLOCK; ++t) {
        const float q = input_value(j->in, j->in_dtype, i + t) * f;
        c[t] = j->rbits ? sr_e2m1(q, j->rbits[i + t]) : to_e2m1(q);
    }
    for (int t = 0; t < NV_BLOCK / 2; ++t) out[t] = (uint8_t)(c[2 * t] | c[2 * t + 1] << 4);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static inline __m256 grid_step_avx2(__m256 a) {
    const __m256 step = _mm256_blendv_ps(_mm256_set1_ps(2.0f), _mm256_set1_ps(1.0f),
                                         _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(step, _mm256_set1_ps(0.5f), _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_LT_OQ));
}

/* 1 / grid_step_avx2(a): t / step as t * (1 / step), the same real number rounded once (step a power of 2). */
__attribute__((target("avx2"))) static inline __m256 grid_step_inverse_avx2(__m256 a) {
    const __m256 inverse = _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(1.0f),
                                            _mm256_cmp_ps(a, _mm256_set1_ps(4.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(inverse, _mm256_set1_ps(2.0f), _mm256_cmp_ps(a, _mm256_set1_ps(2.0f), _CMP_LT_OQ));
}

/* sr_e2m1 of 8 lanes, the random bytes at r. */
__attribute__((target("avx2"))) static inline __m256i sr_codes_avx2(__m256 q, const uint8_t *r) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 a = _mm256_andnot_ps(sign, q);
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)r))),
                                   _mm256_set1_ps(1.0f / 256.0f));
    const __m256 t = _mm256_add_ps(a, _mm256_mul_ps(u, grid_step_avx2(a))), step = grid_step_avx2(t);
    const __m256 g = _mm256_mul_ps(_mm256_floor_ps(_mm256_mul_ps(t, grid_step_inverse_avx2(t))), step);
    return e2m1_codes_avx2(_mm256_or_ps(g, _mm256_and_ps(q, sign)));
}

/* Sixteen codes in int32 lanes (elements 0-7, 8-15) as 8 bytes, element 2i in the low nibble of byte i. */
__attribute__((target("avx2"))) static inline void store_packed_avx2(uint8_t *out, __m256i c0, __m256i c1) {
    const __m128i w0 = _mm_packus_epi32(_mm256_castsi256_si128(c0), _mm256_extracti128_si256(c0, 1));
    const __m128i bytes = _mm_packus_epi16(w0, _mm_packus_epi32(_mm256_castsi256_si128(c1),
                                                                _mm256_extracti128_si256(c1, 1)));
    const __m128i pairs = _mm_and_si128(_mm_or_si128(bytes, _mm_srli_epi16(bytes, 4)), _mm_set1_epi16(0xFF));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(pairs, pairs));
}

__attribute__((target("avx2"))) static inline uint32_t block_amax_avx2(const Nvfp4Job *j, int64_t i) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return hmax_avx2(_mm256_max_epi32(_mm256_castps_si256(_mm256_and_ps(load8_avx2(j->in, j->in_dtype, i), abs)),
                                      _mm256_castps_si256(_mm256_and_ps(load8_avx2(j->in, j->in_dtype, i + 8), abs))));
}

__attribute__((target("avx2"))) static void block_code_bytes_avx2(const Nvfp4Job *j, int64_t i, float f,
                                                                   uint8_t *out) {
    const __m256 fv = _mm256_set1_ps(f);
    const __m256i c0 = e2m1_codes_avx2(_mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i), fv));
    const __m256i c1 = e2m1_codes_avx2(_mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i + 8), fv));
    const __m128i w0 = _mm_packus_epi32(_mm256_castsi256_si128(c0), _mm256_extracti128_si256(c0, 1));
    const __m128i w1 = _mm_packus_epi32(_mm256_castsi256_si128(c1), _mm256_extracti128_si256(c1, 1));
    _mm_storeu_si128((__m128i *)out, _mm_packus_epi16(w0, w1));
}

__attribute__((target("avx2"))) static void block_codes_avx2(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    const __m256 fv = _mm256_set1_ps(f);
    const __m256 q0 = _mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i), fv);
    const __m256 q1 = _mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i + 8), fv);
    if (j->rbits)
        store_packed_avx2(out, sr_codes_avx2(q0, j->rbits + i), sr_codes_avx2(q1, j->rbits + i + 8));
    else
        store_packed_avx2(out, e2m1_codes_avx2(q0), e2m1_codes_avx2(q1));
}

/* AVX-512: a block is one vector of 16 lanes. */
AVX512 static inline __m512 load16_avx512(const Nvfp4Job *j, int64_t i) {
    if (j->in_dtype == IN_F32) return _mm512_loadu_ps((const float *)j->in + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)j->in + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e2m1_codes_avx2 of 16 lanes. */
AVX512 static inline __m512i e2m1_codes_avx512(__m512 q) {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));
    const __m512i m = _mm512_min_epi32(a, _mm512_set1_epi32(0x40C00000));
    const __m512i e = _mm512_max_epi32(_mm512_and_si512(m, _mm512_set1_epi32(0x7F800000)),
                                       _mm512_set1_epi32(127 << 23));
    const __m512i magic = _mm512_add_epi32(e, _mm512_set1_epi32(22 << 23));
    const __m512i count = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(m), _mm512_castsi512_ps(magic))), magic);
    const __m512i code = _mm512_add_epi32(_mm512_srli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(127 << 23)), 22),
                                          count);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 28), _mm512_set1_epi32(0x8));
    return _mm512_mask_mov_epi32(_mm512_or_si512(code, sign), nan, _mm512_set1_epi32(0x7));
}

/* grid_step_avx2 (inverse: its reciprocal) of 16 lanes. */
AVX512 static inline __m512 grid_step_avx512(__m512 a, int inverse) {
    const __m512 step = _mm512_mask_mov_ps(_mm512_set1_ps(inverse ? 0.5f : 2.0f),
                                           _mm512_cmp_ps_mask(a, _mm512_set1_ps(4.0f), _CMP_LT_OQ),
                                           _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(step, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.0f), _CMP_LT_OQ),
                              _mm512_set1_ps(inverse ? 2.0f : 0.5f));
}

/* sr_codes_avx2 of 16 lanes. */
AVX512 static inline __m512i sr_codes_avx512(__m512 q, const uint8_t *r) {
    const __m512 a = _mm512_abs_ps(q);
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)r))),
                                   _mm512_set1_ps(1.0f / 256.0f));
    const __m512 t = _mm512_add_ps(a, _mm512_mul_ps(u, grid_step_avx512(a, 0)));
    const __m512 down = _mm512_roundscale_ps(_mm512_mul_ps(t, grid_step_avx512(t, 1)),
                                             _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 g = _mm512_mul_ps(down, grid_step_avx512(t, 0));
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    return e2m1_codes_avx512(_mm512_or_ps(g, _mm512_and_ps(q, sign)));
}

/* block_encode of 16 blocks: amax bits from amax, encode multipliers to f, scale bytes to s. The E4M3 rounding is
 * to_fp8's (decode is at least 0, at most 448 here), the scale's value rebuilt from its fields. */
AVX512 static void blocks_encode_avx512(const Nvfp4Job *j, const uint32_t *amax, float *f, uint8_t *s) {
    const __m512 decode = _mm512_mul_ps(_mm512_loadu_ps((const float *)amax), _mm512_set1_ps(j->decode_factor));
    const __mmask16 nan = _mm512_cmp_ps_mask(decode, decode, _CMP_UNORD_Q);
    const __m512i a = _mm512_castps_si512(_mm512_mask_mov_ps(
        decode, _mm512_cmp_ps_mask(decode, _mm512_set1_ps(448.0f), _CMP_GT_OQ), _mm512_set1_ps(448.0f)));
    const __m512i e = _mm512_max_epi32(_mm512_and_si512(a, _mm512_set1_epi32(0x7F800000)),
                                       _mm512_set1_epi32(121 << 23));
    const __m512i magic = _mm512_add_epi32(e, _mm512_set1_epi32(20 << 23));
    const __m512i count = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic))), magic);
    const __m512i code = _mm512_mask_mov_epi32(
        _mm512_add_epi32(_mm512_srli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(121 << 23)), 20), count), nan,
        _mm512_set1_epi32(0xFF));
    const __m512i field = _mm512_srli_epi32(code, 3), mantissa = _mm512_and_si512(code, _mm512_set1_epi32(7));
    const __m512 normal = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(field, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(mantissa, 20)));
    __m512 value = _mm512_mask_mov_ps(normal, _mm512_cmpeq_epi32_mask(field, _mm512_setzero_si512()),
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(mantissa), _mm512_set1_ps(0x1p-9f)));
    value = _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(NAN));
    const __m512 encode = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(value, _mm512_set1_ps(j->s_dec)));
    _mm512_storeu_ps(f, _mm512_mask_mov_ps(encode, _mm512_cmp_ps_mask(encode, _mm512_set1_ps(FLT_MAX), _CMP_GT_OQ),
                                           _mm512_set1_ps(FLT_MAX)));
    _mm_storeu_si128((__m128i *)s, _mm512_cvtepi32_epi8(code));
}

AVX512 static inline uint32_t block_amax_avx512(const Nvfp4Job *j, int64_t i) {
    return (uint32_t)_mm512_reduce_max_epi32(
        _mm512_and_si512(_mm512_castps_si512(load16_avx512(j, i)), _mm512_set1_epi32(0x7FFFFFFF)));
}

AVX512 static void block_code_bytes_avx512(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    _mm_storeu_si128((__m128i *)out,
                     _mm512_cvtepi32_epi8(e2m1_codes_avx512(_mm512_mul_ps(load16_avx512(j, i), _mm512_set1_ps(f)))));
}

AVX512 static void block_codes_avx512(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    const __m512 q = _mm512_mul_ps(load16_avx512(j, i), _mm512_set1_ps(f));
    const __m128i bytes = _mm512_cvtepi32_epi8(j->rbits ? sr_codes_avx512(q, j->rbits + i) : e2m1_codes_avx512(q));
    const __m128i pairs = _mm_and_si128(_mm_or_si128(bytes, _mm_srli_epi16(bytes, 4)), _mm_set1_epi16(0xFF));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(pairs, pairs));
}
#endif

static inline uint32_t block_amax(const Nvfp4Job *j, int64_t i) {
#if defined(__x86_64__)
    if (j->simd >= SIMD_AVX512) return block_amax_avx512(j, i);
    if (j->simd >= SIMD_AVX2) return block_amax_avx2(j, i);
#endif
    return block_amax_scalar(j, i);
}

static inline void block_code_bytes(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
#if defined(__x86_64__)
    if (j->simd >= SIMD_AVX512) { block_code_bytes_avx512(j, i, f, out); return; }
    if (j->simd >= SIMD_AVX2) { block_code_bytes_avx2(j, i, f, out); return; }
#endif
    block_code_bytes_scalar(j, i, f, out);
}

static inline void block_codes(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
#if defined(__x86_64__)
    if (j->simd >= SIMD_AVX512) { block_codes_avx512(j, i, f, out); return; }
    if (j->simd >= SIMD_AVX2) { block_codes_avx2(j, i, f, out); return; }
#endif
    block_codes_scalar(j, i, f, out);
}

/* Tiles [b0, b1) of the strip from row r0 in both layouts (their encode multipliers f and scales s from index 0):
 * a tile's scale and codes are the same read along its rows or its columns, so its codes, computed once, are
 * packed along the rows into data and along the columns into col_data, the transpose's rowwise form. */
static void tiles_both_layouts(const Nvfp4Job *j, int64_t r0, int64_t b0, int64_t b1, const float *f,
                               const uint8_t *s) {
    const int64_t k = j->k, col_bytes = j->m / 2, col_blocks = j->m / NV_BLOCK;
    for (int64_t b = b0; b < b1; ++b) {
        uint8_t c[NV_BLOCK][NV_BLOCK];
        for (int r = 0; r < NV_BLOCK; ++r) block_code_bytes(j, (r0 + r) * k + b * NV_BLOCK, f[b - b0], c[r]);
        for (int r = 0; r < NV_BLOCK; ++r) {
            uint8_t *row = j->data + ((r0 + r) * k + b * NV_BLOCK) / 2;
            for (int t = 0; t < NV_BLOCK / 2; ++t) row[t] = (uint8_t)(c[r][2 * t] | c[r][2 * t + 1] << 4);
        }
        for (int t = 0; t < NV_BLOCK; ++t) {
            uint8_t *col = j->col_data + (b * NV_BLOCK + t) * col_bytes + r0 / 2;
            for (int r = 0; r < NV_BLOCK / 2; ++r) col[r] = (uint8_t)(c[2 * r][t] | c[2 * r + 1][t] << 4);
            j->col_scale[(b * NV_BLOCK + t) * col_blocks + r0 / NV_BLOCK] = s[b - b0];
        }
    }
}

/* Rows [row_begin, row_end): 1x16 blocks each read once, or strips of 16 rows in 16x16 tiles (the tile's amax
 * first, then its rows' codes; every row stores the tile's scale), with col_data in both layouts. */
static void nvfp4_rows(Nvfp4Job *j) {
    const int64_t k = j->k, nb = k / NV_BLOCK;
    for (int64_t r0 = j->row_begin; r0 < j->row_end; r0 += j->tile) {
        for (int64_t b0 = 0; b0 < nb; b0 += NV_CHUNK) {
            const int64_t b1 = b0 + NV_CHUNK < nb ? b0 + NV_CHUNK : nb;
            uint32_t amax[NV_CHUNK] = {0};
            for (int64_t r = r0; r < r0 + j->tile; ++r)
                for (int64_t b = b0; b < b1; ++b) {
                    const uint32_t a = block_amax(j, r * k + b * NV_BLOCK);
                    amax[b - b0] = a > amax[b - b0] ? a : amax[b - b0];
                }
            float f[NV_CHUNK];
            uint8_t s[NV_CHUNK];
            int64_t b = b0;
#if defined(__x86_64__)
            if (j->simd >= SIMD_AVX512)
                for (; b + 16 <= b1; b += 16) blocks_encode_avx512(j, amax + (b - b0), f + (b - b0), s + (b - b0));
#endif
            for (; b < b1; ++b) f[b - b0] = block_encode(j, amax[b - b0], &s[b - b0]);
            for (int64_t r = r0; r < r0 + j->tile; ++r) memcpy(j->scale + r * nb + b0, s, (size_t)(b1 - b0));
            if (j->col_data) {
                tiles_both_layouts(j, r0, b0, b1, f, s);
                continue;
            }
            for (int64_t r = r0; r < r0 + j->tile; ++r) {
                for (int64_t b = b0; b < b1; ++b)
                    block_codes(j, r * k + b * NV_BLOCK, f[b - b0], j->data + (r * k + b * NV_BLOCK) / 2);
            }
        }
    }
}

static void *run_nvfp4(void *arg) { nvfp4_rows((Nvfp4Job *)arg); return NULL; }

/* ---- Dequantize: out[r, c] = values[code] * ((float(scale[r, c / 16]) * amax) * factor), codes packed ---- */
typedef struct {
    const uint8_t *data, *scale;
    const float *values;     /* E2M1's 16 values (the first entries of a 256-value table) */
    const float *multiplier; /* a block's multiplier by its scale byte (256 of them, made once a call) */
    int simd, bf16;          /* bf16: the products rounded to bfloat16 (bf16_bits), else float32 */
    int64_t k, row_begin, row_end;
    void *out;
} Nvfp4Dequant;

/* The block's 16 values at element offset i of out. */
static void dequant_block_scalar(const Nvfp4Dequant *j, const uint8_t *in, float f, int64_t i) {
    for (int t = 0; t < NV_BLOCK; ++t) {
        const float v = j->values[t % 2 ? in[t / 2] >> 4 : in[t / 2] & 0x0F] * f;
        if (j->bf16) ((uint16_t *)j->out)[i + t] = bf16_bits(v);
        else ((float *)j->out)[i + t] = v;
    }
}

#if defined(__x86_64__)
/* The values of 8 codes in int32 lanes: a lookup in the two halves of the table, chosen by bit 3. */
__attribute__((target("avx2"))) static inline __m256 values8_avx2(__m256 lo, __m256 hi, __m256i c) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}

/* bf16_bits of 8 lanes, in the low half of each int32 lane. */
__attribute__((target("avx2"))) static inline __m256i bf16_bits8_avx2(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                                              16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

/* The 16 values of a block's 8 packed bytes times f, at element offset i of out: the bytes widened, split into
 * their nibbles and interleaved back into element order. */
__attribute__((target("avx2"))) static void dequant_block_avx2(const Nvfp4Dequant *j, const uint8_t *in, float f,
                                                              int64_t i) {
    const __m256 lo = _mm256_loadu_ps(j->values), hi = _mm256_loadu_ps(j->values + 8), fv = _mm256_set1_ps(f);
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)in));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi16(0x0F)), high = _mm_srli_epi16(bytes, 4);
    const __m256 v0 = _mm256_mul_ps(values8_avx2(lo, hi, _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(low, high))), fv);
    const __m256 v1 = _mm256_mul_ps(values8_avx2(lo, hi, _mm256_cvtepu16_epi32(_mm_unpackhi_epi16(low, high))), fv);
    if (j->bf16) { /* packus interleaves the 128-bit halves: the permute puts elements 0-15 back in order */
        const __m256i words = _mm256_packus_epi32(bf16_bits8_avx2(v0), bf16_bits8_avx2(v1));
        _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + i), _mm256_permute4x64_epi64(words, 0xD8));
        return;
    }
    _mm256_storeu_ps((float *)j->out + i, v0);
    _mm256_storeu_ps((float *)j->out + i + 8, v1);
}

/* dequant_block_avx2 with 16 lanes: each byte twice, shifted by 0 and 4, gives the codes in element order, and
 * one permute of the 16 values decodes them. */
AVX512 static void dequant_block_avx512(const Nvfp4Dequant *j, const uint8_t *in, float f, int64_t i) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)in);
    const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)),
                                                             _mm512_set4_epi32(4, 0, 4, 0)),
                                           _mm512_set1_epi32(0x0F));
    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(j->values)), _mm512_set1_ps(f));
    if (j->bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + i), bf16_bits16(v));
    else _mm512_storeu_ps((float *)j->out + i, v);
}
#endif

static void dequant_rows(Nvfp4Dequant *j) {
    const int64_t nb = j->k / NV_BLOCK;
    for (int64_t r = j->row_begin; r < j->row_end; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float f = j->multiplier[j->scale[r * nb + b]];
            const int64_t i = r * j->k + b * NV_BLOCK;
#if defined(__x86_64__)
            if (j->simd >= SIMD_AVX512) { dequant_block_avx512(j, j->data + i / 2, f, i); continue; }
            if (j->simd >= SIMD_AVX2) { dequant_block_avx2(j, j->data + i / 2, f, i); continue; }
#endif
            dequant_block_scalar(j, j->data + i / 2, f, i);
        }
}

static void *run_dequant(void *arg) { dequant_rows((Nvfp4Dequant *)arg); return NULL; }

/* dequantize_nvfp4(data, scale, m, k, values, amax, factor, out, threads, bf16): `values` E2M1's values (16
 * float32 at least), `amax` a float32, `factor` float32(1 / 2688) (or 1 with amax 1: code * scale); out (m, k)
 * float32, or bfloat16 when bf16, k a multiple of 16. */
PyObject *py_dequantize_nvfp4(PyObject *self, PyObject *args) {
    unsigned long long data, scale, values, amax, out;
    long long m, k;
    double factor;
    int threads, bf16;
    if (!PyArg_ParseTuple(args, "KKLLKKdKii", &data, &scale, &m, &k, &values, &amax, &factor, &out, &threads, &bf16))
        return NULL;
    if (m < 0 || k < 0 || k % NV_BLOCK || !values || !amax) {
        PyErr_SetString(PyExc_ValueError, "dequantize_nvfp4: bad shape or table");
        return NULL;
    }
    float multiplier[256]; /* nvfp4_decode_scale's product, in its order */
    for (int c = 0; c < 256; ++c) multiplier[c] = (e4m3_value((uint8_t)c) * *(const float *)amax) * (float)factor;
    Nvfp4Dequant proto = {(const uint8_t *)data, (const uint8_t *)scale, (const float *)values, multiplier,
                          simd_level(), bf16 != 0, k, 0, 0, (void *)out};
    const int64_t t = row_threads(m, m * k, threads);
    Nvfp4Dequant jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    SPLIT_JOBS(jobs, proto, t, m, 1, row_begin, row_end);
    run_jobs(run_dequant, jobs, sizeof(Nvfp4Dequant), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* quantize_nvfp4(in, in_dtype, m, k, tile, factors, rbits, data, scale, col_data, col_scale, threads): `factors`
 * points at the two float32 values S_enc * float32(1/6) and 1 / S_enc; `rbits` is 0 (round to nearest even) or
 * m * k random bytes; tile 1 (1x16 blocks) or 16 (16x16 tiles); m and k multiples of the tile and of 16.
 * col_data, col_scale: 0, or with 16x16 tiles rounded to nearest even, the transpose's form too. */
PyObject *py_quantize_nvfp4(PyObject *self, PyObject *args) {
    unsigned long long in, factors, rbits, data, scale, col_data, col_scale;
    long long m, k;
    int in_dtype, tile, threads;
    if (!PyArg_ParseTuple(args, "KiLLiKKKKKKi", &in, &in_dtype, &m, &k, &tile, &factors, &rbits, &data, &scale,
                          &col_data, &col_scale, &threads))
        return NULL;
    if ((in_dtype != IN_F32 && in_dtype != IN_BF16) || (tile != 1 && tile != NV_BLOCK) || m < 0 || k < 0 ||
        m % tile || k % NV_BLOCK || !factors || (!col_data != !col_scale) ||
        (col_data && (tile != NV_BLOCK || rbits))) {
        PyErr_SetString(PyExc_ValueError, "quantize_nvfp4: bad dtype, tile, shape or columnwise output");
        return NULL;
    }
    Nvfp4Job proto;
    memset(&proto, 0, sizeof proto);
    proto.in = (const void *)in;
    proto.in_dtype = in_dtype;
    proto.tile = tile;
    proto.k = k;
    proto.decode_factor = ((const float *)factors)[0];
    proto.s_dec = ((const float *)factors)[1];
    proto.rbits = (const uint8_t *)rbits;
    proto.data = (uint8_t *)data;
    proto.scale = (uint8_t *)scale;
    proto.col_data = (uint8_t *)col_data;
    proto.col_scale = (uint8_t *)col_scale;
    proto.m = m;
    proto.simd = simd_level();
    const int64_t strips = m / tile, t = row_threads(strips, m * k, threads);
    Nvfp4Job jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    SPLIT_JOBS(jobs, proto, t, strips, tile, row_begin, row_end);
    run_jobs(run_nvfp4, jobs, sizeof(Nvfp4Job), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- The columnwise random Hadamard transform: out (k, m) = the rows of x^T times diag(s) H / 4 in runs of 16 ----
 * Element out[c, 16s + i] is 0.25 * sum_t s_t H[t, i] x[16s + t, c] (H[t, i] = (-1)^popcount(t & i)), the exact
 * sum rounded once to float32 (then to bfloat16 for a bfloat16 x), an exact zero as +0, NaN as 0x7FC00000.
 * The sum runs in double by the fast Walsh-Hadamard butterfly: each term is a float32 value times +-1/4, exact,
 * and every partial sum is exact while the exponents of the run's nonzero values lie within `spread` binades
 * of each other (41 for bfloat16 values: 41 + their 8 significant bits + 4 bits of carry for 16 terms = 53; 25
 * for float32 ones); the one rounding to float32 then rounds the exact sum. A finite run wider than that
 * (a value beside one 2^42 times smaller) takes exact_run_sum instead. A run holding NaN or Inf gives NaN or
 * +-Inf in every output, whatever the order. */
#define RHT_LIMBS 5 /* 320 bits: a float32 significand shifted across its 254 binades, plus the carry of 16 */

/* The float32 nearest (ties to even) to sum_t sign_t x[t], sign_t = +-1/4, for finite x, +0 for an exact zero:
 * the sum as a two's complement integer in units of 2^(e_min - 152), e_min the smallest exponent field
 * (subnormals 1), rounded to odd at 53 bits, which the one rounding to float32 then rounds as the exact sum
 * (53 >= 24 + 2). */
static float exact_run_sum(const float *x, const double *sign) {
    uint32_t bits[NV_BLOCK];
    int e_min = 255;
    for (int t = 0; t < NV_BLOCK; ++t) {
        bits[t] = bits_of(x[t]);
        const int e = (int)(bits[t] >> 23 & 0xFFu);
        if (bits[t] & 0x7FFFFFFFu) e_min = e_min < (e ? e : 1) ? e_min : (e ? e : 1);
    }
    uint64_t acc[RHT_LIMBS] = {0};
    for (int t = 0; t < NV_BLOCK; ++t) {
        if (!(bits[t] & 0x7FFFFFFFu)) continue;
        const int e = (int)(bits[t] >> 23 & 0xFFu), shift = (e ? e : 1) - e_min, r = shift % 64;
        const uint64_t m = (bits[t] & 0x7FFFFFu) | (e ? 0x800000u : 0u);
        uint64_t part[RHT_LIMBS] = {0};
        part[shift / 64] = m << r;
        if (r && shift / 64 + 1 < RHT_LIMBS) part[shift / 64 + 1] = m >> (64 - r);
        const int negative = (int)(bits[t] >> 31) ^ (sign[t] < 0);
        uint64_t carry = 0;
        for (int l = 0; l < RHT_LIMBS; ++l) { /* acc += part, or acc -= part */
            const uint64_t p = part[l], a = acc[l];
            if (negative) {
                const uint64_t d = a - p - carry;
                carry = (a < p) || (a - p < carry);
                acc[l] = d;
            } else {
                const uint64_t s = a + p + carry;
                carry = (s < a) || (carry && s == a);
                acc[l] = s;
            }
        }
    }
    const int negative = (int)(acc[RHT_LIMBS - 1] >> 63);
    if (negative) { /* two's complement: invert and add 1 */
        uint64_t carry = 1;
        for (int l = 0; l < RHT_LIMBS; ++l) { acc[l] = ~acc[l] + carry; carry = carry && acc[l] == 0; }
    }
    int top = RHT_LIMBS - 1;
    while (top >= 0 && !acc[top]) --top;
    if (top < 0) return 0.0f;
    const int msb = 64 * top + 63 - __builtin_clzll(acc[top]), low = msb > 52 ? msb - 52 : 0;
    const int q = low / 64, r = low % 64;
    uint64_t mantissa = acc[q] >> r;
    if (r && q + 1 < RHT_LIMBS) mantissa |= acc[q + 1] << (64 - r);
    mantissa &= (1ull << 53) - 1;
    int sticky = r && (acc[q] & ((1ull << r) - 1)) != 0;
    for (int l = 0; l < q; ++l) sticky |= acc[l] != 0;
    const double d = ldexp((double)(mantissa | (uint64_t)sticky), low + e_min - 152);
    return (float)(negative ? -d : d);
}

/* The fast Walsh-Hadamard transform of v[0..15] in place, v[i] = sum_t (-1)^popcount(t & i) v[t]: four stages of
 * (p, q) -> (p + q, p - q) on elements h apart. Written out, stage by stage, so that the compiler keeps v in
 * registers (its loops left v on the stack). */
#define BUTTERFLY_STAGE(v, h, add, sub) \
    for (int t_ = 0; t_ < NV_BLOCK; ++t_) \
        if (!(t_ & (h))) { \
            const __typeof__(v[0]) p_ = v[t_], q_ = v[t_ + (h)]; \
            v[t_] = add(p_, q_); \
            v[t_ + (h)] = sub(p_, q_); \
        }
#define BUTTERFLY(v, add, sub) \
    do { BUTTERFLY_STAGE(v, 1, add, sub) BUTTERFLY_STAGE(v, 2, add, sub) BUTTERFLY_STAGE(v, 4, add, sub) \
         BUTTERFLY_STAGE(v, 8, add, sub) } while (0)
#define ADD(p, q) ((p) + (q))
#define SUB(p, q) ((p) - (q))

typedef struct {
    const void *in;
    int in_dtype, simd, spread; /* spread: the widest run of exponents the double butterfly sums exactly */
    int64_t m, k, strip_begin, strip_end; /* strips of 16 rows of x */
    double sign[NV_BLOCK];        /* s_t / 4 */
    void *out;                    /* (k, m) in the input's dtype */
    uint32_t in_amax, out_amax;   /* the largest |x| and |out| bits this job saw (NaN above 0x7F800000) */
} RhtJob;

/* The exponent field with subnormals (and zero) as 1, the binade their last bit shares with the smallest normals. */
static inline int binade(uint32_t abs_bits) { const int e = (int)(abs_bits >> 23); return e ? e : 1; }

/* An output from its double sum: rounded to float32, +0 for a zero (x + 0 changes no other value), NaN canonical. */
static inline float rht_round(double sum) {
    const float f = (float)sum + 0.0f;
    return f == f ? f : float_of(0x7FC00000u);
}

/* Stores 16 float32 outputs at element offset i of out (bfloat16 when the input is) and returns the largest of
 * their |value| bits as stored. */
static inline uint32_t rht_store(const RhtJob *j, const float *y, int64_t i) {
    uint32_t top = 0;
    for (int t = 0; t < NV_BLOCK; ++t) {
        uint32_t a;
        if (j->in_dtype == IN_BF16) {
            const uint16_t b = bf16_bits(y[t]);
            ((uint16_t *)j->out)[i + t] = b;
            a = (uint32_t)(b & 0x7FFFu) << 16;
        } else {
            ((float *)j->out)[i + t] = y[t];
            a = bits_of(y[t]) & 0x7FFFFFFFu;
        }
        top = a > top ? a : top;
    }
    return top;
}

/* Column c of strip s, one element at a time. */
static void rht_column_scalar(RhtJob *j, int64_t s, int64_t c) {
    float x[NV_BLOCK], y[NV_BLOCK];
    uint32_t top = 0, bottom = 0xFFFFFFFFu; /* the largest |x| bits, the smallest nonzero ones */
    for (int t = 0; t < NV_BLOCK; ++t) {
        x[t] = input_value(j->in, j->in_dtype, (NV_BLOCK * s + t) * j->k + c);
        const uint32_t a = bits_of(x[t]) & 0x7FFFFFFFu;
        top = a > top ? a : top;
        if (a) bottom = a < bottom ? a : bottom;
    }
    j->in_amax = top > j->in_amax ? top : j->in_amax;
    if (top < 0x7F800000u && bottom != 0xFFFFFFFFu && binade(top) - binade(bottom) > j->spread) {
        double sign[NV_BLOCK];
        for (int i = 0; i < NV_BLOCK; ++i) {
            for (int t = 0; t < NV_BLOCK; ++t) sign[t] = __builtin_popcount(t & i) % 2 ? -j->sign[t] : j->sign[t];
            y[i] = exact_run_sum(x, sign);
        }
    } else {
        double v[NV_BLOCK];
        for (int t = 0; t < NV_BLOCK; ++t) v[t] = (double)x[t] * j->sign[t];
        BUTTERFLY(v, ADD, SUB);
        for (int i = 0; i < NV_BLOCK; ++i) y[i] = rht_round(v[i]);
    }
    const uint32_t top_out = rht_store(j, y, c * j->m + NV_BLOCK * s);
    j->out_amax = top_out > j->out_amax ? top_out : j->out_amax;
}

#if defined(__x86_64__)
/* Columns c..c+3 of strip s, the butterfly on 4 columns a vector; 0 (nothing done) when a column's run is too
 * wide for it (rht_column_scalar then takes them). */
__attribute__((target("avx2"))) static int rht_columns4_avx2(RhtJob *j, int64_t s, int64_t c) {
    const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF), none = _mm_set1_epi32(-1), one = _mm_set1_epi32(1);
    __m256d v[NV_BLOCK];
    __m128i top = _mm_setzero_si128(), bottom = none;
    for (int t = 0; t < NV_BLOCK; ++t) {
        const int64_t i = (NV_BLOCK * s + t) * j->k + c;
        const __m128 x = j->in_dtype == IN_F32
            ? _mm_loadu_ps((const float *)j->in + i)
            : _mm_castsi128_ps(_mm_slli_epi32(
                  _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)((const uint16_t *)j->in + i))), 16));
        const __m128i a = _mm_and_si128(_mm_castps_si128(x), abs_mask);
        top = _mm_max_epi32(top, a);
        bottom = _mm_min_epu32(bottom, _mm_or_si128(a, _mm_cmpeq_epi32(a, _mm_setzero_si128())));
        v[t] = _mm256_mul_pd(_mm256_cvtps_pd(x), _mm256_set1_pd(j->sign[t]));
    }
    const __m128i width = _mm_sub_epi32(_mm_max_epi32(_mm_srli_epi32(top, 23), one),
                                        _mm_max_epi32(_mm_srli_epi32(bottom, 23), one)); /* none: 1 - 511 */
    const __m128i wide = _mm_and_si128(_mm_cmpgt_epi32(_mm_set1_epi32(0x7F800000), top),
                                       _mm_cmpgt_epi32(width, _mm_set1_epi32(j->spread)));
    if (_mm_movemask_epi8(wide)) return 0;
    top = _mm_max_epi32(top, _mm_shuffle_epi32(top, _MM_SHUFFLE(1, 0, 3, 2)));
    top = _mm_max_epi32(top, _mm_shuffle_epi32(top, _MM_SHUFFLE(2, 3, 0, 1)));
    const uint32_t in_top = (uint32_t)_mm_cvtsi128_si32(top);
    j->in_amax = in_top > j->in_amax ? in_top : j->in_amax;
    BUTTERFLY(v, _mm256_add_pd, _mm256_sub_pd);
    __m128 y[NV_BLOCK];
    for (int i = 0; i < NV_BLOCK; ++i) {
        const __m128 f = _mm_add_ps(_mm256_cvtpd_ps(v[i]), _mm_setzero_ps());
        y[i] = _mm_blendv_ps(f, _mm_castsi128_ps(_mm_set1_epi32(0x7FC00000)), _mm_cmpunord_ps(f, f));
    }
    for (int g = 0; g < NV_BLOCK; g += 4) _MM_TRANSPOSE4_PS(y[g], y[g + 1], y[g + 2], y[g + 3]);
    /* y[g + l] now holds outputs g..g+3 of column c + l */
    __m256i out_top = _mm256_setzero_si256();
    for (int l = 0; l < 4; ++l) {
        const int64_t i = (c + l) * j->m + NV_BLOCK * s;
        const __m256 v0 = _mm256_set_m128(y[4 + l], y[l]), v1 = _mm256_set_m128(y[12 + l], y[8 + l]);
        if (j->in_dtype == IN_F32) {
            _mm256_storeu_ps((float *)j->out + i, v0);
            _mm256_storeu_ps((float *)j->out + i + 8, v1);
            const __m256i abs8 = _mm256_set1_epi32(0x7FFFFFFF);
            out_top = _mm256_max_epi32(out_top, _mm256_and_si256(_mm256_castps_si256(v0), abs8));
            out_top = _mm256_max_epi32(out_top, _mm256_and_si256(_mm256_castps_si256(v1), abs8));
            continue;
        }
        const __m256i r0 = bf16_bits8_avx2(v0), r1 = bf16_bits8_avx2(v1), magnitude = _mm256_set1_epi32(0x7FFF);
        _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + i),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8)); /* halves back in order */
        out_top = _mm256_max_epi32(out_top, _mm256_slli_epi32(_mm256_and_si256(r0, magnitude), 16));
        out_top = _mm256_max_epi32(out_top, _mm256_slli_epi32(_mm256_and_si256(r1, magnitude), 16));
    }
    const uint32_t out_max = hmax_avx2(out_top);
    j->out_amax = out_max > j->out_amax ? out_max : j->out_amax;
    return 1;
}

/* Transposes the 8x8 float32 matrix r (rows r[0..7]) in place. */
__attribute__((target("avx2"))) static inline void transpose8_avx2(__m256 *r) {
    __m256 t[8], u[8];
    for (int p = 0; p < 8; p += 2) {
        t[p] = _mm256_unpacklo_ps(r[p], r[p + 1]);
        t[p + 1] = _mm256_unpackhi_ps(r[p], r[p + 1]);
    }
    for (int p = 0; p < 8; p += 4) {
        u[p] = _mm256_shuffle_ps(t[p], t[p + 2], 0x44);
        u[p + 1] = _mm256_shuffle_ps(t[p], t[p + 2], 0xEE);
        u[p + 2] = _mm256_shuffle_ps(t[p + 1], t[p + 3], 0x44);
        u[p + 3] = _mm256_shuffle_ps(t[p + 1], t[p + 3], 0xEE);
    }
    for (int p = 0; p < 4; ++p) {
        r[p] = _mm256_permute2f128_ps(u[p], u[p + 4], 0x20);
        r[p + 4] = _mm256_permute2f128_ps(u[p], u[p + 4], 0x31);
    }
}

/* Transposes the 8x8 matrix of 16-bit words r (rows r[0..7]) in place. */
static inline __m128i unpack(__m128i a, __m128i b, int width, int high) {
    switch (width) {
    case 16: return high ? _mm_unpackhi_epi16(a, b) : _mm_unpacklo_epi16(a, b);
    case 32: return high ? _mm_unpackhi_epi32(a, b) : _mm_unpacklo_epi32(a, b);
    default: return high ? _mm_unpackhi_epi64(a, b) : _mm_unpacklo_epi64(a, b);
    }
}

static inline void transpose8_epi16(__m128i *r) {
    __m128i b[8], c[8];
    for (int p = 0; p < 4; ++p) { /* b: rows 2q, 2q + 1 interleaved; low halves in b[q], high in b[q + 4] */
        b[p] = unpack(r[2 * p], r[2 * p + 1], 16, 0);
        b[p + 4] = unpack(r[2 * p], r[2 * p + 1], 16, 1);
    }
    for (int h = 0; h < 8; h += 4) /* c: columns 2q, 2q + 1 of rows 0-3 (c[h + q]) and 4-7 (c[h + q + 2]) */
        for (int q = 0; q < 2; ++q) {
            c[h + 2 * q] = unpack(b[h], b[h + 1], 32, q);
            c[h + 2 * q + 1] = unpack(b[h + 2], b[h + 3], 32, q);
        }
    for (int q = 0; q < 4; ++q) {
        r[2 * q] = unpack(c[2 * q], c[2 * q + 1], 64, 0);
        r[2 * q + 1] = unpack(c[2 * q], c[2 * q + 1], 64, 1);
    }
}

/* rht_columns4_avx2 on 8 columns c..c+7, with AVX-512's 8 doubles a vector. */
AVX512 static int rht_columns8_avx512(RhtJob *j, int64_t s, int64_t c) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), one = _mm256_set1_epi32(1);
    __m512d v[NV_BLOCK];
    __m256i top = _mm256_setzero_si256(), bottom = _mm256_set1_epi32(-1);
    for (int t = 0; t < NV_BLOCK; ++t) {
        const __m256 x = load8_avx2(j->in, j->in_dtype, (NV_BLOCK * s + t) * j->k + c);
        const __m256i a = _mm256_and_si256(_mm256_castps_si256(x), abs_mask);
        top = _mm256_max_epi32(top, a);
        bottom = _mm256_min_epu32(bottom, _mm256_or_si256(a, _mm256_cmpeq_epi32(a, _mm256_setzero_si256())));
        v[t] = _mm512_mul_pd(_mm512_cvtps_pd(x), _mm512_set1_pd(j->sign[t]));
    }
    const __m256i width = _mm256_sub_epi32(_mm256_max_epi32(_mm256_srli_epi32(top, 23), one),
                                           _mm256_max_epi32(_mm256_srli_epi32(bottom, 23), one));
    if (_mm256_cmpgt_epi32_mask(_mm256_set1_epi32(0x7F800000), top) &
        _mm256_cmpgt_epi32_mask(width, _mm256_set1_epi32(j->spread)))
        return 0;
    const uint32_t in_top = hmax_avx2(top);
    j->in_amax = in_top > j->in_amax ? in_top : j->in_amax;
    BUTTERFLY(v, _mm512_add_pd, _mm512_sub_pd);
    __m256 y[NV_BLOCK];
    __m256i out_top = _mm256_setzero_si256();
    for (int i = 0; i < NV_BLOCK; ++i) {
        const __m256 f = _mm256_add_ps(_mm512_cvtpd_ps(v[i]), _mm256_setzero_ps());
        y[i] = _mm256_mask_mov_ps(f, _mm256_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                  _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
    }
    if (j->in_dtype == IN_F32) {
        transpose8_avx2(y); /* y[l] (l < 8): outputs 0-7 of column c + l; y[8 + l]: outputs 8-15 */
        transpose8_avx2(y + 8);
        for (int l = 0; l < 8; ++l) {
            float *out = (float *)j->out + (c + l) * j->m + NV_BLOCK * s;
            _mm256_storeu_ps(out, y[l]);
            _mm256_storeu_ps(out + 8, y[8 + l]);
            out_top = _mm256_max_epi32(out_top, _mm256_and_si256(_mm256_castps_si256(y[l]), abs_mask));
            out_top = _mm256_max_epi32(out_top, _mm256_and_si256(_mm256_castps_si256(y[8 + l]), abs_mask));
        }
    } else {
        __m128i w[NV_BLOCK]; /* the bfloat16 words of outputs i, columns c..c+7 */
        __m256i top_words = _mm256_setzero_si256();
        for (int i = 0; i < NV_BLOCK; i += 2) {
            const __m256i words = bf16_bits16(_mm512_insertf32x8(_mm512_castps256_ps512(y[i]), y[i + 1], 1));
            top_words = _mm256_max_epu16(top_words, _mm256_and_si256(words, _mm256_set1_epi16(0x7FFF)));
            w[i] = _mm256_castsi256_si128(words);
            w[i + 1] = _mm256_extracti128_si256(words, 1);
        }
        out_top = _mm256_slli_epi32(_mm256_max_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(top_words)),
                                                     _mm256_cvtepu16_epi32(_mm256_extracti128_si256(top_words, 1))),
                                    16);
        transpose8_epi16(w);
        transpose8_epi16(w + 8);
        for (int l = 0; l < 8; ++l)
            _mm256_storeu_si256((__m256i *)((uint16_t *)j->out + (c + l) * j->m + NV_BLOCK * s),
                                _mm256_set_m128i(w[8 + l], w[l]));
    }
    const uint32_t out_max = hmax_avx2(out_top);
    j->out_amax = out_max > j->out_amax ? out_max : j->out_amax;
    return 1;
}
#endif

/* Strips [strip_begin, strip_end) two at a time, column block by column block: the two strips' outputs fill
 * whole cache lines of a bfloat16 out row (64 bytes) together, while the line is still in L1. */
static void rht_strips(RhtJob *j) {
    for (int64_t s0 = j->strip_begin; s0 < j->strip_end; s0 += 2) {
        const int64_t s1 = s0 + 2 < j->strip_end ? s0 + 2 : j->strip_end;
        int64_t c = 0;
#if defined(__x86_64__)
        if (j->simd >= SIMD_AVX512)
            for (; c + 8 <= j->k; c += 8)
                for (int64_t s = s0; s < s1; ++s)
                    if (!rht_columns8_avx512(j, s, c))
                        for (int l = 0; l < 8; ++l) rht_column_scalar(j, s, c + l);
        if (j->simd >= SIMD_AVX2)
            for (; c + 4 <= j->k; c += 4)
                for (int64_t s = s0; s < s1; ++s)
                    if (!rht_columns4_avx2(j, s, c))
                        for (int l = 0; l < 4; ++l) rht_column_scalar(j, s, c + l);
#endif
        for (; c < j->k; ++c)
            for (int64_t s = s0; s < s1; ++s) rht_column_scalar(j, s, c);
    }
}

static void *run_rht(void *arg) { rht_strips((RhtJob *)arg); return NULL; }

/* hadamard_columns(in, in_dtype, m, k, sign_mask, out, out_amax, in_amax, threads): out (k, m), in x's dtype, the
 * transform of xᵀ's rows in runs of 16 with the signs of sign_mask (bit t set: s_t = -1); *out_amax = max |out|,
 * *in_amax = max |x| (float32, NaN when there is one); m a multiple of 16. */
PyObject *py_hadamard_columns(PyObject *self, PyObject *args) {
    unsigned long long in, out, out_amax_ptr, in_amax_ptr;
    long long m, k;
    int in_dtype, sign_mask, threads;
    if (!PyArg_ParseTuple(args, "KiLLiKKKi", &in, &in_dtype, &m, &k, &sign_mask, &out, &out_amax_ptr, &in_amax_ptr,
                          &threads))
        return NULL;
    if ((in_dtype != IN_F32 && in_dtype != IN_BF16) || m < 0 || k < 0 || m % NV_BLOCK || !out_amax_ptr ||
        !in_amax_ptr) {
        PyErr_SetString(PyExc_ValueError, "hadamard_columns: bad dtype or shape");
        return NULL;
    }
    RhtJob proto;
    memset(&proto, 0, sizeof proto);
    proto.in = (const void *)in;
    proto.in_dtype = in_dtype;
    proto.spread = in_dtype == IN_BF16 ? 41 : 25;
    proto.m = m;
    proto.k = k;
    proto.out = (void *)out;
    for (int t = 0; t < NV_BLOCK; ++t) proto.sign[t] = sign_mask >> t & 1 ? -0.25 : 0.25;
    proto.simd = simd_level();
    const int64_t strips = m / NV_BLOCK, t = row_threads(strips, m * k, threads);
    RhtJob jobs[MAX_THREADS];
    uint32_t out_amax = 0, in_amax = 0;
    Py_BEGIN_ALLOW_THREADS
    SPLIT_JOBS(jobs, proto, t, strips, 1, strip_begin, strip_end);
    run_jobs(run_rht, jobs, sizeof(RhtJob), t);
    for (int64_t i = 0; i < t; ++i) {
        out_amax = jobs[i].out_amax > out_amax ? jobs[i].out_amax : out_amax;
        in_amax = jobs[i].in_amax > in_amax ? jobs[i].in_amax : in_amax;
    }
    Py_END_ALLOW_THREADS
    *(float *)out_amax_ptr = float_of(out_amax);
    *(float *)in_amax_ptr = float_of(in_amax);
    Py_RETURN_NONE;
}
