/* The run-time choice of vector code: what the CPU has (simd_level, has_avx2) and the limit set_simd sets. The
 * kernel files ask here before each pass; their vector functions carry their own target attributes, so no file
 * needs vector compiler flags. */
#include "kernels.h"

/* The vector code a CPU runs: the widest it has, at most simd_limit (set_simd lowers the limit so that the
 * tests also run the narrower paths, which machines without AVX-512 or AVX2 take). */
static int simd_limit = SIMD_AVX512;

int simd_level(void) {
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
int has_avx2(void) { return simd_level() >= SIMD_AVX2; }
#endif

PyObject *py_set_simd(PyObject *self, PyObject *args) {
    int limit;
    if (!PyArg_ParseTuple(args, "i", &limit)) return NULL;
    if (limit < SIMD_NONE || limit > SIMD_AVX512) {
        PyErr_SetString(PyExc_ValueError, "set_simd: limit must be 0 (scalar), 1 (AVX2) or 2 (AVX-512)");
        return NULL;
    }
    simd_limit = limit;
    return PyLong_FromLong(simd_level());
}
