/* The slot text parser of fleetx.data: one sample per line, for each slot in order
 * "<count> v1 ... v<count>", tokens separated by ASCII whitespace (space, \t, \r, \v, \f), lines
 * by \n. Blank lines are no samples.
 *
 * Two passes over a chunk of whole lines (the last byte must be \n), both without the GIL:
 *   slot_counts  the structure: each sample's count per slot, and the line it came from;
 *                it stops at the first line whose structure is wrong;
 *   slot_values  the numbers, written straight into one output array per slot (sized by the
 *                caller from the counts); it stops at the first token that is no number.
 * Either reports where it stopped; the caller (parse.py) names the line and what is wrong with
 * the plain Python definition of the format, and skips it or raises.
 *
 * Numbers are read exactly as parse.py's line-by-line parser reads them (a unit test compares
 * the two on random and malformed data): integers [+-]digits within [-2^63, 2^64 - 1], those
 * above 2^63 - 1 keeping their bits as negative int64 (the reference's feasigns are uint64);
 * floats as Python's float() does (strtod in the C locale, correctly rounded to double, then
 * to float32), refusing the hexadecimal and "nan(...)" forms float() refuses.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <locale.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static locale_t c_locale;

static inline int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/* The next token of the line [*p, eol): its bounds in tok/tok_end; 0 when the line is done. */
static inline int next_token(const char **p, const char *eol, const char **tok,
                             const char **tok_end) {
    const char *q = *p;
    while (q < eol && is_space((unsigned char)*q)) q++;
    if (q == eol) {
        *p = q;
        return 0;
    }
    *tok = q;
    while (q < eol && !is_space((unsigned char)*q)) q++;
    *tok_end = q;
    *p = q;
    return 1;
}

static inline int parse_int(const char *p, const char *e, int64_t *out) {
    int neg = 0;
    if (p < e && (*p == '+' || *p == '-')) {
        neg = *p == '-';
        p++;
    }
    if (p == e) return -1;
    uint64_t v = 0;
    for (; p < e; p++) {
        unsigned d = (unsigned)(unsigned char)*p - '0';
        if (d > 9 || v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    if (neg) {
        if (v > (uint64_t)INT64_MAX + 1) return -1;
        *out = (int64_t)(0 - v);
    } else {
        *out = (int64_t)v; /* above 2^63 - 1: the same 64 bits, negative */
    }
    return 0;
}

static inline int parse_float(const char *p, const char *e, float *out) {
    const char *q = p;
    if (q < e && (*q == '+' || *q == '-')) q++;
    if (e - q >= 2 && q[0] == '0' && (q[1] == 'x' || q[1] == 'X')) return -1;
    if (p == e || memchr(p, '(', (size_t)(e - p)) != NULL) return -1;
    char *end;
    double d = strtod_l(p, &end, c_locale);
    if (end != e) return -1;
    *out = (float)d;
    return 0;
}

/* ---- buffers ---------------------------------------------------------------------------- */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
                      const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (itemsize && view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int check_chunk(const Py_buffer *data) {
    if (data->len > 0 && ((const char *)data->buf)[data->len - 1] != '\n') {
        PyErr_SetString(PyExc_ValueError, "a chunk must end with a newline");
        return -1;
    }
    return 0;
}

/* ---- pass 1: structure ------------------------------------------------------------------ */

/* 1: the line [p, eol) is a sample (counts in row); 0: blank; -1: malformed. */
static int line_counts(const char *p, const char *eol, Py_ssize_t nslots,
                       const int64_t *widths, int64_t *row) {
    const char *tok, *tok_end;
    if (!next_token(&p, eol, &tok, &tok_end)) return 0;
    for (Py_ssize_t s = 0; s < nslots; s++) {
        if (s > 0 && !next_token(&p, eol, &tok, &tok_end)) return -1;
        int64_t count;
        if (parse_int(tok, tok_end, &count) < 0 || count < 1) return -1;
        if (widths[s] > 0 && count != widths[s]) return -1;
        for (int64_t k = 0; k < count; k++)
            if (!next_token(&p, eol, &tok, &tok_end)) return -1;
        row[s] = count;
    }
    return next_token(&p, eol, &tok, &tok_end) ? -1 : 1;
}

/* slot_counts(data, widths, counts, lines) -> (samples, stop_line, stop_byte) */
static PyObject *slot_counts(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Py_buffer b[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    const Py_ssize_t sizes[4] = {0, 8, 8, 8};
    int held = 0;
    for (; held < 4; held++)
        if (get_buffer(o[held], &b[held], held >= 2, sizes[held], "slot_counts") < 0) break;
    if (held < 4 || check_chunk(&b[0]) < 0) {
        for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
        return NULL;
    }
    const char *start = b[0].buf, *end = start + b[0].len;
    Py_ssize_t nslots = b[1].len / 8, cap = b[3].len / 8;
    const int64_t *widths = b[1].buf;
    int64_t *counts = b[2].buf, *lines = b[3].buf;
    Py_ssize_t samples = 0, line = 0, stop_line = -1, stop_byte = -1;
    if (b[2].len / 8 < cap * nslots) cap = b[2].len / 8 / (nslots ? nslots : 1);
    Py_BEGIN_ALLOW_THREADS
    for (const char *p = start; p < end; line++) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        int kind = samples < cap ? line_counts(p, eol, nslots, widths, counts + samples * nslots)
                                 : -1;
        if (kind < 0) {
            stop_line = line;
            stop_byte = p - start;
            break;
        }
        if (kind > 0) lines[samples++] = line;
        p = eol + 1;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 4; i++) PyBuffer_Release(&b[i]);
    return Py_BuildValue("nnn", samples, stop_line, stop_byte);
}

/* ---- pass 2: numbers -------------------------------------------------------------------- */

#define MAX_SLOTS 4096

/* slot_values(data, kinds, counts, samples, outs) -> (stop_line, stop_byte) */
static PyObject *slot_values(PyObject *self, PyObject *args) {
    PyObject *data_obj, *counts_obj, *outs;
    const char *kinds;
    Py_ssize_t nkinds, samples;
    if (!PyArg_ParseTuple(args, "Oy#OnO!", &data_obj, &kinds, &nkinds, &counts_obj, &samples,
                          &PyTuple_Type, &outs))
        return NULL;
    if (nkinds > MAX_SLOTS || PyTuple_GET_SIZE(outs) != nkinds) {
        PyErr_SetString(PyExc_ValueError, "slot_values: one output per slot, at most 4096");
        return NULL;
    }
    Py_buffer data, counts, out[64]; /* most data has fewer slots: no allocation */
    Py_buffer *views = nkinds <= 64 ? out : PyMem_Malloc(sizeof(Py_buffer) * (size_t)nkinds);
    Py_ssize_t *cursor = PyMem_Calloc((size_t)(nkinds ? nkinds : 1), sizeof(Py_ssize_t));
    Py_ssize_t held = -2;
    if (views == NULL || cursor == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (get_buffer(data_obj, &data, 0, 0, "slot_values") < 0) goto fail;
    held = -1;
    if (get_buffer(counts_obj, &counts, 0, 8, "slot_values") < 0) goto fail;
    for (held = 0; held < nkinds; held++)
        if (get_buffer(PyTuple_GET_ITEM(outs, held), &views[held], 1,
                       kinds[held] == 'f' ? 4 : 8, "slot_values") < 0)
            goto fail;
    if (check_chunk(&data) < 0) goto fail;
    if (counts.len / 8 < samples * nkinds) {
        PyErr_SetString(PyExc_ValueError, "slot_values: counts is too short");
        goto fail;
    }
    const char *start = data.buf, *end = start + data.len;
    const int64_t *cnt = counts.buf;
    Py_ssize_t line = 0, sample = 0, stop_line = -1, stop_byte = -1;
    Py_BEGIN_ALLOW_THREADS
    for (const char *p = start; p < end && sample < samples; line++) {
        const char *eol = memchr(p, '\n', (size_t)(end - p)), *q = p, *tok, *tok_end;
        int bad = 0;
        if (!next_token(&q, eol, &tok, &tok_end)) {
            p = eol + 1;
            continue; /* blank */
        }
        for (Py_ssize_t s = 0; s < nkinds && !bad; s++) {
            if (s > 0 && !next_token(&q, eol, &tok, &tok_end)) bad = 1;
            int64_t count = cnt[sample * nkinds + s];
            Py_ssize_t room = views[s].len / views[s].itemsize - cursor[s];
            if (bad || count > room) bad = 1;
            for (int64_t k = 0; k < count && !bad; k++) {
                if (!next_token(&q, eol, &tok, &tok_end)) bad = 1;
                else if (kinds[s] == 'f')
                    bad = parse_float(tok, tok_end, (float *)views[s].buf + cursor[s]++) < 0;
                else
                    bad = parse_int(tok, tok_end, (int64_t *)views[s].buf + cursor[s]++) < 0;
            }
        }
        if (bad) {
            stop_line = line;
            stop_byte = p - start;
            break;
        }
        sample++;
        p = eol + 1;
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nkinds; i++) PyBuffer_Release(&views[i]);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&data);
    if (views != out) PyMem_Free(views);
    PyMem_Free(cursor);
    return Py_BuildValue("nn", stop_line, stop_byte);
fail:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    if (held >= 0) PyBuffer_Release(&counts);
    if (held >= -1) PyBuffer_Release(&data);
    if (views != NULL && views != out) PyMem_Free(views);
    PyMem_Free(cursor);
    return NULL;
}

static PyMethodDef methods[] = {
    {"slot_counts", slot_counts, METH_VARARGS,
     "slot_counts(data, widths, counts, lines) -> (samples, stop_line, stop_byte)"},
    {"slot_values", slot_values, METH_VARARGS,
     "slot_values(data, kinds, counts, samples, outs) -> (stop_line, stop_byte)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slots",
                                    "The slot text parser of fleetx.data (see parse.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__slots(void) {
    c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    if (c_locale == (locale_t)0) {
        PyErr_SetString(PyExc_ImportError, "cannot create the C locale");
        return NULL;
    }
    return PyModule_Create(&module);
}
