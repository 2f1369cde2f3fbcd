/* NVFP4 quantize (quantize_nvfp4) and dequantize (dequantize_nvfp4), TransformerEngine's rules as
 * mindspeed_te.fp4 has them (nvfp4_block_scales, e2m1_encode, nvfp4_decode_scale), in the same float32 operations.
 *
 * The quantize makes one form of a 2-D float32 / bfloat16 tensor: blocks of 16 along its rows (or 16x16 tiles),
 * per block decode = amax * (S_enc / 6) clamped to 448, scale = E4M3(decode), encode = min(1 / (scale * S_dec),
 * FLT_MAX), codes = E2M1(x * encode) rounded to nearest even or stochastically with the caller's random bytes,
 * packed two a byte. The dequantize reads the packed codes and E4M3 scales: code * ((scale * amax) * 1 / 2688), as
 * float32 or bfloat16.
 * Scalar and AVX2 loops, chosen at run time, give the same bits. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"

#include <stdint.h>
#include <string.h>

#define NV_BLOCK 16
#define NV_CHUNK 256 /* blocks of a strip of 16x16 tiles handled at a time (their scales on the stack) */

typedef struct {
    const void *in;
    int in_dtype, tile, avx2;
    int64_t k, row_begin, row_end;
    float decode_factor, s_dec; /* S_enc * float32(1/6), 1 / S_enc */
    const uint8_t *rbits;       /* one random byte per element (row-major), or NULL: round to nearest even */
    uint8_t *data, *scale;      /* packed codes (m, k / 2), E4M3 scale bytes (m, k / 16) */
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

/* sr_e2m1 of 8 lanes, the random bytes at r. */
__attribute__((target("avx2"))) static inline __m256i sr_codes_avx2(__m256 q, const uint8_t *r) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 a = _mm256_andnot_ps(sign, q);
    const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)r))),
                                   _mm256_set1_ps(1.0f / 256.0f));
    const __m256 t = _mm256_add_ps(a, _mm256_mul_ps(u, grid_step_avx2(a))), step = grid_step_avx2(t);
    const __m256 g = _mm256_mul_ps(_mm256_floor_ps(_mm256_div_ps(t, step)), step);
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

__attribute__((target("avx2"))) static void block_codes_avx2(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
    const __m256 fv = _mm256_set1_ps(f);
    const __m256 q0 = _mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i), fv);
    const __m256 q1 = _mm256_mul_ps(load8_avx2(j->in, j->in_dtype, i + 8), fv);
    if (j->rbits)
        store_packed_avx2(out, sr_codes_avx2(q0, j->rbits + i), sr_codes_avx2(q1, j->rbits + i + 8));
    else
        store_packed_avx2(out, e2m1_codes_avx2(q0), e2m1_codes_avx2(q1));
}
#endif

static inline uint32_t block_amax(const Nvfp4Job *j, int64_t i) {
#if defined(__x86_64__)
    if (j->avx2) return block_amax_avx2(j, i);
#endif
    return block_amax_scalar(j, i);
}

static inline void block_codes(const Nvfp4Job *j, int64_t i, float f, uint8_t *out) {
#if defined(__x86_64__)
    if (j->avx2) { block_codes_avx2(j, i, f, out); return; }
#endif
    block_codes_scalar(j, i, f, out);
}

/* Rows [row_begin, row_end): 1x16 blocks each read once, or strips of 16 rows in 16x16 tiles (the tile's amax
 * first, then its rows' codes; every row stores the tile's scale). */
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
            for (int64_t b = b0; b < b1; ++b) f[b - b0] = block_encode(j, amax[b - b0], &s[b - b0]);
            for (int64_t r = r0; r < r0 + j->tile; ++r) {
                memcpy(j->scale + r * nb + b0, s, (size_t)(b1 - b0));
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
    const float *values; /* E2M1's 16 values (the first entries of a 256-value table) */
    float amax, factor;
    int avx2, bf16;      /* bf16: the products rounded to bfloat16 (bf16_bits), else float32 */
    int64_t k, row_begin, row_end;
    void *out;
} Nvfp4Dequant;

/* A block's multiplier, in nvfp4_decode_scale's order. */
static inline float block_multiplier(const Nvfp4Dequant *j, uint8_t scale) {
    return (e4m3_value(scale) * j->amax) * j->factor;
}

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
#endif

static void dequant_rows(Nvfp4Dequant *j) {
    const int64_t nb = j->k / NV_BLOCK;
    for (int64_t r = j->row_begin; r < j->row_end; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float f = block_multiplier(j, j->scale[r * nb + b]);
            const int64_t i = r * j->k + b * NV_BLOCK;
#if defined(__x86_64__)
            if (j->avx2) { dequant_block_avx2(j, j->data + i / 2, f, i); continue; }
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
    Nvfp4Dequant proto = {(const uint8_t *)data, (const uint8_t *)scale, (const float *)values,
                          *(const float *)amax, (float)factor, 0, bf16 != 0, k, 0, 0, (void *)out};
#if defined(__x86_64__)
    proto.avx2 = has_avx2();
#endif
    const int64_t t = row_threads(m, m * k, threads);
    Nvfp4Dequant jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (m + t - 1) / t;
    for (int64_t i = 0; i < t; ++i) {
        jobs[i] = proto;
        jobs[i].row_begin = i * step < m ? i * step : m;
        jobs[i].row_end = (i + 1) * step < m ? (i + 1) * step : m;
    }
    run_jobs(run_dequant, jobs, sizeof(Nvfp4Dequant), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* quantize_nvfp4(in, in_dtype, m, k, tile, factors, rbits, data, scale, threads): `factors` points at the two
 * float32 values S_enc * float32(1/6) and 1 / S_enc; `rbits` is 0 (round to nearest even) or m * k random bytes;
 * tile 1 (1x16 blocks) or 16 (16x16 tiles); m and k multiples of the tile and of 16. */
PyObject *py_quantize_nvfp4(PyObject *self, PyObject *args) {
    unsigned long long in, factors, rbits, data, scale;
    long long m, k;
    int in_dtype, tile, threads;
    if (!PyArg_ParseTuple(args, "KiLLiKKKKi", &in, &in_dtype, &m, &k, &tile, &factors, &rbits, &data, &scale,
                          &threads))
        return NULL;
    if ((in_dtype != IN_F32 && in_dtype != IN_BF16) || (tile != 1 && tile != NV_BLOCK) || m < 0 || k < 0 ||
        m % tile || k % NV_BLOCK || !factors) {
        PyErr_SetString(PyExc_ValueError, "quantize_nvfp4: bad dtype, tile or shape");
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
#if defined(__x86_64__)
    proto.avx2 = has_avx2();
#endif
    const int64_t strips = m / tile, t = row_threads(strips, m * k, threads);
    Nvfp4Job jobs[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    const int64_t step = (strips + t - 1) / t;
    for (int64_t i = 0; i < t; ++i) {
        jobs[i] = proto;
        jobs[i].row_begin = (i * step < strips ? i * step : strips) * tile;
        jobs[i].row_end = ((i + 1) * step < strips ? (i + 1) * step : strips) * tile;
    }
    run_jobs(run_nvfp4, jobs, sizeof(Nvfp4Job), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
