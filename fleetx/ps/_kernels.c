/* Hot loops of a parameter-server shard: the id -> row hash index, row gathers, segment sums
 * and the per-row update rules.
 *
 * Pure C over the CPython buffer protocol (numpy arrays are passed in; nothing here allocates
 * Python objects per id). Every function has a numpy twin in kernels.py that defines the same
 * result; tests run both. The GIL is released around every loop.
 *
 * Row layout (float32), shared with rules.py:
 *   sgd      [w(dim)]                    momentum > 0: [w(dim) | buf(dim)]
 *   adagrad  [w(dim) | sum(dim)]
 *   adam     [w(dim) | m(dim) | v(dim) | step]
 *   sum      [w(dim)]                    (GEO: w += delta)
 * Index: uint32 slots, (tag << rbits) | row, all ones when empty; int64 row_keys[row] = key;
 * linear probing from a multiply-shift of mix64(key + INDEX_SALT) (see the index section).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INDEX_SALT 0x2545F4914F6CDD1DULL

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Rows are scattered over a slab of hundreds of MB, so a rule is bound by DRAM latency, not
 * arithmetic: ask for the row PREFETCH_AHEAD positions ahead while working on this one. */
#define PREFETCH_AHEAD 8
static inline void prefetch_row(const float *slab, const int64_t *rows, Py_ssize_t i,
                                Py_ssize_t n, Py_ssize_t width) {
    if (i + PREFETCH_AHEAD < n) {
        const char *p = (const char *)(slab + rows[i + PREFETCH_AHEAD] * width);
        for (Py_ssize_t off = 0; off < width * (Py_ssize_t)sizeof(float); off += 64)
            __builtin_prefetch(p + off, 1);
    }
}

/* ---- buffer helpers ------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_buf(PyObject *obj, Buf *b, char kind, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    b->held = 0;
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = (kind == 'i') ? (b->view.itemsize == 8 && (*f == 'q' || *f == 'l'))
           : (kind == 'u') ? (b->view.itemsize == 4 && (*f == 'I' || *f == 'L'))
                           : (b->view.itemsize == 4 && *f == 'f');
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous %s array", what,
                     kind == 'i' ? "int64" : kind == 'u' ? "uint32" : "float32");
        PyBuffer_Release(&b->view);
        b->held = 0;
        return -1;
    }
    return 0;
}

static void release(Buf *b, int n) {
    for (int i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].view);
}

#define LEN(b) ((b).view.len / (b).view.itemsize)
#define I64(b) ((int64_t *)(b).view.buf)
#define F32(b) ((float *)(b).view.buf)

/* ---- index ---------------------------------------------------------------------------- */

/* Slots hold (tag << rbits) | row as uint32, rbits = bit length of the slot count, so a row
 * number always fits; EMPTY (all ones) can never be a slot's value because rows < slot count
 * < 2^rbits - 1. The tag is the low 32 - rbits bits of the key's hash: a probe reads the key
 * (row_keys[row], another cache line) only when the tag matches, so a key costs one slot line
 * and, on average, little more than its own key line. The home slot is a multiply-shift of
 * the hash's high half (any slot count works, not only powers of two). */
#define EMPTY 0xFFFFFFFFu
#define MAX_SLOTS 0x7FFFFFFF

typedef struct {
    uint32_t *slots;
    const int64_t *keys;  /* row_keys: the key of every row */
    uint64_t cap;         /* slot count */
    Py_ssize_t nkeys;     /* rows row_keys holds */
    int rbits;
    uint32_t rmask;
} Index;

static inline uint64_t key_hash(int64_t k) { return mix64((uint64_t)k + INDEX_SALT); }
static inline uint64_t home_of(const Index *ix, uint64_t h) { return ((h >> 32) * ix->cap) >> 32; }
static inline uint32_t tag_of(const Index *ix, uint64_t h) {
    return (uint32_t)((h & ((1ULL << (32 - ix->rbits)) - 1)) << ix->rbits);
}

/* The slot holding k, or the first empty slot of its probe path (*row: -1 then); -1 when every
 * slot was visited without either (a full index that lacks k), -2 for a slot naming a row
 * outside row_keys (a damaged index). Bounded by the slot count, so a full index can never
 * make the loop spin with the GIL released. */
static inline int64_t probe(const Index *ix, int64_t k, uint64_t h, int64_t *row) {
    uint64_t i = home_of(ix, h);
    uint32_t tag = tag_of(ix, h);
    for (uint64_t visited = 0; visited < ix->cap; visited++) {
        uint32_t s = ix->slots[i];
        if (s == EMPTY) { *row = -1; return (int64_t)i; }
        if ((s & ~ix->rmask) == tag) {
            int64_t r = (int64_t)(s & ix->rmask);
            if (r >= ix->nkeys) return -2;
            if (ix->keys[r] == k) { *row = r; return (int64_t)i; }
        }
        if (++i == ix->cap) i = 0;
    }
    return -1;
}

/* A software pipeline over the keys of a call: key j + PIPE is hashed and its home slot
 * requested; the slot of key j + PIPE/2, requested PIPE/2 keys ago, is read and the key of the
 * row it names requested when the tags match; key j is probed. The memory latency of many keys
 * overlaps, and a key costs about one slot line plus, on a match, its own key line. */
#define PIPE 16

static inline void pipeline_start(const Index *ix, const int64_t *keys, Py_ssize_t n,
                                  uint64_t *h) {
    for (Py_ssize_t j = 0; j < PIPE && j < n; j++) {
        h[j] = key_hash(keys[j]);
        __builtin_prefetch(ix->slots + home_of(ix, h[j]));
    }
}

static inline void pipeline_step(const Index *ix, const int64_t *keys, Py_ssize_t n,
                                 Py_ssize_t j, uint64_t *h) {
    Py_ssize_t mid = j + PIPE / 2;
    if (mid < n) {
        uint64_t hm = h[mid % PIPE];
        uint32_t s = ix->slots[home_of(ix, hm)];
        if (s != EMPTY && (s & ~ix->rmask) == tag_of(ix, hm) &&
            (Py_ssize_t)(s & ix->rmask) < ix->nkeys)
            __builtin_prefetch(ix->keys + (s & ix->rmask));
    }
    if (j + PIPE < n) {  /* key j's hash is consumed: its ring place takes key j + PIPE */
        h[j % PIPE] = key_hash(keys[j + PIPE]);
        __builtin_prefetch(ix->slots + home_of(ix, h[j % PIPE]));
    }
}

static int bit_length(uint64_t x) {
    int b = 0;
    while (x) { b++; x >>= 1; }
    return b;
}

/* Checked before any probe: an empty slot array would make every probe fail at once and a
 * slot count past MAX_SLOTS would not leave room for a tag. */
static int make_index(Index *ix, Buf *slots, Buf *keys, const char *fn) {
    Py_ssize_t cap = LEN(*slots);
    if (cap < 1 || cap > MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "%s: slots must hold 1 to %d uint32 entries; got %zd",
                     fn, MAX_SLOTS, cap);
        return -1;
    }
    ix->slots = (uint32_t *)slots->view.buf;
    ix->keys = I64(*keys);
    ix->cap = (uint64_t)cap;
    ix->nkeys = LEN(*keys);
    ix->rbits = bit_length((uint64_t)cap);
    ix->rmask = (uint32_t)((1ULL << ix->rbits) - 1);
    return 0;
}

static PyObject *index_error(const char *fn, int64_t code, Py_ssize_t cap) {
    if (code == -2)
        return PyErr_Format(PyExc_ValueError, "%s: a slot names a row outside row_keys (a "
                            "damaged index)", fn);
    return PyErr_Format(PyExc_ValueError, "%s: the index is full (all %zd slots taken) and a "
                        "key is absent; grow the slots before inserting", fn, cap);
}

/* index_find(slots, row_keys, keys, out_rows) -> number of keys not found (their row is -1) */
static PyObject *index_find(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Buf b[4];
    Index ix;
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    if (get_buf(o[0], &b[0], 'u', 0, "slots") || get_buf(o[1], &b[1], 'i', 0, "row_keys") ||
        get_buf(o[2], &b[2], 'i', 0, "keys") || get_buf(o[3], &b[3], 'i', 1, "out_rows") ||
        make_index(&ix, &b[0], &b[1], "index_find")) {
        release(b, 4);
        return NULL;
    }
    Py_ssize_t n = LEN(b[2]), missing = 0;
    if (LEN(b[3]) < n) {
        release(b, 4);
        return PyErr_Format(PyExc_ValueError, "index_find: out_rows is shorter than keys");
    }
    const int64_t *keys = I64(b[2]);
    int64_t *out = I64(b[3]), err = 0;
    uint64_t h[PIPE];
    Py_BEGIN_ALLOW_THREADS
    pipeline_start(&ix, keys, n, h);
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t hj = h[j % PIPE];
        pipeline_step(&ix, keys, n, j, h);
        int64_t slot = probe(&ix, keys[j], hj, out + j);
        if (slot < 0) { err = slot; break; }
        missing += out[j] < 0;
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    if (err) return index_error("index_find", err, (Py_ssize_t)ix.cap);
    return PyLong_FromSsize_t(missing);
}

/* index_insert(slots, row_keys, keys, out_rows, next_row) -> new next_row.
 * Missing keys get rows next_row, next_row + 1, ... and row_keys[row] = key. Refused (nothing
 * written) unless row_keys and the slots have room for every key to be new; a full index met
 * anyway is an error, not an endless probe. */
static PyObject *index_insert(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Buf b[4];
    long long next_row;
    Index ix;
    if (!PyArg_ParseTuple(args, "OOOOL", &o[0], &o[1], &o[2], &o[3], &next_row)) return NULL;
    if (get_buf(o[0], &b[0], 'u', 1, "slots") || get_buf(o[1], &b[1], 'i', 1, "row_keys") ||
        get_buf(o[2], &b[2], 'i', 0, "keys") || get_buf(o[3], &b[3], 'i', 1, "out_rows") ||
        make_index(&ix, &b[0], &b[1], "index_insert")) {
        release(b, 4);
        return NULL;
    }
    Py_ssize_t n = LEN(b[2]), cap = (Py_ssize_t)ix.cap;
    if (LEN(b[3]) < n || next_row < 0 || next_row + n > ix.nkeys || next_row + n >= cap) {
        release(b, 4);
        return PyErr_Format(PyExc_ValueError, "index_insert: not enough room for %zd keys from "
                            "row %lld (row_keys holds %zd, the slots %zd, out_rows %zd)", n,
                            next_row, ix.nkeys, cap, LEN(b[3]));
    }
    int64_t *row_keys = I64(b[1]), *out = I64(b[3]), nr = next_row, err = 0;
    const int64_t *keys = I64(b[2]);
    uint64_t h[PIPE];
    ix.nkeys = nr;  /* rows past nr are free: no slot may name them */
    Py_BEGIN_ALLOW_THREADS
    pipeline_start(&ix, keys, n, h);
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t hj = h[j % PIPE];
        pipeline_step(&ix, keys, n, j, h);
        int64_t k = keys[j], row, slot = probe(&ix, k, hj, &row);
        if (slot < 0) { err = slot; break; }
        if (row < 0) {
            ix.slots[slot] = tag_of(&ix, hj) | (uint32_t)nr;
            row_keys[nr] = k;
            row = nr++;
            ix.nkeys = nr;
        }
        out[j] = row;
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    if (err) return index_error("index_insert", err, cap);
    return PyLong_FromLongLong(nr);
}

/* index_rebuild(slots, row_keys, n): index rows 0 .. n-1 (distinct keys) in empty slots */
static PyObject *index_rebuild(PyObject *self, PyObject *args) {
    PyObject *o[2];
    Buf b[2];
    Py_ssize_t n;
    Index ix;
    if (!PyArg_ParseTuple(args, "OOn", &o[0], &o[1], &n)) return NULL;
    if (get_buf(o[0], &b[0], 'u', 1, "slots") || get_buf(o[1], &b[1], 'i', 0, "row_keys") ||
        make_index(&ix, &b[0], &b[1], "index_rebuild")) {
        release(b, 2);
        return NULL;
    }
    if (n < 0 || n > ix.nkeys || n >= (Py_ssize_t)ix.cap) {
        release(b, 2);
        return PyErr_Format(PyExc_ValueError, "index_rebuild: %zd rows do not fit (row_keys "
                            "holds %zd, the slots %zd)", n, ix.nkeys, (Py_ssize_t)ix.cap);
    }
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n && !full; r++) {
        uint64_t h = key_hash(ix.keys[r]), i = home_of(&ix, h), visited = 0;
        while (ix.slots[i] != EMPTY && ++visited < ix.cap)
            if (++i == ix.cap) i = 0;
        if (ix.slots[i] != EMPTY) full = 1;
        else ix.slots[i] = tag_of(&ix, h) | (uint32_t)r;
    }
    Py_END_ALLOW_THREADS
    release(b, 2);
    if (full) return index_error("index_rebuild", -1, (Py_ssize_t)ix.cap);
    Py_RETURN_NONE;
}

/* index_remove(slots, row_keys, keys) -> keys removed (absent ones are skipped).
 * Backward-shift deletion: the entries after the freed slot that may move closer to their home
 * slot do, so that no probe path is cut and no tombstone is left. row_keys is only read. */
static PyObject *index_remove(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Buf b[3];
    Index ix;
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    if (get_buf(o[0], &b[0], 'u', 1, "slots") || get_buf(o[1], &b[1], 'i', 0, "row_keys") ||
        get_buf(o[2], &b[2], 'i', 0, "keys") || make_index(&ix, &b[0], &b[1], "index_remove")) {
        release(b, 3);
        return NULL;
    }
    Py_ssize_t n = LEN(b[2]), removed = 0;
    const int64_t *keys = I64(b[2]);
    int64_t err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n && !err; j++) {
        int64_t row, slot = probe(&ix, keys[j], key_hash(keys[j]), &row);
        if (slot < 0) { err = slot; break; }
        if (row < 0) continue;
        uint64_t hole = (uint64_t)slot, i = hole;
        for (;;) {
            if (++i == ix.cap) i = 0;
            uint32_t s = ix.slots[i];
            if (s == EMPTY) break;
            if ((Py_ssize_t)(s & ix.rmask) >= ix.nkeys) { err = -2; break; }
            uint64_t home = home_of(&ix, key_hash(ix.keys[s & ix.rmask]));
            /* s may fill the hole unless its home lies cyclically in (hole, i] */
            int stays = hole < i ? (home > hole && home <= i) : (home > hole || home <= i);
            if (!stays) {
                ix.slots[hole] = s;
                hole = i;
            }
        }
        ix.slots[hole] = EMPTY;
        removed++;
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    if (err) return index_error("index_remove", err, (Py_ssize_t)ix.cap);
    return PyLong_FromSsize_t(removed);
}

/* index_relink(slots, row_keys, keys, rows): the slot of keys[j] names rows[j] from now on
 * (after the caller moved a row; row_keys still holds each key at its old row). */
static PyObject *index_relink(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Buf b[4];
    Index ix;
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    if (get_buf(o[0], &b[0], 'u', 1, "slots") || get_buf(o[1], &b[1], 'i', 0, "row_keys") ||
        get_buf(o[2], &b[2], 'i', 0, "keys") || get_buf(o[3], &b[3], 'i', 0, "rows") ||
        make_index(&ix, &b[0], &b[1], "index_relink")) {
        release(b, 4);
        return NULL;
    }
    Py_ssize_t n = LEN(b[2]);
    const int64_t *keys = I64(b[2]), *rows = I64(b[3]);
    int bad = LEN(b[3]) < n;
    for (Py_ssize_t j = 0; !bad && j < n; j++) bad = rows[j] < 0 || rows[j] >= ix.nkeys;
    if (bad) {
        release(b, 4);
        return PyErr_Format(PyExc_ValueError, "index_relink: rows must be one per key and "
                            "inside row_keys");
    }
    int64_t err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t h = key_hash(keys[j]);
        int64_t row, slot = probe(&ix, keys[j], h, &row);
        if (slot < 0 || row < 0) { err = slot < 0 ? slot : -3; break; }
        ix.slots[slot] = tag_of(&ix, h) | (uint32_t)rows[j];
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    if (err == -3)
        return PyErr_Format(PyExc_KeyError, "index_relink: a key is not in the index");
    if (err) return index_error("index_relink", err, (Py_ssize_t)ix.cap);
    Py_RETURN_NONE;
}

/* ---- rows ----------------------------------------------------------------------------- */

/* gather(slab, width, rows, out, ncols): out[i, :ncols] = slab[rows[i], :ncols] */
static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Buf b[3];
    Py_ssize_t width, ncols;
    if (!PyArg_ParseTuple(args, "OnOOn", &o[0], &width, &o[1], &o[2], &ncols)) return NULL;
    if (get_buf(o[0], &b[0], 'f', 0, "slab") || get_buf(o[1], &b[1], 'i', 0, "rows") ||
        get_buf(o[2], &b[2], 'f', 1, "out")) {
        release(b, 3);
        return NULL;
    }
    Py_ssize_t n = LEN(b[1]), nrows = width > 0 ? LEN(b[0]) / width : 0;
    const int64_t *rows = I64(b[1]);
    int bad = ncols > width || LEN(b[2]) < n * ncols;
    for (Py_ssize_t i = 0; !bad && i < n; i++) bad = rows[i] < 0 || rows[i] >= nrows;
    if (bad) {
        release(b, 3);
        return PyErr_Format(PyExc_IndexError, "gather: row or size out of range");
    }
    const float *slab = F32(b[0]);
    float *out = F32(b[2]);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(slab + rows[i + PREFETCH_AHEAD] * width);
        memcpy(out + i * ncols, slab + rows[i] * width, (size_t)ncols * sizeof(float));
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

/* segment_sum(out, inverse, values, dim): out[inverse[i], :] += values[i, :] */
static PyObject *segment_sum(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Buf b[3];
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OOOn", &o[0], &o[1], &o[2], &dim)) return NULL;
    if (get_buf(o[0], &b[0], 'f', 1, "out") || get_buf(o[1], &b[1], 'i', 0, "inverse") ||
        get_buf(o[2], &b[2], 'f', 0, "values")) {
        release(b, 3);
        return NULL;
    }
    Py_ssize_t n = LEN(b[1]), nout = dim > 0 ? LEN(b[0]) / dim : 0;
    const int64_t *inv = I64(b[1]);
    int bad = dim <= 0 || LEN(b[2]) < n * dim;
    for (Py_ssize_t i = 0; !bad && i < n; i++) bad = inv[i] < 0 || inv[i] >= nout;
    if (bad) {
        release(b, 3);
        return PyErr_Format(PyExc_IndexError, "segment_sum: index or size out of range");
    }
    float *out = F32(b[0]);
    const float *val = F32(b[2]);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        float *dst = out + inv[i] * dim;
        const float *src = val + i * dim;
        for (Py_ssize_t j = 0; j < dim; j++) dst[j] += src[j];
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    Py_RETURN_NONE;
}

/* unique_first(keys, out_uniq, out_inverse) -> number of distinct keys.
 * out_uniq[:count] holds them in order of first occurrence and out_inverse[j] is the position of
 * keys[j] among them. One pass over a private open-addressing table (positions, 4 bytes a slot,
 * a power of two >= 2n slots: it stays in cache for a batch), instead of sorting every key. */
static PyObject *unique_first(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Buf b[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    if (get_buf(o[0], &b[0], 'i', 0, "keys") || get_buf(o[1], &b[1], 'i', 1, "out_uniq") ||
        get_buf(o[2], &b[2], 'i', 1, "out_inverse")) {
        release(b, 3);
        return NULL;
    }
    Py_ssize_t n = LEN(b[0]);
    if (LEN(b[1]) < n || LEN(b[2]) < n || n > 0x3FFFFFFF) {
        release(b, 3);
        return PyErr_Format(PyExc_ValueError, "unique_first: out_uniq and out_inverse must hold "
                            "the %zd keys (at most 2^30)", n);
    }
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap <<= 1;
    int32_t *table = (int32_t *)malloc(cap * sizeof(int32_t));
    if (!table) {
        release(b, 3);
        return PyErr_NoMemory();
    }
    const int64_t *keys = I64(b[0]);
    int64_t *uniq = I64(b[1]), *inv = I64(b[2]);
    int32_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    memset(table, 0xff, cap * sizeof(int32_t));
    uint64_t mask = cap - 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t k = keys[j];
        uint64_t h = key_hash(k) & mask;
        for (;;) {  /* ends: the table is at most half full */
            int32_t u = table[h];
            if (u < 0) {
                table[h] = count;
                uniq[count] = k;
                inv[j] = count++;
                break;
            }
            if (uniq[u] == k) {
                inv[j] = u;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    Py_END_ALLOW_THREADS
    free(table);
    release(b, 3);
    return PyLong_FromLong(count);
}

/* all_finite(values) -> True when no float32 value is NaN or +-inf. Reads the bits (exponent
 * all ones) in blocks the compiler vectorises, stopping at the first block that holds one;
 * no temporary array. */
static PyObject *all_finite(PyObject *self, PyObject *args) {
    PyObject *o;
    Buf b;
    if (!PyArg_ParseTuple(args, "O", &o)) return NULL;
    if (get_buf(o, &b, 'f', 0, "values")) return NULL;
    Py_ssize_t n = LEN(b);
    const uint32_t *v = (const uint32_t *)b.view.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && ok; i += 1024) {
        Py_ssize_t end = i + 1024 < n ? i + 1024 : n;
        uint32_t bad = 0;
        for (Py_ssize_t j = i; j < end; j++) bad |= ((v[j] & 0x7F800000u) == 0x7F800000u);
        ok = !bad;
    }
    Py_END_ALLOW_THREADS
    release(&b, 1);
    return PyBool_FromLong(ok);
}

/* ---- update rules ----------------------------------------------------------------------
 * apply_<rule>(slab, width, rows, grads, dim, <hyper-parameters>): rows must be unique. */

typedef struct {
    Buf b[3];
    float *slab;
    const int64_t *rows;
    const float *grads;
    Py_ssize_t n, width, dim;
} RuleArgs;

static int rule_args(RuleArgs *a, PyObject *slab, Py_ssize_t width, PyObject *rows,
                     PyObject *grads, Py_ssize_t dim, Py_ssize_t state) {
    if (get_buf(slab, &a->b[0], 'f', 1, "slab") || get_buf(rows, &a->b[1], 'i', 0, "rows") ||
        get_buf(grads, &a->b[2], 'f', 0, "grads")) {
        release(a->b, 3);
        return -1;
    }
    a->n = LEN(a->b[1]);
    a->width = width;
    a->dim = dim;
    Py_ssize_t nrows = width > 0 ? LEN(a->b[0]) / width : 0;
    a->rows = I64(a->b[1]);
    int bad = dim <= 0 || dim + state > width || LEN(a->b[2]) < a->n * dim;
    for (Py_ssize_t i = 0; !bad && i < a->n; i++) bad = a->rows[i] < 0 || a->rows[i] >= nrows;
    if (bad) {
        release(a->b, 3);
        PyErr_SetString(PyExc_IndexError, "rule: row, width or gradient size out of range");
        return -1;
    }
    a->slab = F32(a->b[0]);
    a->grads = F32(a->b[2]);
    return 0;
}

static PyObject *apply_sgd(PyObject *self, PyObject *args) {
    PyObject *s, *r, *g;
    Py_ssize_t width, dim;
    double lr, wd, mom;
    int nesterov;
    RuleArgs a;
    if (!PyArg_ParseTuple(args, "OnOOndddp", &s, &width, &r, &g, &dim, &lr, &wd, &mom,
                          &nesterov))
        return NULL;
    if (rule_args(&a, s, width, r, g, dim, mom > 0 ? dim : 0) < 0) return NULL;
    float flr = (float)lr, fwd = (float)wd, fm = (float)mom;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < a.n; i++) {
        prefetch_row(a.slab, a.rows, i, a.n, a.width);
        float *w = a.slab + a.rows[i] * a.width, *buf = w + a.dim;
        const float *gr = a.grads + i * a.dim;
        for (Py_ssize_t j = 0; j < a.dim; j++) {
            float d = gr[j];
            if (fwd != 0.0f) d += fwd * w[j];
            if (fm > 0.0f) {
                buf[j] = fm * buf[j] + d;
                d = nesterov ? d + fm * buf[j] : buf[j];
            }
            w[j] -= flr * d;
        }
    }
    Py_END_ALLOW_THREADS
    release(a.b, 3);
    Py_RETURN_NONE;
}

static PyObject *apply_adagrad(PyObject *self, PyObject *args) {
    PyObject *s, *r, *g;
    Py_ssize_t width, dim;
    double lr, wd, eps;
    RuleArgs a;
    if (!PyArg_ParseTuple(args, "OnOOnddd", &s, &width, &r, &g, &dim, &lr, &wd, &eps))
        return NULL;
    if (rule_args(&a, s, width, r, g, dim, dim) < 0) return NULL;
    float flr = (float)lr, fwd = (float)wd, feps = (float)eps;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < a.n; i++) {
        prefetch_row(a.slab, a.rows, i, a.n, a.width);
        float *w = a.slab + a.rows[i] * a.width, *sum = w + a.dim;
        const float *gr = a.grads + i * a.dim;
        for (Py_ssize_t j = 0; j < a.dim; j++) {
            float d = gr[j];
            if (fwd != 0.0f) d += fwd * w[j];
            sum[j] += d * d;
            w[j] -= flr * d / (sqrtf(sum[j]) + feps);
        }
    }
    Py_END_ALLOW_THREADS
    release(a.b, 3);
    Py_RETURN_NONE;
}

static PyObject *apply_adam(PyObject *self, PyObject *args) {
    PyObject *s, *r, *g;
    Py_ssize_t width, dim;
    double lr, b1, b2, eps, wd;
    int decoupled;
    RuleArgs a;
    if (!PyArg_ParseTuple(args, "OnOOndddddp", &s, &width, &r, &g, &dim, &lr, &b1, &b2, &eps,
                          &wd, &decoupled))
        return NULL;
    if (rule_args(&a, s, width, r, g, dim, 2 * dim + 1) < 0) return NULL;
    /* 1 - beta in double, then rounded: torch passes these as Python floats */
    float fb2 = (float)b2, one_m_b1 = (float)(1.0 - b1), one_m_b2 = (float)(1.0 - b2);
    float feps = (float)eps, fwd = (float)wd;
    float decay = (float)(1.0 - lr * wd), add_wd = decoupled ? 0.0f : fwd;
    double log_b1 = log(b1), log_b2 = log(b2);
    if (!decoupled) decay = 1.0f;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < a.n; i++) {
        prefetch_row(a.slab, a.rows, i, a.n, a.width);
        float *restrict w = a.slab + a.rows[i] * a.width, *restrict m = w + a.dim;
        float *restrict v = m + a.dim, *step = v + a.dim;
        const float *restrict gr = a.grads + i * a.dim;
        *step += 1.0f;
        /* bias corrections in double, as torch computes them from a Python float step;
         * exp(step * log(beta)) == beta ** step up to rounding far below float32's */
        double s = (double)*step, e1 = s * log_b1, e2 = s * log_b2;
        /* past exp(-50), 1 - beta**step is exactly 1.0 in double; skipping exp() there also
         * avoids its slow subnormal path on rows updated thousands of times */
        double bc1 = 1.0 - (b1 > 0 && e1 > -50.0 ? exp(e1) : 0.0);
        double bc2 = 1.0 - (b2 > 0 && e2 > -50.0 ? exp(e2) : 0.0);
        float step_size = (float)(lr / bc1), bc2_sqrt = (float)sqrt(bc2);
        for (Py_ssize_t j = 0; j < a.dim; j++) {
            w[j] *= decay;
            float d = gr[j] + add_wd * w[j];
            m[j] += one_m_b1 * (d - m[j]);
            v[j] = fb2 * v[j] + one_m_b2 * d * d;
            w[j] -= step_size * m[j] / (sqrtf(v[j]) / bc2_sqrt + feps);
        }
    }
    Py_END_ALLOW_THREADS
    release(a.b, 3);
    Py_RETURN_NONE;
}

static PyObject *apply_sum(PyObject *self, PyObject *args) {
    PyObject *s, *r, *g;
    Py_ssize_t width, dim;
    RuleArgs a;
    if (!PyArg_ParseTuple(args, "OnOOn", &s, &width, &r, &g, &dim)) return NULL;
    if (rule_args(&a, s, width, r, g, dim, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < a.n; i++) {
        float *w = a.slab + a.rows[i] * a.width;
        const float *gr = a.grads + i * a.dim;
        for (Py_ssize_t j = 0; j < a.dim; j++) w[j] += gr[j];
    }
    Py_END_ALLOW_THREADS
    release(a.b, 3);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"index_find", index_find, METH_VARARGS,
     "index_find(slots, row_keys, keys, out_rows) -> missing"},
    {"index_insert", index_insert, METH_VARARGS,
     "index_insert(slots, row_keys, keys, out_rows, next_row) -> next_row"},
    {"index_rebuild", index_rebuild, METH_VARARGS, "index_rebuild(slots, row_keys, n)"},
    {"index_remove", index_remove, METH_VARARGS, "index_remove(slots, row_keys, keys) -> removed"},
    {"index_relink", index_relink, METH_VARARGS, "index_relink(slots, row_keys, keys, rows)"},
    {"gather", gather, METH_VARARGS, "gather(slab, width, rows, out, ncols)"},
    {"segment_sum", segment_sum, METH_VARARGS, "segment_sum(out, inverse, values, dim)"},
    {"unique_first", unique_first, METH_VARARGS,
     "unique_first(keys, out_uniq, out_inverse) -> count"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(values) -> bool"},
    {"apply_sgd", apply_sgd, METH_VARARGS,
     "apply_sgd(slab, width, rows, grads, dim, lr, weight_decay, momentum, nesterov)"},
    {"apply_adagrad", apply_adagrad, METH_VARARGS,
     "apply_adagrad(slab, width, rows, grads, dim, lr, weight_decay, eps)"},
    {"apply_adam", apply_adam, METH_VARARGS,
     "apply_adam(slab, width, rows, grads, dim, lr, beta1, beta2, eps, weight_decay, "
     "decoupled)"},
    {"apply_sum", apply_sum, METH_VARARGS, "apply_sum(slab, width, rows, grads, dim)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "C loops of a parameter-server shard", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
