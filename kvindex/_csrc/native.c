/* kvindex._native: the KV-event ingest's two hot loops in C (optional; kvindex/native.py loads it).
 *
 * chain(buf, n_blocks, block_size, seed) -> list[int]
 *     The chained block hashes of kvindex.hashing.chain_blocks: per block, xxh3-64 over its block_size token
 *     ids as little-endian u32, seeded with the previous block's hash (the first with `seed`).  Byte-identical
 *     to the pure-Python path (the same xxHash, 0.8.4, vendored in xxhash.h with its licence).
 *
 * pack_u32(ids, out) -> None
 *     A list of token ids written into `out` (a writable buffer of 4 bytes per id: an array('I') of the list's
 *     length) as native u32, exactly as array('I').fromlist does, with its errors: a value that is not an int
 *     (nor has __index__) raises TypeError, one below 0 or over 2**32 - 1 OverflowError, a list that changes
 *     size while it is read RuntimeError.  fromlist calls a per-item setter through a pointer and re-checks the
 *     list per item: a 32k-token prompt cost the request path ~0.1 ms of a decision (kvindex/hashing.py).
 *
 * pack_u64(values, out) -> None
 *     The same for array('Q') (a list of block hashes, as a lookup or a prediction sends them): array('Q', list)
 *     converts each 64-bit int through _PyLong_AsByteArray, 0.2M instructions per 32k-token prompt, twice a
 *     decision.
 *
 * decode(payload) -> (ts, rank, n_events, events) | None
 *     The common shape of a KV-event batch, decoded straight from the msgpack bytes without one Python int per
 *     token id: an array envelope [ts, events(, rank)] whose events are BlockStored text chains (no LoRA, no
 *     salt, no media keys, medium GPU, main group), BlockRemoved at GPU and AllBlocksCleared, as tagged maps or
 *     positional arrays.  Each event comes back as a tuple: (0, hashes, parent, token_bytes, block_size),
 *     (1, hashes) or (2,); kvindex/decode.py builds its events from them.  ANYTHING else -- another shape, a
 *     field the common shape does not have, a value out of range, a truncated or malformed payload -- returns
 *     None and the caller decodes the payload in pure Python, which owns every rule and every counter.  So this
 *     function only has to be exact on what it accepts (tests/unit/test_kvindex_native.py checks it against the
 *     pure path on generated and hostile payloads) and safe on everything: every read is bounds-checked
 *     against the payload's end, no count from the wire sizes an allocation before the bytes for it are known
 *     to be there, and the nesting it follows is fixed (envelope, event, field, array of scalars): no recursion.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define MAX_HASHES_PER_EVENT 1000000 /* kvindex/decode.py MAX_HASHES_PER_EVENT */
#define MAX_BLOCK_SIZE 65536         /* kvindex/decode.py MAX_BLOCK_SIZE */

/* ------------------------------------------------------------------------------------------------- chain */
static PyObject *
native_chain(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view;
    Py_ssize_t n_blocks, block_size;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*nnK", &view, &n_blocks, &block_size, &seed))
        return NULL;
    if (n_blocks < 0 || block_size <= 0 || block_size > (PY_SSIZE_T_MAX / 4)
        || (n_blocks > 0 && n_blocks > view.len / (block_size * 4))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "chain: the buffer holds fewer than n_blocks blocks");
        return NULL;
    }
    PyObject *out = PyList_New(n_blocks);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const char *p = (const char *)view.buf;
    size_t step = (size_t)block_size * 4;
    XXH64_hash_t h = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        h = XXH3_64bits_withSeed(p + (size_t)i * step, step, h);
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)h);
        if (v == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    PyBuffer_Release(&view);
    return out;
}

/* the digits of a non-negative int, least significant first (PyLong_SHIFT bits each), and how many */
static inline const digit *
long_digits(PyObject *v, Py_ssize_t *nd)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyLongObject *l = (PyLongObject *)v;
    *nd = (Py_ssize_t)(l->long_value.lv_tag >> _PyLong_NON_SIZE_BITS);
    return l->long_value.ob_digit;
#else
    Py_ssize_t size = Py_SIZE(v);
    *nd = size < 0 ? -size : size;
    return ((PyLongObject *)v)->ob_digit;
#endif
}

/* ---------------------------------------------------------------------------------------------- pack_u32 */
/* 1 and the value for an exact int that is 0 or one positive digit (< 2**30: every token id of a real
 * vocabulary), read in place as PyLong_AsUnsignedLong would; 0 for anything else (the caller asks the API) */
static inline int
compact_u32(PyObject *v, unsigned long *x)
{
    if (!PyLong_CheckExact(v))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return 0;
    Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)v);
    if (c < 0)
        return 0;
    *x = (unsigned long)c;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0) {
        *x = 0;
        return 1;
    }
    if (size != 1)
        return 0;
    *x = (unsigned long)((PyLongObject *)v)->ob_digit[0];
    return 1;
#endif
}

/* ---------------------------------------------------------------------------------------------- pack_u64 */
/* 1 and the value for an exact non-negative int below 2**64 of at most three 30-bit digits (every block hash),
 * read in place as PyLong_AsUnsignedLongLong would; 0 for anything else (the caller asks the API) */
static inline int
small_u64(PyObject *v, unsigned long long *x)
{
#if PyLong_SHIFT == 30
    if (!PyLong_CheckExact(v) || _PyLong_Sign(v) < 0)
        return 0;
    Py_ssize_t nd;
    const digit *d = long_digits(v, &nd);
    unsigned long long r = 0;
    switch (nd) {
    case 3:
        if (d[2] >> 4) /* 60 + 4 bits */
            return 0;
        r = (unsigned long long)d[2] << 60;
        /* fall through */
    case 2:
        r |= (unsigned long long)d[1] << 30;
        /* fall through */
    case 1:
        r |= (unsigned long long)d[0];
        /* fall through */
    case 0:
        *x = r;
        return 1;
    default:
        return 0;
    }
#else
    (void)v;
    (void)x;
    return 0;
#endif
}

/* pack_u32 and pack_u64: `list`'s values into `out` (4 or 8 bytes each), as array's setter stores them: an int
 * read in place when it is small enough, anything else through __index__ and PyLong_AsUnsigned*, whose
 * OverflowError (and message) is array's; the per-item size check is fromlist's */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((always_inline))
#endif
static inline PyObject *
pack_list(PyObject *args, const int wide) /* inlined into each width's entry point: its loop is that width's alone */
{
    PyObject *list;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "O!w*", &PyList_Type, &list, &view))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    Py_ssize_t size = wide ? 8 : 4;
    if (view.len != n * size || view.itemsize != size) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, wide ? "pack_u64: out must hold 8 bytes per value"
                                               : "pack_u32: out must hold 4 bytes per id");
        return NULL;
    }
    uint32_t *out32 = (uint32_t *)view.buf;
    uint64_t *out64 = (uint64_t *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(list, i);
        unsigned long long x;
        unsigned long x32;
        if (wide ? small_u64(v, &x) : compact_u32(v, &x32)) { /* no call: nothing can change the list */
            if (wide)
                out64[i] = (uint64_t)x;
            else
                out32[i] = (uint32_t)x32;
            continue;
        }
        PyObject *idx = v;
        Py_INCREF(idx);
        if (!PyLong_Check(v)) { /* array's setter: __index__ (may run Python code that changes the list) */
            Py_SETREF(idx, PyNumber_Index(v));
            if (idx == NULL)
                goto fail;
        }
        x = wide ? PyLong_AsUnsignedLongLong(idx) : (unsigned long long)PyLong_AsUnsignedLong(idx);
        Py_DECREF(idx);
        if (PyErr_Occurred())
            goto fail; /* OverflowError, with the message array gives */
        if (!wide && x > 0xFFFFFFFFULL) {
            PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
            goto fail;
        }
        if (n != PyList_GET_SIZE(list)) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
            goto fail;
        }
        if (wide)
            out64[i] = (uint64_t)x;
        else
            out32[i] = (uint32_t)x;
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *
native_pack_u32(PyObject *self, PyObject *args)
{
    (void)self;
    return pack_list(args, 0);
}

static PyObject *
native_pack_u64(PyObject *self, PyObject *args)
{
    (void)self;
    return pack_list(args, 1);
}

/* ------------------------------------------------------------------------------------------------ decode */
typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Rd;

/* every reader returns 0 on success, -1 for "not the fast shape" (the caller falls back, no exception set) */
#define NEED(r, n) do { if ((size_t)((r)->end - (r)->p) < (size_t)(n)) return -1; } while (0)

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static inline uint64_t be64(const uint8_t *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

/* an integer: its 64 bits (two's complement for negatives) and whether it is negative */
static int
rd_int(Rd *r, uint64_t *out, int *neg)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    if (b <= 0x7f) { *out = b; *neg = 0; r->p += 1; return 0; }
    if (b >= 0xe0) { *out = (uint64_t)(int64_t)(int8_t)b; *neg = 1; r->p += 1; return 0; }
    switch (b) {
    case 0xcc: NEED(r, 2); *out = r->p[1]; *neg = 0; r->p += 2; return 0;
    case 0xcd: NEED(r, 3); *out = be16(r->p + 1); *neg = 0; r->p += 3; return 0;
    case 0xce: NEED(r, 5); *out = be32(r->p + 1); *neg = 0; r->p += 5; return 0;
    case 0xcf: NEED(r, 9); *out = be64(r->p + 1); *neg = 0; r->p += 9; return 0;
    case 0xd0: { NEED(r, 2); int64_t v = (int8_t)r->p[1]; *out = (uint64_t)v; *neg = v < 0; r->p += 2; return 0; }
    case 0xd1: { NEED(r, 3); int64_t v = (int16_t)be16(r->p + 1); *out = (uint64_t)v; *neg = v < 0; r->p += 3; return 0; }
    case 0xd2: { NEED(r, 5); int64_t v = (int32_t)be32(r->p + 1); *out = (uint64_t)v; *neg = v < 0; r->p += 5; return 0; }
    case 0xd3: { NEED(r, 9); int64_t v = (int64_t)be64(r->p + 1); *out = (uint64_t)v; *neg = v < 0; r->p += 9; return 0; }
    default: return -1;
    }
}

/* an array header: its length, checked against the bytes left (each element takes at least one byte) */
static int
rd_array(Rd *r, uint32_t *n)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    if (b >= 0x90 && b <= 0x9f) { *n = b & 0x0f; r->p += 1; }
    else if (b == 0xdc) { NEED(r, 3); *n = be16(r->p + 1); r->p += 3; }
    else if (b == 0xdd) { NEED(r, 5); *n = be32(r->p + 1); r->p += 5; }
    else return -1;
    NEED(r, *n);
    return 0;
}

static int
rd_map(Rd *r, uint32_t *n)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    if (b >= 0x80 && b <= 0x8f) { *n = b & 0x0f; r->p += 1; }
    else if (b == 0xde) { NEED(r, 3); *n = be16(r->p + 1); r->p += 3; }
    else if (b == 0xdf) { NEED(r, 5); *n = be32(r->p + 1); r->p += 5; }
    else return -1;
    if (*n > (uint32_t)((r->end - r->p) / 2)) return -1; /* a key and a value: two bytes at least */
    return 0;
}

/* a str: pointer to its bytes and their length (not decoded: only compared with ASCII names) */
static int
rd_str(Rd *r, const uint8_t **s, uint32_t *len)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    uint32_t n;
    size_t h;
    if (b >= 0xa0 && b <= 0xbf) { n = b & 0x1f; h = 1; }
    else if (b == 0xd9) { NEED(r, 2); n = r->p[1]; h = 2; }
    else if (b == 0xda) { NEED(r, 3); n = be16(r->p + 1); h = 3; }
    else if (b == 0xdb) { NEED(r, 5); n = be32(r->p + 1); h = 5; }
    else return -1;
    NEED(r, h + (size_t)n);
    *s = r->p + h;
    *len = n;
    r->p += h + n;
    return 0;
}

static inline int
is_nil(Rd *r)
{
    if (r->p < r->end && *r->p == 0xc0) { r->p += 1; return 1; }
    return 0;
}

/* one scalar the pure path ignores the value of (nil, bool, int, float, str); anything else is not the shape */
static int
skip_scalar(Rd *r)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    if (b == 0xc0 || b == 0xc2 || b == 0xc3) { r->p += 1; return 0; }
    if (b == 0xca) { NEED(r, 5); r->p += 5; return 0; }
    if (b == 0xcb) { NEED(r, 9); r->p += 9; return 0; }
    if ((b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb)) {
        /* ASCII only: msgpack fails a whole payload on one invalid UTF-8 str, so any other text is left to it */
        const uint8_t *s;
        uint32_t n;
        if (rd_str(r, &s, &n)) return -1;
        for (uint32_t i = 0; i < n; i++)
            if (s[i] & 0x80) return -1;
        return 0;
    }
    uint64_t v;
    int neg;
    return rd_int(r, &v, &neg);
}

/* the value of one field, skipped but checked: an array of ints (hashes, tokens), an array of nils
   (extra_keys of a text chain) or a scalar */
static int
skip_value(Rd *r)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    if ((b >= 0x90 && b <= 0x9f) || b == 0xdc || b == 0xdd) {
        uint32_t n;
        if (rd_array(r, &n)) return -1;
        for (uint32_t i = 0; i < n; i++) {
            if (is_nil(r)) continue;
            uint64_t v;
            int neg;
            if (rd_int(r, &v, &neg)) return -1;
        }
        return 0;
    }
    return skip_scalar(r);
}

enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP,
    F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, F_VERSION, F_COUNT
};
static const char *const FIELD_NAMES[F_COUNT] = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership",
    "session_id", "event_version",
};
/* the keys each event type knows (kvindex/decode.py _KNOWN_*, less those that make an event leave the common
   shape: cache_salt, mm_keys); a key outside its type's set is counted by the pure path, so it decides */
#define BIT(f) (1u << (f))
#define STORED_KEYS (BIT(F_COUNT) - 1u)
#define REMOVED_KEYS (BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP) | BIT(F_LOCALITY) \
                      | BIT(F_OWNERSHIP) | BIT(F_SESSION))
#define CLEARED_KEYS BIT(F_TYPE)
/* positional events (vLLM <= 0.31): kvindex/decode.py STORED_FIELDS / REMOVED_FIELDS order */
static const int STORED_ORDER[] = {F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA,
                                   F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW};
static const int REMOVED_ORDER[] = {F_HASHES, F_MEDIUM, F_GROUP};

enum { K_STORED, K_REMOVED, K_CLEARED };

static int
str_is(const uint8_t *s, uint32_t n, const char *name)
{
    size_t len = strlen(name);
    return n == len && memcmp(s, name, len) == 0;
}

static int
rd_kind(Rd *r, int *kind)
{
    const uint8_t *s;
    uint32_t n;
    if (rd_str(r, &s, &n)) return -1;
    if (str_is(s, n, "BlockStored")) *kind = K_STORED;
    else if (str_is(s, n, "BlockRemoved")) *kind = K_REMOVED;
    else if (str_is(s, n, "AllBlocksCleared")) *kind = K_CLEARED;
    else return -1;
    return 0;
}

/* medium: absent, nil or "GPU" (the GPU tier); group_idx: absent, nil or 0; lora_*: absent or nil */
static int
check_gpu(const uint8_t *at, const uint8_t *end)
{
    if (at == NULL) return 0;
    Rd r = {at, end};
    if (is_nil(&r)) return 0;
    const uint8_t *s;
    uint32_t n;
    if (rd_str(&r, &s, &n)) return -1;
    return str_is(s, n, "GPU") ? 0 : -1;
}

static int
check_group(const uint8_t *at, const uint8_t *end)
{
    if (at == NULL) return 0;
    Rd r = {at, end};
    if (is_nil(&r)) return 0;
    uint64_t v;
    int neg;
    if (rd_int(&r, &v, &neg)) return -1;
    return v == 0 ? 0 : -1;
}

static int
check_nil(const uint8_t *at, const uint8_t *end)
{
    if (at == NULL) return 0;
    Rd r = {at, end};
    return is_nil(&r) ? 0 : -1;
}

/* block hashes -> a new list of u64 ints, read from `r` (bytes hashes, bools, floats: not the shape);
   returns 0, -1 not the shape, -2 a Python error is set */
static int
rd_hashes(Rd *r, PyObject **out, uint32_t *count)
{
    uint32_t n;
    if (rd_array(r, &n) || n > MAX_HASHES_PER_EVENT) return -1;
    PyObject *list = PyList_New(n);
    if (list == NULL) return -2;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v;
        int neg;
        if (rd_int(r, &v, &neg)) { Py_DECREF(list); return -1; }
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (o == NULL) { Py_DECREF(list); return -2; }
        PyList_SET_ITEM(list, i, o);
    }
    *out = list;
    *count = n;
    return 0;
}

/* Token ids are most of a payload, and their int encodings (1, 2, 3, 5 or 9 bytes) alternate unpredictably
   from one id to the next: branching on the type byte cost ~14 ns an id in mispredictions.  So an id is read
   through per-type-byte tables instead: its length, the shift and mask that take its value out of the 8 bytes
   after the type byte, the value of a positive fixint, and the sign bit of a signed type (a negative id is not
   the shape).  Where fewer than 9 bytes are left, `rd_int` reads the id. */
static uint8_t T_LEN[256];   /* bytes the int takes, type byte included; 0: not a non-negative int type */
static uint8_t T_SHIFT[256];
static uint64_t T_MASK[256];
static uint64_t T_FIX[256];
static uint64_t T_SIGN[256];

static void
init_tables(void)
{
    for (int b = 0; b < 0x80; b++) { T_LEN[b] = 1; T_FIX[b] = (uint64_t)b; }
    static const uint8_t types[8] = {0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3};
    for (int i = 0; i < 8; i++) {
        int k = 1 << (i & 3); /* payload bytes: 1, 2, 4, 8 */
        uint8_t b = types[i];
        T_LEN[b] = (uint8_t)(1 + k);
        T_SHIFT[b] = (uint8_t)(64 - 8 * k);
        T_MASK[b] = k == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * k)) - 1);
        T_SIGN[b] = i >= 4 ? ((uint64_t)1 << (8 * k - 1)) : 0;
    }
}

/* token ids -> bytes of little-endian u32, read from `r` (an id below 0 or above 2**32 - 1: not the shape) */
static int
rd_tokens(Rd *r, PyObject **out, uint32_t *count)
{
    uint32_t n;
    if (rd_array(r, &n) || (size_t)n > (size_t)PY_SSIZE_T_MAX / 4) return -1;
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 4);
    if (b == NULL) return -2;
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(b);
    const uint8_t *p = r->p, *end = r->end;
    uint32_t i = 0;
    for (; i < n && end - p >= 9; i++) {
        uint8_t t = *p;
        uint8_t len = T_LEN[t];
        uint64_t raw;
        memcpy(&raw, p + 1, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        raw = __builtin_bswap64(raw);
#elif !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
        raw = be64(p + 1);
#endif
        uint64_t v = ((raw >> T_SHIFT[t]) & T_MASK[t]) | T_FIX[t];
        if (len == 0 || (v & T_SIGN[t]) || v > 0xffffffffu) { Py_DECREF(b); return -1; }
        p += len;
        dst[0] = (uint8_t)v;
        dst[1] = (uint8_t)(v >> 8);
        dst[2] = (uint8_t)(v >> 16);
        dst[3] = (uint8_t)(v >> 24);
        dst += 4;
    }
    r->p = p;
    for (; i < n; i++) { /* the last few bytes of the payload: read one bounds-checked int at a time */
        uint64_t v;
        int neg;
        if (rd_int(r, &v, &neg) || neg || v > 0xffffffffu) { Py_DECREF(b); return -1; }
        dst[0] = (uint8_t)v;
        dst[1] = (uint8_t)(v >> 8);
        dst[2] = (uint8_t)(v >> 16);
        dst[3] = (uint8_t)(v >> 24);
        dst += 4;
    }
    *out = b;
    *count = n;
    return 0;
}

/* check an extra_keys value: absent, nil, empty, or one nil per block (a text chain) */
static int
check_extra(const uint8_t *at, const uint8_t *end, uint32_t n_blocks)
{
    if (at == NULL) return 0;
    Rd r = {at, end};
    if (is_nil(&r)) return 0;
    uint32_t n;
    if (rd_array(&r, &n)) return -1;
    if (n == 0) return 0;
    if (n != n_blocks) return -1;
    for (uint32_t i = 0; i < n; i++)
        if (!is_nil(&r)) return -1;
    return 0;
}

/* one event being read: where each field's value starts, and the hashes and tokens already read */
typedef struct {
    const uint8_t *at[F_COUNT];
    PyObject *hashes;
    uint32_t n_hashes;
    PyObject *tokens;
    uint32_t n_tokens;
} Ev;

/* one field's value: hashes and token ids read at once (one pass over the bulk of the payload), any other
   value skipped but checked and its position kept */
static int
rd_field(Rd *r, int f, Ev *e)
{
    if (f == F_HASHES) return rd_hashes(r, &e->hashes, &e->n_hashes);
    if (f == F_TOKENS) return rd_tokens(r, &e->tokens, &e->n_tokens);
    e->at[f] = r->p;
    return skip_value(r);
}

/* one event from its fields -> its tuple; -1 not the shape, -2 a Python error is set */
static int
build_event(int kind, Ev *e, const uint8_t *end, PyObject **out)
{
    const uint8_t *const *at = e->at;
    if (kind == K_CLEARED) {
        *out = Py_BuildValue("(i)", 2);
        return *out ? 0 : -2;
    }
    if (e->hashes == NULL || check_gpu(at[F_MEDIUM], end) || check_group(at[F_GROUP], end)) return -1;
    if (kind == K_REMOVED) {
        *out = Py_BuildValue("(iO)", 1, e->hashes);
        return *out ? 0 : -2;
    }
    /* BlockStored: a non-empty text chain whose tokens are exactly its blocks' */
    if (check_nil(at[F_LORA_ID], end) || check_nil(at[F_LORA_NAME], end) || at[F_BS] == NULL) return -1;
    Rd r = {at[F_BS], end};
    uint64_t bs;
    int neg;
    if (rd_int(&r, &bs, &neg) || neg || bs == 0 || bs > MAX_BLOCK_SIZE) return -1;
    if (e->n_hashes == 0 || e->tokens == NULL || (uint64_t)e->n_tokens != (uint64_t)e->n_hashes * bs) return -1;
    if (check_extra(at[F_EXTRA], end, e->n_hashes)) return -1;
    PyObject *parent = Py_None;
    if (at[F_PARENT] != NULL) {
        Rd pr = {at[F_PARENT], end};
        if (!is_nil(&pr)) {
            uint64_t v;
            if (rd_int(&pr, &v, &neg)) return -1;
            parent = PyLong_FromUnsignedLongLong(v);
            if (parent == NULL) return -2;
            *out = Py_BuildValue("(iONOK)", 0, e->hashes, parent, e->tokens, (unsigned long long)bs);
            return *out ? 0 : -2;
        }
    }
    *out = Py_BuildValue("(iOOOK)", 0, e->hashes, parent, e->tokens, (unsigned long long)bs);
    return *out ? 0 : -2;
}

static int
rd_event_into(Rd *r, Ev *e, PyObject **out)
{
    NEED(r, 1);
    uint8_t b = *r->p;
    int kind, rc;
    if ((b >= 0x80 && b <= 0x8f) || b == 0xde || b == 0xdf) {
        uint32_t n, seen = 0;
        if (rd_map(r, &n)) return -1;
        for (uint32_t i = 0; i < n; i++) {
            const uint8_t *s;
            uint32_t len;
            if (rd_str(r, &s, &len)) return -1; /* a non-str key: the pure path's business */
            int f = -1;
            for (int k = 0; k < F_COUNT; k++)
                if (str_is(s, len, FIELD_NAMES[k])) { f = k; break; }
            if (f < 0 || (seen & BIT(f))) return -1; /* an unknown or repeated key */
            seen |= BIT(f);
            if ((rc = rd_field(r, f, e)) != 0) return rc;
        }
        if (e->at[F_TYPE] == NULL) return -1;
        Rd t = {e->at[F_TYPE], r->end};
        if (rd_kind(&t, &kind)) return -1;
        uint32_t allowed = kind == K_STORED ? STORED_KEYS : kind == K_REMOVED ? REMOVED_KEYS : CLEARED_KEYS;
        if (seen & ~allowed) return -1;
    } else {
        uint32_t n;
        if (rd_array(r, &n) || n == 0) return -1;
        if (rd_kind(r, &kind)) return -1;
        const int *order = kind == K_STORED ? STORED_ORDER : REMOVED_ORDER;
        uint32_t lo = kind == K_STORED ? 5 : kind == K_REMOVED ? 2 : 1;
        uint32_t hi = kind == K_STORED ? 1 + (uint32_t)(sizeof(STORED_ORDER) / sizeof(int))
                    : kind == K_REMOVED ? 1 + (uint32_t)(sizeof(REMOVED_ORDER) / sizeof(int)) : 1;
        if (n < lo || n > hi) return -1;
        for (uint32_t i = 1; i < n; i++)
            if ((rc = rd_field(r, order[i - 1], e)) != 0) return rc;
    }
    return build_event(kind, e, r->end, out);
}

static int
rd_event(Rd *r, PyObject **out)
{
    Ev e;
    memset(&e, 0, sizeof(e));
    *out = NULL;
    int rc = rd_event_into(r, &e, out);
    Py_XDECREF(e.hashes);
    Py_XDECREF(e.tokens);
    return rc;
}

static PyObject *
native_decode(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Rd r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    PyObject *ts = NULL, *rank = NULL, *events = NULL, *result = NULL;
    uint32_t n_env, n_ev;
    int rc = -1;
    if (rd_array(&r, &n_env) || (n_env != 2 && n_env != 3)) goto done;
    /* ts: a float (an int ts is rare: the pure path converts it) */
    if (r.p >= r.end) goto done;
    if (*r.p == 0xcb) {
        if (r.end - r.p < 9) goto done;
        uint64_t u = be64(r.p + 1);
        double d;
        memcpy(&d, &u, 8);
        r.p += 9;
        ts = PyFloat_FromDouble(d);
    } else if (*r.p == 0xca) {
        if (r.end - r.p < 5) goto done;
        uint32_t u = be32(r.p + 1);
        float f;
        memcpy(&f, &u, 4);
        r.p += 5;
        ts = PyFloat_FromDouble((double)f);
    } else {
        goto done;
    }
    if (ts == NULL) { rc = -2; goto done; }
    if (rd_array(&r, &n_ev)) goto done;
    events = PyList_New(0);
    if (events == NULL) { rc = -2; goto done; }
    for (uint32_t i = 0; i < n_ev; i++) {
        PyObject *ev;
        rc = rd_event(&r, &ev);
        if (rc) goto done;
        rc = -1;
        if (PyList_Append(events, ev) < 0) { Py_DECREF(ev); rc = -2; goto done; }
        Py_DECREF(ev);
    }
    if (n_env == 3 && !is_nil(&r)) {
        uint64_t v;
        int neg;
        if (rd_int(&r, &v, &neg) || neg || v >= 65536) goto done;
        rank = PyLong_FromUnsignedLongLong(v);
        if (rank == NULL) { rc = -2; goto done; }
    }
    if (r.p != r.end) goto done; /* trailing bytes: msgpack's ExtraData, the pure path's business */
    if (rank == NULL) {
        rank = Py_None;
        Py_INCREF(rank);
    }
    result = Py_BuildValue("(NNIN)", ts, rank, (unsigned int)n_ev, events);
    ts = rank = events = NULL;
    rc = result ? 0 : -2;
done:
    Py_XDECREF(ts);
    Py_XDECREF(rank);
    Py_XDECREF(events);
    PyBuffer_Release(&view);
    if (rc == -2) return NULL; /* a Python error (MemoryError): raised, the caller falls back */
    if (rc) Py_RETURN_NONE;
    return result;
}

#include "walk.h"

static PyMethodDef methods[] = {
    {"chain", native_chain, METH_VARARGS, "chain(buf, n_blocks, block_size, seed) -> list of chained xxh3-64"},
    {"pack_u32", native_pack_u32, METH_VARARGS, "pack_u32(ids, out) -> None: a list of ids into a u32 buffer"},
    {"pack_u64", native_pack_u64, METH_VARARGS, "pack_u64(values, out) -> None: a list of ints into a u64 buffer"},
    {"decode", native_decode, METH_O, "decode(payload) -> (ts, rank, n_events, events) or None"},
    {"walk", native_walk, METH_VARARGS, "walk(hashes, parts, pred, alive, part_mask) -> [(count, dead), ...]"},
    {"spread", native_spread, METH_VARARGS, "spread(drops, n) -> bytes of n native int64 counts"},
    {"walk_spread", native_walk_spread, METH_VARARGS,
     "walk_spread(hashes, parts, pred, alive, part_mask, n) -> spread(walk(...), n) in one pass"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvindex._native", NULL, -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC
PyInit__native(void)
{
    init_tables();
    return PyModule_Create(&module);
}
