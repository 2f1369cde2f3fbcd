/* What the extension's C files share: the thread runner (fused_cast.c) and the bfloat16 GEMM (gemm_bf16.c). */
#ifndef MINDSPEED_TE_KERNELS_H
#define MINDSPEED_TE_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 64

/* Compilers that know AVX-512 BF16 (GCC 10, clang 9 on), unless the build turns it off (setup.py does when the
 * toolchain cannot assemble it): without it gemm_bf16 reports itself unsupported. */
#if !defined(MINDSPEED_TE_NO_AVX512BF16) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define MINDSPEED_HAVE_AVX512BF16 1
#endif

/* Runs worker on each of the t jobs (job_size bytes apart) and returns when all are done. */
void run_jobs(void *(*worker)(void *), void *jobs, size_t job_size, int64_t t);

/* Whether this CPU (and build) runs gemm_bf16. */
int gemm_bf16_supported(void);
PyObject *py_gemm_bf16(PyObject *self, PyObject *args);

#endif
