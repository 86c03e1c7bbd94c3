/* h2grpc._huffman: HPACK's Huffman decoding (RFC 7541 §5.2, Appendix B) in C (optional; h2grpc/native.py loads it).
 *
 * decode(data) -> bytes
 *     The octets the Huffman string `data` encodes, exactly as h2grpc.hpack_decode.huffman_decode_py decodes
 *     them, errors included: an EOS symbol anywhere in the string, or padding at its end that is over 7 bits
 *     or not all ones, raises hpack.exceptions.HPACKDecodingError with the pure path's message (the connection
 *     answers it with a COMPRESSION_ERROR).  tests/unit/test_h2grpc_native.py checks the two against each
 *     other on random, encoded and hostile strings.
 *
 * How: the code is a complete binary tree of 257 leaves (256 octets and EOS), so 256 internal nodes; a
 * decoder's state between nibbles is the internal node the bits read so far lead to (0, the root, when they
 * ended on a symbol).  STEP[state][nibble] gives the next state, and whether the 4 bits completed a symbol on
 * the way (at most one: the shortest code is 5 bits) or reached EOS.  The table (4,096 entries of 4 octets:
 * 16 KiB, which stays in the L1 cache, where a 256-wide table per state would take 256 KiB) is built once, at
 * import, from CODES (RFC 7541 Appendix B, the same as hpack.huffman_constants.REQUEST_CODES and _LENGTH).
 * Two table reads per input octet, no branch per symbol (the symbol is written whether or not it is one, and
 * the output's end moves only when it is).  The output is at most 8/5 of the input (a code is at least 5
 * bits): a string of up to STACK_OCTETS input octets (every header an ext_proc stream carries) is decoded on
 * the stack, a longer one into a heap buffer of that bound.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* RFC 7541 Appendix B: {code, bit length} for symbols 0..255 and EOS (256) */
static const struct {
    uint32_t code;
    uint8_t bits;
} CODES[257] = {
    {0x1ff8, 13}, {0x7fffd8, 23}, {0xfffffe2, 28}, {0xfffffe3, 28}, {0xfffffe4, 28}, {0xfffffe5, 28},
    {0xfffffe6, 28}, {0xfffffe7, 28}, {0xfffffe8, 28}, {0xffffea, 24}, {0x3ffffffc, 30}, {0xfffffe9, 28},
    {0xfffffea, 28}, {0x3ffffffd, 30}, {0xfffffeb, 28}, {0xfffffec, 28}, {0xfffffed, 28}, {0xfffffee, 28},
    {0xfffffef, 28}, {0xffffff0, 28}, {0xffffff1, 28}, {0xffffff2, 28}, {0x3ffffffe, 30}, {0xffffff3, 28},
    {0xffffff4, 28}, {0xffffff5, 28}, {0xffffff6, 28}, {0xffffff7, 28}, {0xffffff8, 28}, {0xffffff9, 28},
    {0xffffffa, 28}, {0xffffffb, 28}, {0x14, 6}, {0x3f8, 10}, {0x3f9, 10}, {0xffa, 12}, {0x1ff9, 13}, {0x15, 6},
    {0xf8, 8}, {0x7fa, 11}, {0x3fa, 10}, {0x3fb, 10}, {0xf9, 8}, {0x7fb, 11}, {0xfa, 8}, {0x16, 6}, {0x17, 6},
    {0x18, 6}, {0x0, 5}, {0x1, 5}, {0x2, 5}, {0x19, 6}, {0x1a, 6}, {0x1b, 6}, {0x1c, 6}, {0x1d, 6}, {0x1e, 6},
    {0x1f, 6}, {0x5c, 7}, {0xfb, 8}, {0x7ffc, 15}, {0x20, 6}, {0xffb, 12}, {0x3fc, 10}, {0x1ffa, 13}, {0x21, 6},
    {0x5d, 7}, {0x5e, 7}, {0x5f, 7}, {0x60, 7}, {0x61, 7}, {0x62, 7}, {0x63, 7}, {0x64, 7}, {0x65, 7}, {0x66, 7},
    {0x67, 7}, {0x68, 7}, {0x69, 7}, {0x6a, 7}, {0x6b, 7}, {0x6c, 7}, {0x6d, 7}, {0x6e, 7}, {0x6f, 7}, {0x70, 7},
    {0x71, 7}, {0x72, 7}, {0xfc, 8}, {0x73, 7}, {0xfd, 8}, {0x1ffb, 13}, {0x7fff0, 19}, {0x1ffc, 13}, {0x3ffc, 14},
    {0x22, 6}, {0x7ffd, 15}, {0x3, 5}, {0x23, 6}, {0x4, 5}, {0x24, 6}, {0x5, 5}, {0x25, 6}, {0x26, 6}, {0x27, 6},
    {0x6, 5}, {0x74, 7}, {0x75, 7}, {0x28, 6}, {0x29, 6}, {0x2a, 6}, {0x7, 5}, {0x2b, 6}, {0x76, 7}, {0x2c, 6},
    {0x8, 5}, {0x9, 5}, {0x2d, 6}, {0x77, 7}, {0x78, 7}, {0x79, 7}, {0x7a, 7}, {0x7b, 7}, {0x7ffe, 15}, {0x7fc, 11},
    {0x3ffd, 14}, {0x1ffd, 13}, {0xffffffc, 28}, {0xfffe6, 20}, {0x3fffd2, 22}, {0xfffe7, 20}, {0xfffe8, 20},
    {0x3fffd3, 22}, {0x3fffd4, 22}, {0x3fffd5, 22}, {0x7fffd9, 23}, {0x3fffd6, 22}, {0x7fffda, 23}, {0x7fffdb, 23},
    {0x7fffdc, 23}, {0x7fffdd, 23}, {0x7fffde, 23}, {0xffffeb, 24}, {0x7fffdf, 23}, {0xffffec, 24}, {0xffffed, 24},
    {0x3fffd7, 22}, {0x7fffe0, 23}, {0xffffee, 24}, {0x7fffe1, 23}, {0x7fffe2, 23}, {0x7fffe3, 23}, {0x7fffe4, 23},
    {0x1fffdc, 21}, {0x3fffd8, 22}, {0x7fffe5, 23}, {0x3fffd9, 22}, {0x7fffe6, 23}, {0x7fffe7, 23}, {0xffffef, 24},
    {0x3fffda, 22}, {0x1fffdd, 21}, {0xfffe9, 20}, {0x3fffdb, 22}, {0x3fffdc, 22}, {0x7fffe8, 23}, {0x7fffe9, 23},
    {0x1fffde, 21}, {0x7fffea, 23}, {0x3fffdd, 22}, {0x3fffde, 22}, {0xfffff0, 24}, {0x1fffdf, 21}, {0x3fffdf, 22},
    {0x7fffeb, 23}, {0x7fffec, 23}, {0x1fffe0, 21}, {0x1fffe1, 21}, {0x3fffe0, 22}, {0x1fffe2, 21}, {0x7fffed, 23},
    {0x3fffe1, 22}, {0x7fffee, 23}, {0x7fffef, 23}, {0xfffea, 20}, {0x3fffe2, 22}, {0x3fffe3, 22}, {0x3fffe4, 22},
    {0x7ffff0, 23}, {0x3fffe5, 22}, {0x3fffe6, 22}, {0x7ffff1, 23}, {0x3ffffe0, 26}, {0x3ffffe1, 26}, {0xfffeb, 20},
    {0x7fff1, 19}, {0x3fffe7, 22}, {0x7ffff2, 23}, {0x3fffe8, 22}, {0x1ffffec, 25}, {0x3ffffe2, 26}, {0x3ffffe3, 26},
    {0x3ffffe4, 26}, {0x7ffffde, 27}, {0x7ffffdf, 27}, {0x3ffffe5, 26}, {0xfffff1, 24}, {0x1ffffed, 25},
    {0x7fff2, 19}, {0x1fffe3, 21}, {0x3ffffe6, 26}, {0x7ffffe0, 27}, {0x7ffffe1, 27}, {0x3ffffe7, 26},
    {0x7ffffe2, 27}, {0xfffff2, 24}, {0x1fffe4, 21}, {0x1fffe5, 21}, {0x3ffffe8, 26}, {0x3ffffe9, 26},
    {0xffffffd, 28}, {0x7ffffe3, 27}, {0x7ffffe4, 27}, {0x7ffffe5, 27}, {0xfffec, 20}, {0xfffff3, 24}, {0xfffed, 20},
    {0x1fffe6, 21}, {0x3fffe9, 22}, {0x1fffe7, 21}, {0x1fffe8, 21}, {0x7ffff3, 23}, {0x3fffea, 22}, {0x3fffeb, 22},
    {0x1ffffee, 25}, {0x1ffffef, 25}, {0xfffff4, 24}, {0xfffff5, 24}, {0x3ffffea, 26}, {0x7ffff4, 23},
    {0x3ffffeb, 26}, {0x7ffffe6, 27}, {0x3ffffec, 26}, {0x3ffffed, 26}, {0x7ffffe7, 27}, {0x7ffffe8, 27},
    {0x7ffffe9, 27}, {0x7ffffea, 27}, {0x7ffffeb, 27}, {0xffffffe, 28}, {0x7ffffec, 27}, {0x7ffffed, 27},
    {0x7ffffee, 27}, {0x7ffffef, 27}, {0x7fffff0, 27}, {0x3ffffee, 26}, {0x3fffffff, 30}
};

#define EOS 256
#define EMIT 1u /* this step completed a symbol: `sym` */
#define FAIL 2u /* this step reached EOS */
#define STACK_OCTETS 512

typedef struct {
    uint8_t next;  /* the state after the nibble */
    uint8_t flags; /* EMIT, FAIL */
    uint8_t sym;   /* the symbol completed, when EMIT */
    uint8_t pad;
} step_t;

static step_t STEP[256][16];
static uint8_t ACCEPT[256]; /* end states: the root, or 1 to 7 ones of padding into the all-ones path */
static PyObject *DecodingError; /* hpack.exceptions.HPACKDecodingError */

/* The tree and the table from it.  children[node][bit] is the internal node a bit leads to, or, where
 * is_leaf[node][bit], the symbol whose leaf it is.  -1: the code table is not a complete prefix code. */
static int
build_tables(void)
{
    int16_t children[256][2];
    uint8_t is_leaf[256][2];
    int nodes = 1;
    memset(children, 0, sizeof children);
    memset(is_leaf, 0, sizeof is_leaf);
    for (int symbol = 0; symbol <= EOS; symbol++) {
        uint32_t code = CODES[symbol].code;
        int bits = CODES[symbol].bits;
        int node = 0;
        for (int k = bits - 1; k > 0; k--) {
            int bit = (code >> k) & 1;
            if (is_leaf[node][bit])
                return -1; /* not a prefix code */
            if (!children[node][bit]) {
                if (nodes == 256)
                    return -1;
                children[node][bit] = (int16_t)nodes++;
            }
            node = children[node][bit];
        }
        if (is_leaf[node][code & 1] || children[node][code & 1])
            return -1;
        is_leaf[node][code & 1] = 1;
        children[node][code & 1] = (int16_t)symbol;
    }
    if (nodes != 256)
        return -1; /* complete: 257 leaves, 256 internal nodes */
    for (int state = 0; state < 256; state++) {
        for (int nibble = 0; nibble < 16; nibble++) {
            int node = state;
            step_t s = {0, 0, 0, 0};
            for (int k = 3; k >= 0; k--) {
                int bit = (nibble >> k) & 1;
                if (!is_leaf[node][bit]) {
                    node = children[node][bit];
                    continue;
                }
                if (children[node][bit] == EOS)
                    s.flags |= FAIL;
                else {
                    s.flags |= EMIT;
                    s.sym = (uint8_t)children[node][bit];
                }
                node = 0;
            }
            s.next = (uint8_t)node;
            STEP[state][nibble] = s;
        }
    }
    int node = 0;
    for (int depth = 0; depth < 8; depth++) { /* the root, then the all-ones path 1 to 7 bits deep */
        ACCEPT[node] = 1;
        node = children[node][1];
    }
    return 0;
}

/* Decode `n` octets at `in` into `out` (room for n * 8 / 5 + 1): the octets written, or -1 with the error set */
static Py_ssize_t
decode_into(const uint8_t *in, Py_ssize_t n, uint8_t *out)
{
    unsigned state = 0, flags = 0;
    Py_ssize_t o = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        step_t s = STEP[state][in[i] >> 4];
        out[o] = s.sym;
        o += s.flags & EMIT;
        flags |= s.flags;
        s = STEP[s.next][in[i] & 15];
        out[o] = s.sym;
        o += s.flags & EMIT;
        flags |= s.flags;
        state = s.next;
    }
    if (flags & FAIL) {
        PyErr_SetString(DecodingError, "an EOS symbol in a Huffman string");
        return -1;
    }
    if (!ACCEPT[state]) {
        PyErr_SetString(DecodingError, "Huffman padding over 7 bits or not all ones");
        return -1;
    }
    return o;
}

static PyObject *
huffman_decode(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    const uint8_t *in = (const uint8_t *)view.buf;
    Py_ssize_t n = view.len;
    if (n <= STACK_OCTETS) {
        uint8_t out[STACK_OCTETS * 8 / 5 + 1];
        Py_ssize_t got = decode_into(in, n, out);
        if (got >= 0)
            result = PyBytes_FromStringAndSize((const char *)out, got);
    } else if (n > (PY_SSIZE_T_MAX - 1) / 8) {
        PyErr_NoMemory();
    } else {
        uint8_t *out = PyMem_Malloc((size_t)(n * 8 / 5 + 1));
        if (out == NULL) {
            PyErr_NoMemory();
        } else {
            Py_ssize_t got = decode_into(in, n, out);
            if (got >= 0)
                result = PyBytes_FromStringAndSize((const char *)out, got);
            PyMem_Free(out);
        }
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", huffman_decode, METH_O,
     "decode(data) -> bytes: an HPACK Huffman string decoded; HPACKDecodingError on EOS or bad padding"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "h2grpc._huffman", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC
PyInit__huffman(void)
{
    if (build_tables() < 0) {
        PyErr_SetString(PyExc_ImportError, "h2grpc._huffman: the RFC 7541 code table is not a complete prefix code");
        return NULL;
    }
    PyObject *exceptions = PyImport_ImportModule("hpack.exceptions");
    if (exceptions == NULL)
        return NULL;
    DecodingError = PyObject_GetAttrString(exceptions, "HPACKDecodingError");
    Py_DECREF(exceptions);
    if (DecodingError == NULL)
        return NULL;
    return PyModule_Create(&module);
}
