/* Block scaling (1xB / 128x128 tiles) and MX (1x32 blocks, E8M0 scales): quantize_tiles, with the strip and
 * chunk walk and its scalar and AVX2 loops (the AVX-512 tiles are in tiles_avx512.c).
 *
 * One call quantizes the rowwise layout (blocks along the last dim) and, when asked, the columnwise one
 * (blocks of the 2-D transpose, i.e. along the first dim). The input is walked in strips of rows, each strip
 * in chunks of columns that fit in L2 (tile_range): both layouts are made from a chunk while it is in cache,
 * so main memory is read once. Amax and E4M3/E5M2 casts run 8 lanes wide with AVX2 when the CPU has it (scalar
 * loops otherwise, and for HiF8's table encode); with AVX-512 the E4M3/E5M2 quantizes take the tiles of
 * tiles_avx512.c instead (the code chosen at run time: simd_level). The block scale rules
 * are those of mindspeed_te.scaling (current_scale_inv for blockwise, mx_scale_exponent for MX);
 * power-of-two scales are applied as a multiplication by 2^-e, which rounds exactly as the division by 2^e
 * does. */
#include "kernels.h"

#include "codecs.h"
#include "codecs_x86.h"
#include "tiles.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 128 /* columns per pass of the columnwise loops (their code tile: STRIP_ROWS x CHUNK bytes) */
#define MAX_BLOCK 128
#define MAX_CHUNK 4096 /* columns per chunk at most */
#define STRIP_BLOCKS 16 /* blocks of rows per strip at most */
#define STRIP_ROWS 256
#define TILE_BYTES (1 << 20) /* input bytes per chunk: half of a core's L2 on current x86 */

static inline int64_t at(const TileJob *j, int64_t r, int64_t c) { return (r - j->r_org) * j->ld + c - j->c_org; }

static inline float load_elem(const TileJob *j, int64_t i) { return input_value(j->in, j->in_dtype, i); }

static inline uint8_t encode(const TileJob *j, float q) {
    return j->out_format == OUT_E4M3   ? to_e4m3(q)
           : j->out_format == OUT_E5M2 ? to_e5m2(q)
           : j->out_format == OUT_E2M1 ? to_e2m1(q)
                                       : to_hif8(j->table, q);
}

static inline uint32_t abs_bits(const TileJob *j, int64_t i) { return input_abs_bits(j->in, j->in_dtype, i); }

/* 2^e for -127 <= e <= 127 (2^-127 is a float32 subnormal). */
static inline float exp2_int(int e) { return e > -127 ? float_of((uint32_t)(e + 127) << 23) : float_of(0x00400000u); }

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
    return j->out_format == OUT_E4M3   ? fp8_codes_avx2(q, 3, 121, 0x43E00000, 0x00100000)
           : j->out_format == OUT_E2M1 ? e2m1_codes_avx2(q)
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

PyObject *py_quantize_tiles(PyObject *self, PyObject *args) {
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
    /* E2M1 (one code per byte, packed by the caller) in the MX modes only, on the scalar and AVX2 loops. */
    const int e2m1 = proto.out_format == OUT_E2M1;
    if (!check_formats(proto.in_dtype, e2m1 ? OUT_E4M3 : proto.out_format, table, m * k) || m < 0 || k < 0 ||
        proto.block < 1 || proto.block > MAX_BLOCK || (proto.tile_rows != 1 && proto.tile_rows != proto.block) ||
        proto.mode < MODE_BLOCK || proto.mode > MODE_MX_FLOOR || (proto.mode != MODE_BLOCK && proto.out_format == OUT_HIF8) ||
        (e2m1 && proto.mode == MODE_BLOCK)) {
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
    proto.avx512 = simd_level() >= SIMD_AVX512 && proto.out_format != OUT_HIF8 && !e2m1 && T512 % proto.block == 0 &&
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
    SPLIT_JOBS(jobs, proto, t, strips, 1, strip_begin, strip_end);
    int64_t next_strip = 0;
    for (int64_t i = 0; i < t; ++i) {
#if defined(__x86_64__)
        if (work) jobs[i].work = work + i * sizeof(Tile512);
#endif
        if (proto.avx512) jobs[i].next_strip = &next_strip, jobs[i].strip_end = strips;
    }
    run_jobs(run_tile, jobs, sizeof(TileJob), t);
    Py_END_ALLOW_THREADS
    free(work);
    Py_RETURN_NONE;
}
