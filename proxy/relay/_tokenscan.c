/* The scan of an eligible stream's ordinary token chunks, in C: continuation.scan_events'
 * contract, written again where it runs for every token (proxy/relay/continuation.py says
 * what is checked and why; tests/test_token_event.py holds the two to the same results).
 *
 * Built beside the mypyc modules by scripts/compile.py, used only with them
 * (proxy/compiled.py); without it the same contract runs in Python. Counted with callgrind,
 * a token chunk's scan in the compiled Python was about 1,500 instructions, a token of a
 * burst 2,200 (four slices an event, their allocations and frees): here memcmp and memchr
 * over the bytes, and one allocation for the run's output and one for its ids.
 *
 * scan(data, start, head, tail, strip, single) -> (out, ids, stop, text) | None
 * take(data, head, tail, strip, lists) -> out | None (continuation.take_token)
 * role(event, before_created, between, after) -> (id, created, q, digits_end, start) | None
 *     (continuation.match_role)
 * data, head and tail exact bytes (what the relay reads; anything else is a TypeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static const char TOKEN_CHUNK_END[] = "]}]}\n\n"; /* the ids' list, choice, choices, chunk */
#define TOKEN_CHUNK_END_LEN 6
static const char NULLED_END[] = "null}]}\n\n"; /* the same end, the ids nulled */
#define NULLED_END_LEN 9
#define MAX_ID_DIGITS 18
#define MAX_CREATED_DIGITS 18 /* continuation._int_end */
static const char ID_AT[] = "data: {\"id\":\""; /* continuation._ID_AT */
#define ID_AT_LEN 13
#define EVENTS_KEPT 128 /* events of a read kept between the passes (a burst of 64 is common) */

/* Where the plain ids from d[i] (before n) end: continuation.ids_end. */
static Py_ssize_t
ids_end(const unsigned char *d, Py_ssize_t i, Py_ssize_t n)
{
    int digits = 0;
    Py_ssize_t j = i;
    while (j < n) {
        unsigned char c = d[j];
        if (c >= '0' && c <= '9') {
            if (digits == MAX_ID_DIGITS || (digits == 1 && d[j - 1] == '0')) {
                return -1;
            }
            digits++;
        }
        else if (c != ',') {
            break;
        }
        else if (digits) {
            digits = 0;
        }
        else {
            return -1; /* a comma first, or after another */
        }
        j++;
    }
    return (j > i && !digits) ? -1 : j;
}

typedef struct {
    Py_ssize_t text;   /* the text's length */
    Py_ssize_t ids;    /* where the ids start: the byte after the list's "[" */
    Py_ssize_t ids_to; /* where they end: the list's "]" */
    Py_ssize_t end;    /* the byte after the event's "\n\n" */
} Event;

/* The token chunk of the template at d[s] (before n): head, a text without a quote and not
 * ending in a backslash, the tail (which ends in the ids' "["), plain ids, "]}]}\n\n".
 * 0 and *ev filled when it is one, else -1. */
static int
match_event(const unsigned char *d, Py_ssize_t s, Py_ssize_t n, const unsigned char *head,
            Py_ssize_t h, const unsigned char *tail, Py_ssize_t tl, Event *ev)
{
    if (n - s < h || memcmp(d + s, head, (size_t)h) != 0) {
        return -1;
    }
    Py_ssize_t k0 = s + h;
    const unsigned char *q = memchr(d + k0, '"', (size_t)(n - k0));
    if (q == NULL) {
        return -1;
    }
    Py_ssize_t k = q - d;
    if (k > k0 && d[k - 1] == '\\') {
        return -1; /* the quote could be an escaped one */
    }
    if (n - k < tl || memcmp(d + k, tail, (size_t)tl) != 0) {
        return -1;
    }
    Py_ssize_t i0 = k + tl;
    Py_ssize_t j = ids_end(d, i0, n);
    if (j < 0 || n - j < TOKEN_CHUNK_END_LEN ||
        memcmp(d + j, TOKEN_CHUNK_END, TOKEN_CHUNK_END_LEN) != 0) {
        return -1;
    }
    ev->text = k - k0;
    ev->ids = i0;
    ev->ids_to = j;
    ev->end = j + TOKEN_CHUNK_END_LEN;
    return 0;
}

static PyObject *
scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "scan takes 6 arguments");
        return NULL;
    }
    PyObject *data = args[0], *head = args[2], *tail = args[3];
    if (!PyBytes_CheckExact(data) || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(tail)) {
        PyErr_SetString(PyExc_TypeError, "scan: data, head and tail are bytes");
        return NULL;
    }
    /* Clipped, not refused, as Python compares any int: a start past the end finds nothing. */
    Py_ssize_t start = PyNumber_AsSsize_t(args[1], NULL);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int strip = PyObject_IsTrue(args[4]);
    int single = PyObject_IsTrue(args[5]);
    if (strip < 0 || single < 0) {
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    const unsigned char *hd = (const unsigned char *)PyBytes_AS_STRING(head);
    Py_ssize_t h = PyBytes_GET_SIZE(head);
    const unsigned char *tl = (const unsigned char *)PyBytes_AS_STRING(tail);
    Py_ssize_t t = PyBytes_GET_SIZE(tail);
    if (start < 0 || start > n || t < 1 || tl[t - 1] != '[') {
        Py_RETURN_NONE; /* no event there; a tail that does not open the list is no template */
    }

    /* First pass: the events and the sizes of what is made of them. The first EVENTS_KEPT
     * are kept for the second pass (a read of vLLM's rarely holds more; past them, each is
     * matched again). */
    Event kept[EVENTS_KEPT];
    Event ev;
    Py_ssize_t s = start, out_size = 0, ids_size = 0, events = 0;
    int text = 0;
    while (match_event(d, s, n, hd, h, tl, t, &ev) == 0) {
        if (single) {
            if (s != 0 || ev.end != n) {
                Py_RETURN_NONE; /* a read of more than the one event */
            }
        }
        else if (ev.text == 0) {
            break; /* a run holds texts: an empty one is parsed */
        }
        Py_ssize_t ids_len = ev.ids_to - ev.ids;
        if (ids_len) {
            ids_size += ids_len + (ids_size ? 1 : 0);
        }
        out_size += (ev.ids - 1 - s) + NULLED_END_LEN;
        text = text || ev.text > 0;
        if (events < EVENTS_KEPT) {
            kept[events] = ev;
        }
        events++;
        s = ev.end;
        if (single) {
            break;
        }
    }
    if (events == 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t stop = s;

    /* Second pass: the ids joined with commas, and the stripped events. */
    PyObject *ids = PyBytes_FromStringAndSize(NULL, ids_size);
    if (ids == NULL) {
        return NULL;
    }
    PyObject *out;
    if (!strip) {
        if (start == 0 && stop == n) {
            out = Py_NewRef(data);
        }
        else {
            out = PyBytes_FromStringAndSize((const char *)d + start, stop - start);
        }
    }
    else {
        out = PyBytes_FromStringAndSize(NULL, out_size);
    }
    PyObject *stop_obj = PyLong_FromSsize_t(stop);
    PyObject *result = PyTuple_New(4);
    if (out == NULL || stop_obj == NULL || result == NULL) {
        Py_DECREF(ids);
        Py_XDECREF(out);
        Py_XDECREF(stop_obj);
        Py_XDECREF(result);
        return NULL;
    }
    char *ip = PyBytes_AS_STRING(ids);
    char *op = strip ? PyBytes_AS_STRING(out) : NULL;
    s = start;
    for (Py_ssize_t e = 0; e < events; e++) {
        if (e < EVENTS_KEPT) {
            ev = kept[e];
        }
        else if (match_event(d, s, n, hd, h, tl, t, &ev) != 0) { /* matched in the first pass */
            Py_DECREF(ids);
            Py_DECREF(out);
            Py_DECREF(stop_obj);
            Py_DECREF(result);
            PyErr_SetString(PyExc_RuntimeError, "scan: an event changed between passes");
            return NULL;
        }
        Py_ssize_t ids_len = ev.ids_to - ev.ids;
        if (ids_len) {
            if (ip != PyBytes_AS_STRING(ids)) {
                *ip++ = ',';
            }
            memcpy(ip, d + ev.ids, (size_t)ids_len);
            ip += ids_len;
        }
        if (op != NULL) {
            Py_ssize_t upto = ev.ids - 1 - s; /* up to the list's "[", excluded */
            memcpy(op, d + s, (size_t)upto);
            op += upto;
            memcpy(op, NULLED_END, NULLED_END_LEN);
            op += NULLED_END_LEN;
        }
        s = ev.end;
    }
    /* A tuple filled in place: Py_BuildValue parses its format string on every call (600
     * instructions, a third of a chunk's scan). */
    PyTuple_SET_ITEM(result, 0, out);
    PyTuple_SET_ITEM(result, 1, ids);
    PyTuple_SET_ITEM(result, 2, stop_obj);
    PyTuple_SET_ITEM(result, 3, Py_NewRef(text ? Py_True : Py_False));
    return result;
}

/* take(data, head, tail, strip, lists) -> out | None: continuation.take_token. The scan of
 * a read that is one token chunk with text, as the relay meets one for every token: the ids
 * added here to the bytearray that ends ``lists`` (or to a new one), and the event (nulled
 * when ``strip``) the only object made.
 * Counted with callgrind, scan's 4-tuple, its two ints and the caller's unpacking and second
 * tuple were about a third of a token chunk's cost in the relay. */
static PyObject *
take(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take takes 5 arguments");
        return NULL;
    }
    PyObject *data = args[0], *head = args[1], *tail = args[2], *lists = args[4];
    if (!PyBytes_CheckExact(data) || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(tail)) {
        PyErr_SetString(PyExc_TypeError, "take: data, head and tail are bytes");
        return NULL;
    }
    if (!PyList_Check(lists)) {
        PyErr_SetString(PyExc_TypeError, "take: lists is a list");
        return NULL;
    }
    int strip = PyObject_IsTrue(args[3]);
    if (strip < 0) {
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    const unsigned char *tl = (const unsigned char *)PyBytes_AS_STRING(tail);
    Py_ssize_t t = PyBytes_GET_SIZE(tail);
    Event ev;
    if (t < 1 || tl[t - 1] != '[' ||
        match_event(d, 0, n, (const unsigned char *)PyBytes_AS_STRING(head),
                    PyBytes_GET_SIZE(head), tl, t, &ev) != 0 ||
        ev.end != n || ev.text == 0) {
        Py_RETURN_NONE; /* not one token chunk with text: scan or a parse decides */
    }
    /* The event first: nothing is noted of a token whose event could not be made. */
    PyObject *out;
    if (!strip) {
        out = Py_NewRef(data);
    }
    else {
        Py_ssize_t upto = ev.ids - 1; /* up to the list's "[", excluded */
        out = PyBytes_FromStringAndSize(NULL, upto + NULLED_END_LEN);
        if (out == NULL) {
            return NULL;
        }
        char *op = PyBytes_AS_STRING(out);
        memcpy(op, d, (size_t)upto);
        memcpy(op + upto, NULLED_END, NULLED_END_LEN);
    }
    Py_ssize_t ids_len = ev.ids_to - ev.ids;
    Py_ssize_t k = PyList_GET_SIZE(lists);
    PyObject *last = k ? PyList_GET_ITEM(lists, k - 1) : NULL;
    if (ids_len && last != NULL && PyByteArray_CheckExact(last)) {
        /* The token before was taken here too: its bytearray grows (over-allocated by
         * PyByteArray_Resize, so a stream's tokens cost few reallocations). */
        Py_ssize_t m = PyByteArray_GET_SIZE(last);
        if (PyByteArray_Resize(last, m + 1 + ids_len) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        char *p = PyByteArray_AS_STRING(last);
        p[m] = ',';
        memcpy(p + m + 1, d + ev.ids, (size_t)ids_len);
    }
    else if (ids_len) {
        PyObject *ids = PyByteArray_FromStringAndSize((const char *)d + ev.ids, ids_len);
        if (ids == NULL || PyList_Append(lists, ids) < 0) {
            Py_XDECREF(ids);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(ids);
    }
    return out;
}

/* role(event, before_created, between, after) -> (id, created, q, digits_end, start) | None:
 * continuation.match_role, a stream's first chunk of a kept shape. Counted with callgrind,
 * its checks as compiled Python (a dozen bytes methods called through the generic protocol,
 * loops over the id's and the created's bytes) were 12,800 instructions a stream. */
static PyObject *
role(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "role takes 4 arguments");
        return NULL;
    }
    for (int a = 0; a < 4; a++) {
        if (!PyBytes_CheckExact(args[a])) {
            PyErr_SetString(PyExc_TypeError, "role: its arguments are bytes");
            return NULL;
        }
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    const char *bc = PyBytes_AS_STRING(args[1]);
    Py_ssize_t bcn = PyBytes_GET_SIZE(args[1]);
    const char *bt = PyBytes_AS_STRING(args[2]);
    Py_ssize_t btn = PyBytes_GET_SIZE(args[2]);
    const char *af = PyBytes_AS_STRING(args[3]);
    Py_ssize_t afn = PyBytes_GET_SIZE(args[3]);
    if (n < ID_AT_LEN || memcmp(d, ID_AT, ID_AT_LEN) != 0) {
        Py_RETURN_NONE;
    }
    const unsigned char *qp = memchr(d + ID_AT_LEN, '"', (size_t)(n - ID_AT_LEN));
    if (qp == NULL) {
        Py_RETURN_NONE;
    }
    Py_ssize_t q = qp - d;
    if (n - q < bcn || memcmp(d + q, bc, (size_t)bcn) != 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t digits = q + bcn, j = digits;
    long long created = 0;
    while (j < n && d[j] >= '0' && d[j] <= '9') {
        if (j - digits == MAX_CREATED_DIGITS) {
            Py_RETURN_NONE; /* more digits than a created has */
        }
        created = created * 10 + (d[j] - '0');
        j++;
    }
    if (j == digits || (j - digits > 1 && d[digits] == '0')) {
        Py_RETURN_NONE;
    }
    Py_ssize_t digits_end = j;
    if (n - digits_end < btn || memcmp(d + digits_end, bt, (size_t)btn) != 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t start = digits_end + btn, end = n - afn;
    if (end < start || memcmp(d + end, af, (size_t)afn) != 0) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t k = start; k < end; k++) {
        unsigned char c = d[k];
        if (c == ']' || c == '[' || c == '"' || c == '\n') {
            Py_RETURN_NONE; /* the prompt's ids as continuation.parse cuts them */
        }
    }
    for (Py_ssize_t k = ID_AT_LEN; k < q; k++) {
        if (d[k] == '\\' || d[k] < 0x20) {
            Py_RETURN_NONE; /* continuation._id_of: escaped or control, parsed */
        }
    }
    PyObject *id = PyUnicode_DecodeUTF8((const char *)d + ID_AT_LEN, q - ID_AT_LEN, NULL);
    if (id == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            return NULL;
        }
        PyErr_Clear();
        Py_RETURN_NONE; /* not UTF-8: parsed */
    }
    PyObject *result = PyTuple_New(5);
    PyObject *created_obj = PyLong_FromLongLong(created);
    PyObject *q_obj = PyLong_FromSsize_t(q);
    PyObject *end_obj = PyLong_FromSsize_t(digits_end);
    PyObject *start_obj = PyLong_FromSsize_t(start);
    if (result == NULL || created_obj == NULL || q_obj == NULL || end_obj == NULL ||
        start_obj == NULL) {
        Py_DECREF(id);
        Py_XDECREF(result);
        Py_XDECREF(created_obj);
        Py_XDECREF(q_obj);
        Py_XDECREF(end_obj);
        Py_XDECREF(start_obj);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, id);
    PyTuple_SET_ITEM(result, 1, created_obj);
    PyTuple_SET_ITEM(result, 2, q_obj);
    PyTuple_SET_ITEM(result, 3, end_obj);
    PyTuple_SET_ITEM(result, 4, start_obj);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(data, start, head, tail, strip, single) -> (out, ids, stop, text) | None"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(data, head, tail, strip, lists) -> out | None"},
    {"role", (PyCFunction)(void (*)(void))role, METH_FASTCALL,
     "role(event, before_created, between, after) -> (id, created, q, digits_end, start) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "proxy.relay._tokenscan",
    "The scan of an eligible stream's token chunks (continuation.scan_events), in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__tokenscan(void)
{
    return PyModule_Create(&module);
}
