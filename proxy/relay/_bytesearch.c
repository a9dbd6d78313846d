/* bytes.find and bytes.rfind for exact bytes, called as plain functions: sse.FIND's and
 * sse.RFIND's contract (proxy/relay/sse.py), written again in C for the compiled build.
 *
 * Why: compiled by mypyc, ``data.find(sub, start, end)`` is a method call by name: the method
 * looked up on the type, its arguments packed in a tuple and parsed back by a format string
 * (PyArg_ParseTuple), about 1,500 instructions a call where the search itself is a few dozen
 * (callgrind). An eligible stream's first events and every event split from a read search
 * a few times each; here a call is a vectorcall, two type checks and memchr or memmem.
 *
 * find(data, sub[, start[, end]]) -> int     as data.find(sub, start, end)
 * rfind(data, sub[, start[, end]]) -> int    as data.rfind(sub, start, end)
 * data and sub exact bytes (anything else is a TypeError); start and end as Python takes them
 * (negative from the end, clipped to the bytes), tests/test_bytesearch.py holds the two to the
 * same results.
 */
#define _GNU_SOURCE /* memmem, memrchr */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* The arguments and the window [*start, *end) they name, as bytes.find adjusts its indices
 * (ADJUST_INDICES in CPython's Objects/bytes_methods.c). 0, or -1 with an exception set. */
static int
window(PyObject *const *args, Py_ssize_t nargs, const char *name, const char **d,
       Py_ssize_t *n, const char **s, Py_ssize_t *m, Py_ssize_t *start, Py_ssize_t *end)
{
    if (nargs < 2 || nargs > 4) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 to 4 arguments", name);
        return -1;
    }
    if (!PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: data and sub are bytes", name);
        return -1;
    }
    *d = PyBytes_AS_STRING(args[0]);
    *n = PyBytes_GET_SIZE(args[0]);
    *s = PyBytes_AS_STRING(args[1]);
    *m = PyBytes_GET_SIZE(args[1]);
    Py_ssize_t a = 0, b = PY_SSIZE_T_MAX;
    /* A NULL error argument clips an int beyond Py_ssize_t, as Python's slice indices do. */
    if (nargs > 2 && args[2] != Py_None) {
        a = PyNumber_AsSsize_t(args[2], NULL);
        if (a == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if (nargs > 3 && args[3] != Py_None) {
        b = PyNumber_AsSsize_t(args[3], NULL);
        if (b == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if (b > *n) {
        b = *n;
    }
    else if (b < 0) {
        b += *n;
        if (b < 0) {
            b = 0;
        }
    }
    if (a < 0) {
        a += *n;
        if (a < 0) {
            a = 0;
        }
    }
    *start = a;
    *end = b;
    return 0;
}

static PyObject *
find(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    const char *d, *s;
    Py_ssize_t n, m, start, end;
    if (window(args, nargs, "find", &d, &n, &s, &m, &start, &end) < 0) {
        return NULL;
    }
    if (end - start < m) {
        return PyLong_FromLong(-1);
    }
    if (m == 0) {
        return PyLong_FromSsize_t(start);
    }
    const char *at;
    if (m == 1) {
        at = memchr(d + start, s[0], (size_t)(end - start));
    }
    else {
        at = memmem(d + start, (size_t)(end - start), s, (size_t)m);
    }
    return PyLong_FromSsize_t(at == NULL ? -1 : at - d);
}

static PyObject *
rfind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    const char *d, *s;
    Py_ssize_t n, m, start, end;
    if (window(args, nargs, "rfind", &d, &n, &s, &m, &start, &end) < 0) {
        return NULL;
    }
    if (end - start < m) {
        return PyLong_FromLong(-1);
    }
    if (m == 0) {
        return PyLong_FromSsize_t(end);
    }
    /* The last place the first byte could start a match, then back one candidate at a time. */
    Py_ssize_t last = end - m; /* >= start */
    while (1) {
        const char *at = memrchr(d + start, s[0], (size_t)(last - start + 1));
        if (at == NULL) {
            return PyLong_FromLong(-1);
        }
        Py_ssize_t i = at - d;
        if (memcmp(at + 1, s + 1, (size_t)(m - 1)) == 0) {
            return PyLong_FromSsize_t(i);
        }
        if (i == start) {
            return PyLong_FromLong(-1);
        }
        last = i - 1;
    }
}

static PyMethodDef methods[] = {
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "find(data, sub[, start[, end]]) -> int: data.find(sub, start, end)"},
    {"rfind", (PyCFunction)(void (*)(void))rfind, METH_FASTCALL,
     "rfind(data, sub[, start[, end]]) -> int: data.rfind(sub, start, end)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "proxy.relay._bytesearch",
    "bytes.find and bytes.rfind as plain functions (sse.find, sse.rfind), in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__bytesearch(void)
{
    return PyModule_Create(&module);
}
