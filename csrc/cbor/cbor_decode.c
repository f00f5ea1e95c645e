/* sdcp_fast.core._cbor_c: the strict CBOR decoder's fast path (sdcp_fast/core/cbor.py).
 *
 * decode(data, max_depth, max_items) -> the decoded item, or raises Fallback.
 *
 * It takes the input the Python reader (cbor._Reader) accepts in the shapes SDCP uses:
 * unsigned and negative integers (negative ones down to -2**63), byte and text strings
 * (strict UTF-8), arrays, maps keyed by int, text or bytes, false, true and null, within the
 * same limits (an item deeper than max_depth, more than max_items items in all, a count
 * larger than the bytes left). Every item it returns is the one the Python reader returns
 * for the same input, of the same type. Anything else - each error, and the rare shapes it
 * leaves out (floats, boolean map keys, a negative integer below -2**63) - raises Fallback
 * and nothing else: the Python reader then decodes the input again and gives its answer,
 * its value or its DecodeError, so what a caller sees never depends on this module.
 *
 * Work is bounded as in the Python reader: a declared length or count is checked against
 * the bytes left before anything is allocated for it, and recursion is bounded by max_depth.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *Fallback;

typedef struct {
    const unsigned char *data;
    Py_ssize_t size;
    Py_ssize_t pos;
    int max_depth;
    long long items_left;
} Reader;

static PyObject *fall_back(void) {
    PyErr_SetNone(Fallback);
    return NULL;
}

/* The argument of a head with additional information `info` (0..27); -1 when cut short,
 * or for 28..31 (reserved, indefinite). */
static int argument(Reader *r, int info, uint64_t *out) {
    int size;
    if (info < 24) {
        *out = (uint64_t)info;
        return 0;
    }
    switch (info) {
    case 24: size = 1; break;
    case 25: size = 2; break;
    case 26: size = 4; break;
    case 27: size = 8; break;
    default: return -1;
    }
    if (r->size - r->pos < size) return -1;
    uint64_t value = 0;
    for (int i = 0; i < size; i++) value = (value << 8) | r->data[r->pos + i];
    r->pos += size;
    *out = value;
    return 0;
}

static PyObject *item(Reader *r, int depth);

static PyObject *array(Reader *r, uint64_t count, int depth) {
    /* every item takes at least one byte, and counts as one */
    if (count > (uint64_t)(r->size - r->pos) || (long long)count > r->items_left) return fall_back();
    if (count && depth > r->max_depth) return fall_back();
    PyObject *list = PyList_New((Py_ssize_t)count);
    if (list == NULL) return NULL;
    for (Py_ssize_t n = 0; n < (Py_ssize_t)count; n++) {
        PyObject *x = item(r, depth);
        if (x == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, n, x);
    }
    return list;
}

static PyObject *map(Reader *r, uint64_t count, int depth) {
    /* every entry takes at least two bytes, and counts as two items */
    if (count > (uint64_t)(r->size - r->pos) / 2 || (long long)(count * 2) > r->items_left) return fall_back();
    PyObject *dict = PyDict_New();
    if (dict == NULL) return NULL;
    for (uint64_t n = 0; n < count; n++) {
        PyObject *key = item(r, depth);
        if (key == NULL) goto fail;
        /* int (not bool: the Python reader takes those, here they fall back), text, bytes */
        if (!(PyLong_CheckExact(key) || PyUnicode_CheckExact(key) || PyBytes_CheckExact(key))) {
            Py_DECREF(key);
            fall_back();
            goto fail;
        }
        int seen = PyDict_Contains(dict, key);
        if (seen != 0) {   /* a duplicate key (or an error hashing it) */
            Py_DECREF(key);
            if (seen < 0) PyErr_Clear();
            fall_back();
            goto fail;
        }
        PyObject *value = item(r, depth);
        if (value == NULL) {
            Py_DECREF(key);
            goto fail;
        }
        int stored = PyDict_SetItem(dict, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (stored < 0) goto fail;
    }
    return dict;
fail:
    Py_DECREF(dict);
    return NULL;
}

static PyObject *item(Reader *r, int depth) {
    if (depth > r->max_depth || --r->items_left < 0 || r->pos >= r->size) return fall_back();
    unsigned char initial = r->data[r->pos++];
    int major = initial >> 5, info = initial & 0x1F;
    if (major == 7) {
        switch (info) {
        case 20: Py_RETURN_FALSE;
        case 21: Py_RETURN_TRUE;
        case 22: Py_RETURN_NONE;
        default: return fall_back();   /* floats, undefined, other simple values, break */
        }
    }
    uint64_t value;
    if (argument(r, info, &value) < 0) return fall_back();
    switch (major) {
    case 0:
        return PyLong_FromUnsignedLongLong(value);
    case 1:
        if (value > (uint64_t)INT64_MAX) return fall_back();
        return PyLong_FromLongLong(-1 - (long long)value);
    case 2:
    case 3: {
        if (value > (uint64_t)(r->size - r->pos)) return fall_back();
        const char *start = (const char *)r->data + r->pos;
        r->pos += (Py_ssize_t)value;
        if (major == 2) return PyBytes_FromStringAndSize(start, (Py_ssize_t)value);
        PyObject *text = PyUnicode_DecodeUTF8(start, (Py_ssize_t)value, "strict");
        if (text == NULL) {
            PyErr_Clear();
            return fall_back();
        }
        return text;
    }
    case 4:
        return array(r, value, depth + 1);
    case 5:
        return map(r, value, depth + 1);
    default:
        return fall_back();   /* tags */
    }
}

static PyObject *decode(PyObject *module, PyObject *args) {
    Py_buffer buffer;
    int max_depth;
    long long max_items;
    if (!PyArg_ParseTuple(args, "y*iL:decode", &buffer, &max_depth, &max_items)) return NULL;
    Reader r = {(const unsigned char *)buffer.buf, buffer.len, 0, max_depth, max_items};
    PyObject *out = NULL;
    if (r.size == 0) {
        fall_back();
    } else {
        out = item(&r, 0);
        if (out != NULL && r.pos != r.size) {   /* trailing bytes */
            Py_CLEAR(out);
            fall_back();
        }
    }
    PyBuffer_Release(&buffer);
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, max_depth, max_items): one CBOR item, or Fallback (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_cbor_c",
    "The strict CBOR decoder's fast path (sdcp_fast/core/cbor.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__cbor_c(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Fallback = PyErr_NewException("sdcp_fast.core._cbor_c.Fallback", NULL, NULL);
    if (Fallback == NULL || PyModule_AddObjectRef(module, "Fallback", Fallback) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
