/* FP4 codes two per byte: pack_nibbles and unpack_nibbles, one pass each over the packed bytes (element 2i in the
 * low nibble, 2i + 1 in the high one: mindspeed_te.fp4.pack_fp4's layout). Plain loops the compiler vectorizes. */
#include "kernels.h"

#include <string.h>

static void pack_range(Job *j) {
    const uint8_t *restrict in = (const uint8_t *)j->in;
    uint8_t *restrict out = j->out;
    for (int64_t i = j->begin; i < j->end; ++i) out[i] = (uint8_t)((in[2 * i] & 0x0F) | (in[2 * i + 1] << 4));
}

static void unpack_range(Job *j) {
    const uint8_t *restrict in = (const uint8_t *)j->in;
    uint8_t *restrict out = j->out;
    for (int64_t i = j->begin; i < j->end; ++i) {
        out[2 * i] = in[i] & 0x0F;
        out[2 * i + 1] = in[i] >> 4;
    }
}

/* pack (1) or unpack (0) n packed bytes: in and out are the codes (2n bytes) and the packed bytes (n), or the other
 * way round. */
PyObject *py_nibbles(PyObject *self, PyObject *args) {
    unsigned long long in, out;
    long long n;
    int pack, threads;
    if (!PyArg_ParseTuple(args, "KKLpi", &in, &out, &n, &pack, &threads)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nibbles: bad size");
        return NULL;
    }
    Job proto;
    memset(&proto, 0, sizeof proto);
    proto.in = (const void *)in;
    proto.out = (uint8_t *)out;
    Job jobs[MAX_THREADS];
    int used;
    Py_BEGIN_ALLOW_THREADS
    parallel(pack ? pack_range : unpack_range, &proto, n, threads, jobs, &used);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
