/* kvindex._native's lookup half (included by native.c): the index's mask walk and its spread onto slots, the
 * two loops a lookup over a thousand workers spends its time in (issue 45).  Unlike decode, these read only the
 * index's own structures (lists of dicts of Python ints), never bytes from the wire; they still check every
 * type they are handed and fail with a Python exception, never a crash.  kvindex/index.py keeps the pure
 * paths, and tests/unit/test_kvindex_native_walk.py checks both against each other.
 */
/* walk(hashes, parts, pred, alive, part_mask) -> list[(count, dead)]
 *     KvIndex._walk in C: per chain hash h (any iterable of ints, consumed lazily, so a walk that stops early
 *     does not pull the rest), the holders' mask parts[h & part_mask].get(h, 0) (OR pred[...] when pred is not
 *     None), ANDed into `alive`; where the mask drops slots, (blocks held so far, the dropped slots' bits), a
 *     zero count left out; stops when no slot is left, else ends with (blocks walked, alive).  The masks stay
 *     Python ints: the same objects and the same arithmetic as the pure path, done without the interpreter.
 */
static PyObject *
walk_fail(PyObject *it, PyObject *drops, PyObject *alive)
{
    Py_XDECREF(it);
    Py_XDECREF(drops);
    Py_XDECREF(alive);
    return NULL;
}

static int
walk_drop(PyObject *drops, Py_ssize_t count, PyObject *dead)
{
    PyObject *c = PyLong_FromSsize_t(count);
    if (c == NULL)
        return -1;
    PyObject *t = PyTuple_New(2);
    if (t == NULL) {
        Py_DECREF(c);
        return -1;
    }
    Py_INCREF(dead);
    PyTuple_SET_ITEM(t, 0, c);
    PyTuple_SET_ITEM(t, 1, dead);
    int r = PyList_Append(drops, t);
    Py_DECREF(t);
    return r;
}

/* what both walks check of the index's structures: parts a list of dicts, pred None or one as long, the
 * part mask within parts; -1 with the exception set */
static int
walk_args_ok(PyObject *parts, PyObject *pred, unsigned long long part_mask)
{
    Py_ssize_t nparts = PyList_GET_SIZE(parts);
    if (pred != Py_None && (!PyList_Check(pred) || PyList_GET_SIZE(pred) != nparts)) {
        PyErr_SetString(PyExc_TypeError, "walk: pred must be None or a list as long as parts");
        return -1;
    }
    if ((unsigned long long)nparts <= part_mask) {
        PyErr_SetString(PyExc_ValueError, "walk: part_mask reaches past parts");
        return -1;
    }
    for (Py_ssize_t p = 0; p < nparts; p++) {
        if (!PyDict_CheckExact(PyList_GET_ITEM(parts, p))
            || (pred != Py_None && !PyDict_CheckExact(PyList_GET_ITEM(pred, p)))) {
            PyErr_SetString(PyExc_TypeError, "walk: parts and pred must hold dicts");
            return -1;
        }
    }
    return 0;
}

/* the holders' masks of block hash h, borrowed from the index's dicts (NULL: none): parts[h & part_mask].get(h)
 * and, when pred is not None, pred's alike; -1 with the exception set. The hashes' iterator runs Python code
 * (a lazily hashed prompt): what it could have changed is checked again here, per hash */
static int
walk_masks(PyObject *h, PyObject *parts, PyObject *pred, unsigned long long part_mask, PyObject **m,
           PyObject **pm)
{
    *m = *pm = NULL;
    if (!PyLong_Check(h)) {
        PyErr_SetString(PyExc_TypeError, "walk: a hash is not an int");
        return -1;
    }
    unsigned long long hv = PyLong_AsUnsignedLongLongMask(h);
    if (hv == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    Py_ssize_t p = (Py_ssize_t)(hv & part_mask);
    if (p >= PyList_GET_SIZE(parts) || (pred != Py_None && p >= PyList_GET_SIZE(pred))) {
        PyErr_SetString(PyExc_ValueError, "walk: parts changed during the walk");
        return -1;
    }
    *m = PyDict_GetItemWithError(PyList_GET_ITEM(parts, p), h);
    if (*m == NULL && PyErr_Occurred())
        return -1;
    if (pred != Py_None) {
        *pm = PyDict_GetItemWithError(PyList_GET_ITEM(pred, p), h);
        if (*pm == NULL && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static PyObject *
native_walk(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *hashes, *parts, *pred, *alive0;
    unsigned long long part_mask;
    if (!PyArg_ParseTuple(args, "OO!OO!K", &hashes, &PyList_Type, &parts, &pred, &PyLong_Type, &alive0,
                          &part_mask))
        return NULL;
    if (walk_args_ok(parts, pred, part_mask) < 0)
        return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL)
        return NULL;
    PyObject *drops = PyList_New(0);
    if (drops == NULL)
        return walk_fail(it, NULL, NULL);
    PyObject *alive = alive0;
    Py_INCREF(alive);
    Py_ssize_t i = 0;
    PyObject *h;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *m, *pm; /* borrowed */
        if (walk_masks(h, parts, pred, part_mask, &m, &pm) < 0) {
            Py_DECREF(h);
            return walk_fail(it, drops, alive);
        }
        PyObject *held; /* new reference, or NULL for 0 */
        if (pred != Py_None) {
            if (m != NULL && pm != NULL)
                held = PyNumber_Or(m, pm);
            else {
                held = m != NULL ? m : pm;
                Py_XINCREF(held);
            }
            if (held == NULL && PyErr_Occurred()) {
                Py_DECREF(h);
                return walk_fail(it, drops, alive);
            }
        } else {
            held = m;
            Py_XINCREF(held);
        }
        Py_DECREF(h);
        PyObject *masked = held != NULL ? PyNumber_And(held, alive) : PyLong_FromLong(0);
        Py_XDECREF(held);
        if (masked == NULL)
            return walk_fail(it, drops, alive);
        int ne = PyObject_RichCompareBool(masked, alive, Py_NE);
        if (ne < 0) {
            Py_DECREF(masked);
            return walk_fail(it, drops, alive);
        }
        if (ne) {
            if (i) {
                PyObject *dead = PyNumber_Xor(alive, masked);
                if (dead == NULL || walk_drop(drops, i, dead) < 0) {
                    Py_XDECREF(dead);
                    Py_DECREF(masked);
                    return walk_fail(it, drops, alive);
                }
                Py_DECREF(dead);
            }
            Py_DECREF(alive);
            alive = masked;
            int any = PyObject_IsTrue(alive);
            if (any < 0)
                return walk_fail(it, drops, alive);
            if (!any) {
                Py_DECREF(it);
                Py_DECREF(alive);
                return drops;
            }
        } else {
            Py_DECREF(masked);
        }
        i++;
    }
    if (PyErr_Occurred())
        return walk_fail(it, drops, alive);
    Py_DECREF(it);
    if (i > 0 && walk_drop(drops, i, alive) < 0)
        return walk_fail(NULL, drops, alive);
    Py_DECREF(alive);
    return drops;
}

/* the index of the lowest set bit of w (w != 0) */
static inline int
lowest_bit(uint64_t w)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(w);
#else
    int b = 0;
    while (!(w & 1)) {
        w >>= 1;
        b++;
    }
    return b;
#endif
}

/* n zeroed native int64 counts in a new bytes object (a spread's answer); NULL and ValueError for a bad n */
static PyObject *
new_counts(Py_ssize_t n, int64_t **counts)
{
    if (n < 0 || n > (PY_SSIZE_T_MAX / 8) - 8) {
        PyErr_SetString(PyExc_ValueError, "spread: bad slot count");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    *counts = (int64_t *)PyBytes_AS_STRING(out);
    memset(*counts, 0, (size_t)n * sizeof(int64_t));
    return out;
}

/* spread(drops, n) -> bytes
 *     index._spread in C: n native int64 counts, slot b's the count of the drop whose mask has bit b (the
 *     drops' masks are disjoint; a later drop wins, as the pure path's assignment), 0 for none.  Bits at or
 *     past n are ignored; a negative mask or count is a ValueError.
 */
static PyObject *
native_spread(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *drops;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &drops, &n))
        return NULL;
    int64_t *counts;
    PyObject *out = new_counts(n, &counts);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(drops); k++) {
        PyObject *d = PyList_GET_ITEM(drops, k);
        if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 2 || !PyLong_Check(PyTuple_GET_ITEM(d, 0))
            || !PyLong_Check(PyTuple_GET_ITEM(d, 1))) {
            PyErr_SetString(PyExc_TypeError, "spread: a drop is not (int, int)");
            goto fail;
        }
        long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(d, 0));
        if (count == -1 && PyErr_Occurred())
            goto fail;
        PyObject *mask = PyTuple_GET_ITEM(d, 1);
        if (_PyLong_Sign(mask) < 0 || count < 0) {
            PyErr_SetString(PyExc_ValueError, "spread: a negative count or mask");
            goto fail;
        }
        /* the mask's set bits, digit by digit, straight from the int (no byte copy: a thousand-slot mask was
           125 bytes converted per drop, 60% of a spread); bits at or past n are ignored */
        Py_ssize_t nd;
        const digit *dg = long_digits(mask, &nd);
        for (Py_ssize_t j = 0; j < nd; j++) {
            uint64_t w = (uint64_t)dg[j];
            size_t base = (size_t)j * PyLong_SHIFT;
            if (base >= (size_t)n)
                break;
            while (w) {
                size_t slot = base + (size_t)lowest_bit(w);
                if (slot < (size_t)n)
                    counts[slot] = (int64_t)count;
                w &= w - 1;
            }
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* walk_spread(hashes, parts, pred, alive, part_mask, n) -> bytes
 *     spread(walk(hashes, parts, pred, alive, part_mask), n) in one pass, with no Python int made on the way:
 *     `alive` is copied into C digits once, each block's mask is ANDed into them digit by digit (only the
 *     digits still alive), and each slot that drops out gets the blocks held so far written straight into
 *     the counts (the slots left at the end, the blocks walked).  The walk made an `alive & mask` int per
 *     block and an `alive ^ masked` int per drop, and the spread read each drop back from its bytes: at a
 *     thousand workers and 1,024 blocks the two cost a shard's answer 1.6M of its 1.9M instructions.
 */
static PyObject *
native_walk_spread(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *hashes, *parts, *pred, *alive0;
    unsigned long long part_mask;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO!OO!Kn", &hashes, &PyList_Type, &parts, &pred, &PyLong_Type, &alive0,
                          &part_mask, &n))
        return NULL;
    if (walk_args_ok(parts, pred, part_mask) < 0)
        return NULL;
    if (_PyLong_Sign(alive0) < 0) {
        PyErr_SetString(PyExc_ValueError, "walk: a negative mask");
        return NULL;
    }
    int64_t *counts;
    PyObject *out = new_counts(n, &counts);
    if (out == NULL)
        return NULL;
    Py_ssize_t nd;
    const digit *a0 = long_digits(alive0, &nd);
    /* only the digits that hold slots below n matter (bits past n are dropped, as spread drops them) */
    Py_ssize_t nd_n = (Py_ssize_t)(((size_t)n + PyLong_SHIFT - 1) / PyLong_SHIFT);
    if (nd > nd_n)
        nd = nd_n;
    digit *alive = PyMem_Malloc((size_t)(nd ? nd : 1) * sizeof(digit));
    if (alive == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    Py_ssize_t lo = 0, hi = nd; /* the digits [lo, hi) that may still hold a live slot */
    for (Py_ssize_t j = 0; j < nd; j++)
        alive[j] = a0[j];
    if (nd > 0 && nd == nd_n && n % PyLong_SHIFT) /* no slot at or past n */
        alive[nd - 1] &= (digit)(((digit)1 << (n % PyLong_SHIFT)) - 1);
    while (lo < hi && alive[lo] == 0)
        lo++;
    while (hi > lo && alive[hi - 1] == 0)
        hi--;
    if (lo == hi) { /* nothing alive: no walk, all zeros (the pure walk would still consume the hashes) */
        PyMem_Free(alive);
        return out;
    }
    PyObject *it = PyObject_GetIter(hashes);
    if (it == NULL)
        goto fail;
    Py_ssize_t i = 0;
    PyObject *h;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *m, *pm; /* borrowed */
        if (walk_masks(h, parts, pred, part_mask, &m, &pm) < 0) {
            Py_DECREF(h);
            goto fail_it;
        }
        Py_DECREF(h);
        if ((m != NULL && (!PyLong_Check(m) || _PyLong_Sign(m) < 0))
            || (pm != NULL && (!PyLong_Check(pm) || _PyLong_Sign(pm) < 0))) {
            PyErr_SetString(PyExc_TypeError, "walk: a mask is not a non-negative int");
            goto fail_it;
        }
        Py_ssize_t md = 0, pd = 0;
        const digit *mg = m != NULL ? long_digits(m, &md) : NULL;
        const digit *pg = pm != NULL ? long_digits(pm, &pd) : NULL;
        if (pg == NULL && mg != NULL && md >= hi) { /* the usual block: one mask covering every live digit */
            digit gone = 0;
            for (Py_ssize_t j = lo; j < hi; j++)
                gone |= alive[j] & ~mg[j];
            if (!gone) { /* nothing drops at this block */
                i++;
                continue;
            }
        }
        for (Py_ssize_t j = lo; j < hi; j++) {
            digit held = (j < md ? mg[j] : 0) | (j < pd ? pg[j] : 0);
            digit now = alive[j] & held;
            if (now != alive[j]) {
                if (i) { /* the dropped slots held the i blocks before this one (a zero count is left out) */
                    uint64_t dead = (uint64_t)(alive[j] & ~now);
                    size_t base = (size_t)j * PyLong_SHIFT;
                    while (dead) {
                        counts[base + (size_t)lowest_bit(dead)] = (int64_t)i;
                        dead &= dead - 1;
                    }
                }
                alive[j] = now;
            }
        }
        while (lo < hi && alive[lo] == 0)
            lo++;
        while (hi > lo && alive[hi - 1] == 0)
            hi--;
        i++;
        if (lo == hi)
            break; /* no slot left: the walk stops here */
    }
    if (PyErr_Occurred())
        goto fail_it;
    Py_DECREF(it);
    for (Py_ssize_t j = lo; j < hi; j++) { /* the slots that held every block walked */
        uint64_t live = (uint64_t)alive[j];
        size_t base = (size_t)j * PyLong_SHIFT;
        while (live) {
            counts[base + (size_t)lowest_bit(live)] = (int64_t)i;
            live &= live - 1;
        }
    }
    PyMem_Free(alive);
    return out;
fail_it:
    Py_DECREF(it);
fail:
    PyMem_Free(alive);
    Py_DECREF(out);
    return NULL;
}
