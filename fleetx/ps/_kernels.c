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
 * Index: int64 slots[2 * cap], pairs (key, row); row == -1 marks an empty slot; cap is a
 * power of two; linear probing from mix64(key + INDEX_SALT) & (cap - 1).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
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
                           : (b->view.itemsize == 4 && *f == 'f');
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous %s array", what,
                     kind == 'i' ? "int64" : "float32");
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

/* Checked before any probe: an empty slots array would make mask = 2^64 - 1 (reads far out of
 * bounds) and a capacity that is not a power of two would skip slots. */
static int check_slots(Py_ssize_t len, const char *fn) {
    Py_ssize_t cap = len / 2;
    if (len < 2 || len % 2 || (cap & (cap - 1))) {
        PyErr_Format(PyExc_ValueError, "%s: slots must hold 2 * capacity int64 entries with the "
                     "capacity a power of two >= 1; got %zd entries", fn, len);
        return -1;
    }
    return 0;
}

/* The one probe loop of the index: the slot holding key k, or the first empty slot on its
 * probe path (the caller tells them apart by the slot's row, -1 when empty). Returns -1 when
 * every slot was visited without either: a full table that lacks k. Bounding the loop by the
 * capacity is what keeps a full table from spinning forever with the GIL released. */
static inline int64_t probe(const int64_t *slots, uint64_t mask, int64_t k) {
    uint64_t h = mix64((uint64_t)k + INDEX_SALT) & mask;
    for (uint64_t visited = 0; visited <= mask; visited++, h = (h + 1) & mask)
        if (slots[2 * h + 1] < 0 || slots[2 * h] == k) return (int64_t)h;
    return -1;
}

static PyObject *index_full(const char *fn, Py_ssize_t cap) {
    return PyErr_Format(PyExc_ValueError, "%s: the index is full (all %zd slots taken) and a key "
                        "is absent; grow the slots before inserting", fn, cap);
}

/* index_find(slots, keys, out_rows) -> number of keys not found (their row is -1) */
static PyObject *index_find(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Buf b[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    if (get_buf(o[0], &b[0], 'i', 0, "slots") || get_buf(o[1], &b[1], 'i', 0, "keys") ||
        get_buf(o[2], &b[2], 'i', 1, "out_rows") || check_slots(LEN(b[0]), "index_find")) {
        release(b, 3);
        return NULL;
    }
    Py_ssize_t n = LEN(b[1]), cap = LEN(b[0]) / 2;
    uint64_t mask = (uint64_t)cap - 1;
    if (LEN(b[2]) < n) {
        release(b, 3);
        return PyErr_Format(PyExc_ValueError, "index_find: out_rows is shorter than keys");
    }
    const int64_t *slots = I64(b[0]), *keys = I64(b[1]);
    int64_t *out = I64(b[2]);
    Py_ssize_t missing = 0;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t h = probe(slots, mask, keys[i]);
        if (h < 0) { full = 1; break; }
        out[i] = slots[2 * h + 1];
        missing += out[i] < 0;
    }
    Py_END_ALLOW_THREADS
    release(b, 3);
    if (full) return index_full("index_find", cap);
    return PyLong_FromSsize_t(missing);
}

/* index_insert(slots, row_keys, keys, out_rows, next_row) -> new next_row.
 * Missing keys get rows next_row, next_row + 1, ... and row_keys[row] = key. Refused (nothing
 * written) unless row_keys and the slots have room for every key to be new; a full table met
 * anyway (slots that hold more keys than next_row says) is an error, not an endless probe. */
static PyObject *index_insert(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Buf b[4];
    long long next_row;
    if (!PyArg_ParseTuple(args, "OOOOL", &o[0], &o[1], &o[2], &o[3], &next_row)) return NULL;
    if (get_buf(o[0], &b[0], 'i', 1, "slots") || get_buf(o[1], &b[1], 'i', 1, "row_keys") ||
        get_buf(o[2], &b[2], 'i', 0, "keys") || get_buf(o[3], &b[3], 'i', 1, "out_rows") ||
        check_slots(LEN(b[0]), "index_insert")) {
        release(b, 4);
        return NULL;
    }
    Py_ssize_t n = LEN(b[2]);
    Py_ssize_t cap = LEN(b[0]) / 2, rk = LEN(b[1]);
    if (LEN(b[3]) < n || next_row < 0 || next_row + n > rk || next_row + n > cap) {
        release(b, 4);
        return PyErr_Format(PyExc_ValueError, "index_insert: not enough room for %zd keys from "
                            "row %lld (row_keys holds %zd, the slots %zd, out_rows %zd)", n,
                            next_row, rk, cap, LEN(b[3]));
    }
    uint64_t mask = (uint64_t)cap - 1;
    int64_t *slots = I64(b[0]), *row_keys = I64(b[1]), *out = I64(b[3]);
    const int64_t *keys = I64(b[2]);
    int64_t nr = next_row;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = keys[i], h = probe(slots, mask, k);
        if (h < 0) { full = 1; break; }
        if (slots[2 * h + 1] < 0) {
            slots[2 * h] = k;
            slots[2 * h + 1] = nr;
            row_keys[nr] = k;
            nr++;
        }
        out[i] = slots[2 * h + 1];
    }
    Py_END_ALLOW_THREADS
    release(b, 4);
    if (full) return index_full("index_insert", cap);
    return PyLong_FromLongLong(nr);
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
    {"index_find", index_find, METH_VARARGS, "index_find(slots, keys, out_rows) -> missing"},
    {"index_insert", index_insert, METH_VARARGS,
     "index_insert(slots, row_keys, keys, out_rows, next_row) -> next_row"},
    {"gather", gather, METH_VARARGS, "gather(slab, width, rows, out, ncols)"},
    {"segment_sum", segment_sum, METH_VARARGS, "segment_sum(out, inverse, values, dim)"},
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
