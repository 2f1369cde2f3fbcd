/* The AVX-512 tiles of the block-scaling quantize (E4M3 / E5M2 out, block dividing 128, multiple of 16), which
 * tiles.c hands a job through tile_range_avx512.
 *
 * A strip of 128 rows is walked in tiles of 128 x 128 elements, each holding whole blocks of both layouts.
 * Pass 1 reads the tile from memory once: a float32 copy into a contiguous buffer (L2; the tensor's rows
 * are often a power of two apart and would evict each other), the rowwise block maxima and the column
 * maxima. The scales of all the tile's blocks are then computed 16 at a time, and pass 2 casts the buffer:
 * rowwise codes straight to the output, columnwise codes into a byte tile that is transposed in registers
 * (16 x 16 bytes in each 128-bit lane) into the (K, M) output. Pass 1 waits on memory and pass 2 on the
 * vector units, so pass 2 prefetches the next tile. Same arithmetic as the scalar code (the tests compare
 * every path with the torch ops), 16 lanes at a time. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"
#include "tiles.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#define PREFETCH_ROWS 8 /* rows ahead: the tile's short row segments do not wake the hardware prefetcher */

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
void tile_range_avx512(TileJob *j) {
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
