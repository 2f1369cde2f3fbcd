/* What the extension's C files share. One module, mindspeed_te._fused_cast, is built from all of them (setup.py):
 * the per-tensor job and the thread runner (threads.c), the vector code the CPU runs (simd.c), the check of the
 * dtype and format codes (cast.c) and the entry points the method table lists (module.c), the bfloat16 GEMM's
 * among them (gemm_bf16.c). The codecs are in codecs.h (scalar) and codecs_x86.h (AVX2 / AVX-512), the
 * block-scaling job in tiles.h. */
#ifndef MINDSPEED_TE_KERNELS_H
#define MINDSPEED_TE_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 64
#define MIN_PER_THREAD (1 << 16)

/* Compilers that know AVX-512 BF16 (GCC 10, clang 9 on), unless the build turns it off (setup.py does when the
 * toolchain cannot assemble it): without it gemm_bf16 reports itself unsupported. */
#if !defined(MINDSPEED_TE_NO_AVX512BF16) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define MINDSPEED_HAVE_AVX512BF16 1
#endif

/* Everything below is internal to the module: hidden, so that the module exports PyInit__fused_cast alone and
 * the calls between its files bind to these definitions (as the calls to a static function did). */
#pragma GCC visibility push(hidden)

/* ---- threads.c ---- */
/* A per-tensor job: the range [begin, end) of one amax, cast (cast.c) or decode (decode.c) pass. */
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
typedef void (*RangeFn)(Job *);

/* Runs worker on each of the t jobs (job_size bytes apart) and returns when all are done. */
void run_jobs(void *(*worker)(void *), void *jobs, size_t job_size, int64_t t);
/* Runs fn over [0, n) split into jobs of proto on up to `threads` threads; *used: the jobs filled. */
void parallel(RangeFn fn, const Job *proto, int64_t n, int threads, Job *jobs, int *used);
/* Threads for a job split by rows: one per MIN_PER_THREAD elements, at most `threads`, `m` and MAX_THREADS. */
int64_t row_threads(int64_t m, int64_t numel, int threads);
/* Where job i starts when [0, n) is cut into ranges of `step` (n once past the end): job i covers
 * [job_start(i, step, n), job_start(i + 1, step, n)). */
static inline int64_t job_start(int64_t i, int64_t step, int64_t n) { return i * step < n ? i * step : n; }
/* jobs[0..t) as copies of proto, job i given rows [job_start(i), job_start(i + 1)) of [0, n) cut into t ranges,
 * times `unit`, in its fields `begin` and `end`. */
#define SPLIT_JOBS(jobs, proto, t, n, unit, begin, end)                              \
    do {                                                                             \
        const int64_t split_step_ = ((n) + (t) - 1) / (t);                           \
        for (int64_t i_ = 0; i_ < (t); ++i_) {                                       \
            (jobs)[i_] = (proto);                                                    \
            (jobs)[i_].begin = job_start(i_, split_step_, (n)) * (unit);             \
            (jobs)[i_].end = job_start(i_ + 1, split_step_, (n)) * (unit);           \
        }                                                                            \
    } while (0)

/* ---- simd.c ---- */
/* The vector code a CPU runs: the widest it has, at most the limit set_simd sets. */
enum { SIMD_NONE = 0, SIMD_AVX2 = 1, SIMD_AVX512 = 2 };
int simd_level(void);
#if defined(__x86_64__)
int has_avx2(void);
#endif
PyObject *py_set_simd(PyObject *self, PyObject *args);

/* ---- cast.c ---- */
/* Whether the dtype, format, table and size are valid; else 0 with a ValueError set. */
int check_formats(int in_dtype, int out_format, unsigned long long table, long long n);
PyObject *py_scaled_cast(PyObject *self, PyObject *args);
PyObject *py_amax(PyObject *self, PyObject *args);
PyObject *py_current_scale_inv(PyObject *self, PyObject *args);
PyObject *py_quantize(PyObject *self, PyObject *args);

/* ---- decode.c ---- */
PyObject *py_decode(PyObject *self, PyObject *args);
PyObject *py_dequantize_tiles(PyObject *self, PyObject *args);

/* ---- tiles.c ---- */
PyObject *py_quantize_tiles(PyObject *self, PyObject *args);

PyObject *py_nibbles(PyObject *self, PyObject *args);

/* ---- nvfp4.c ---- */
PyObject *py_quantize_nvfp4(PyObject *self, PyObject *args);
PyObject *py_dequantize_nvfp4(PyObject *self, PyObject *args);
PyObject *py_hadamard_columns(PyObject *self, PyObject *args);

/* ---- epilogue.c ---- */
PyObject *py_gemm_epilogue(PyObject *self, PyObject *args);

/* ---- gemm_bf16.c ---- */
/* Whether this CPU (and build) runs gemm_bf16. */
int gemm_bf16_supported(void);
PyObject *py_gemm_bf16(PyObject *self, PyObject *args);

#pragma GCC visibility pop

#endif
