/* The module mindspeed_te._fused_cast: its method table and init. setup.py builds it from all of csrc/: the
 * per-tensor cast (cast.c), decode and dequantize (decode.c), the block / MX quantize (tiles.c, tiles_avx512.c),
 * the NVFP4 quantize and the columnwise Hadamard transform (nvfp4.c), FP4 packing (nibbles.c),
 * the GEMM epilogue (epilogue.c) and the bfloat16 GEMM (gemm_bf16.c), on the thread runner (threads.c) and the
 * run-time choice of vector code (simd.c); kernels.h, codecs.h, codecs_x86.h and tiles.h hold what they share.
 *
 * The functions take raw addresses of contiguous CPU tensors (Tensor.data_ptr()) and release the GIL.
 * Build: setup.py compiles these files as the optional extension mindspeed_te._fused_cast, with OpenMP where the
 * compiler has it (the jobs then run on torch's OpenMP threads; `openmp` in the module says which), else with
 * pthreads; without it the package uses the torch ops (mindspeed_te.fused_cast decides).
 */
#include "kernels.h"

static PyObject *py_gemm_bf16_supported(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(gemm_bf16_supported());
}

static PyMethodDef methods[] = {
    {"scaled_cast", py_scaled_cast, METH_VARARGS,
     "scaled_cast(in, in_dtype, n, scale_inv, out, out_format, table, threads): out = sat(in / *scale_inv)"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(in, in_dtype, n, out, out_format, table, threads, amax, divisor, scale_inv_out, fp8_max, eps, pow2)"},
    {"amax", py_amax, METH_VARARGS, "amax(in, in_dtype, n, out, threads): *out = max |in| (NaN if any)"},
    {"decode", py_decode, METH_VARARGS, "decode(in, n, values, out, threads): out = values[in] (uint8 codes)"},
    {"quantize_tiles", py_quantize_tiles, METH_VARARGS,
     "quantize_tiles(in, in_dtype, m, k, out_format, table, mode, tile_rows, block, emax, fp8_max, eps, pow2, "
     "row_data, row_scale, col_data, col_scale, threads): block / MX quantize, rowwise and/or columnwise"},
    {"nibbles", py_nibbles, METH_VARARGS,
     "nibbles(in, out, n, pack, threads): FP4 codes to n bytes two per byte (pack), or n bytes to codes"},
    {"quantize_nvfp4", py_quantize_nvfp4, METH_VARARGS,
     "quantize_nvfp4(in, in_dtype, m, k, tile, factors, rbits, data, scale, col_data, col_scale, threads): NVFP4 "
     "codes packed two a byte and E4M3 scales of 1x16 blocks (tile 1) or 16x16 tiles (16), rounded stochastically "
     "with rbits; with col_data, 16x16 tiles in the transpose's layout too"},
    {"dequantize_nvfp4", py_dequantize_nvfp4, METH_VARARGS,
     "dequantize_nvfp4(data, scale, m, k, values, amax, factor, out, threads): out = values[code] * "
     "((e4m3(scale) * *amax) * factor), codes packed two a byte, one E4M3 scale per 16"},
    {"hadamard_columns", py_hadamard_columns, METH_VARARGS,
     "hadamard_columns(in, in_dtype, m, k, sign_mask, out, out_amax, in_amax, threads): out (k, m) = the random "
     "Hadamard transform of in^T's rows in runs of 16, exactly rounded; *out_amax = max |out|, *in_amax = max |in|"},
    {"dequantize_tiles", py_dequantize_tiles, METH_VARARGS,
     "dequantize_tiles(codes, m, k, values, scales, scale_cols, rows, cols, out, threads, e8m0, bf16): out = "
     "values[codes] * scales[r / rows, c / cols] (scales float32, or E8M0 bytes when e8m0; out bfloat16 when bf16)"},
    {"gemm_epilogue", py_gemm_epilogue, METH_VARARGS,
     "gemm_epilogue(acc, m, n, scale_b, scale_a, bias, out, kind, threads): out = (acc * *scale_b) * *scale_a + "
     "bias as float32 (kind 0) or bfloat16 (1), or out += (acc * *scale_b) * *scale_a (2)"},
    {"gemm_bf16", py_gemm_bf16, METH_VARARGS,
     "gemm_bf16(a, b, c, m, n, k, threads): c = a . b^T in float32, a and b given as (data, rs, cs, kind, table) "
     "with kind 0 bfloat16, 1 float32 holding bfloat16 values, 2 uint8 codes of the 256 float32 values at table"},
    {"gemm_bf16_supported", py_gemm_bf16_supported, METH_NOARGS, "whether this CPU runs gemm_bf16 (AVX-512 BF16)"},
    {"set_simd", py_set_simd, METH_VARARGS,
     "set_simd(limit): use vector code up to 0 (scalar), 1 (AVX2) or 2 (AVX-512); returns the level in effect"},
    {"current_scale_inv", py_current_scale_inv, METH_VARARGS,
     "current_scale_inv(amax, out, fp8_max, eps, pow2): *out = the current-scaling scale_inv of *amax"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_cast", "Fused CPU quantize kernels.", -1, methods};

PyMODINIT_FUNC PyInit__fused_cast(void) {
    PyObject *m = PyModule_Create(&module);
#if defined(_OPENMP)
    const long openmp = 1;
#else
    const long openmp = 0;
#endif
    if (m && PyModule_AddIntConstant(m, "openmp", openmp) < 0) Py_CLEAR(m);
    return m;
}
