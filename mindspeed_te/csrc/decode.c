/* Codes to values: the per-tensor decode (decode) and the dequantize of block-scaled data (dequantize_tiles),
 * both through the 256-entry table of the format's values: 8 codes a gather with AVX2, 64 codes by byte
 * permutes with AVX-512 VBMI (decode_vbmi), one code at a time otherwise. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"

#include <stdint.h>

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

PyObject *py_decode(PyObject *self, PyObject *args) {
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

PyObject *py_dequantize_tiles(PyObject *self, PyObject *args) {
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
                               k, scale_cols, rows, cols, job_start(i, step, m),
                               job_start(i + 1, step, m), e8m0, bf16 != 0, have_planes, shifts};
    }
    run_jobs(run_dequant, jobs, sizeof(DequantJob), t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
