/* What the block-scaling quantize (quantize_tiles) shares between its two files: the job, the scale modes, the
 * MX exponent's log2, and the AVX-512 tiles' size, work space and entry point. tiles.c walks the input in strips
 * and chunks with scalar / AVX2 loops, or hands each job to tiles_avx512.c when the CPU and the block allow. */
#ifndef MINDSPEED_TE_TILES_H
#define MINDSPEED_TE_TILES_H

#include "kernels.h"

#include "codecs.h"

#include <stdint.h>

enum { MODE_BLOCK = 0, MODE_MX_CEIL = 1, MODE_MX_FLOOR = 2 };

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

#if defined(__x86_64__)
#define T512 128 /* rows and columns of a tile */
/* From this many elements on the codes are written with streaming stores: an output of several MiB leaves
 * the caches anyway, and a normal store first reads the line it writes, a third more memory traffic. */
#define STREAM_MIN_ELEMENTS (1 << 22)

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

/* The AVX-512 tiles' tile_range (tiles_avx512.c): strips of 128 rows from j->next_strip, tiles of 128 columns. */
#pragma GCC visibility push(hidden)
void tile_range_avx512(TileJob *j);
#pragma GCC visibility pop
#endif

#endif
