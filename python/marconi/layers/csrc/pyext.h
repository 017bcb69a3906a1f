/* The Python binding of a csrc/ kernel, compiled in when MARCONI_PYEXT is defined
 * (marconi.layers.ckernel builds every kernel that way where Python's headers exist).
 *
 * Why not ctypes alone: a ctypes call converts each argument through its argtypes, ~10 us a call
 * of 7 arguments on our CPU, and a decode step of the tiny model makes ~100 kernel calls; a
 * METH_FASTCALL function parses the same arguments in well under a microsecond. Arguments are
 * Python ints (pointers: tensor.data_ptr(), or None for NULL), ints and floats, described by a
 * signature string: 'p' pointer, 'l' long, 'f' float. The GIL is released around the kernel.
 */
#ifndef MARCONI_PYEXT_H
#define MARCONI_PYEXT_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef union {
    void *p;
    long l;
    float f;
} pyext_arg;

static int pyext_parse(const char *name, const char *sig, PyObject *const *args, Py_ssize_t n,
                       pyext_arg *out) {
    if ((size_t)n != strlen(sig)) {
        PyErr_Format(PyExc_TypeError, "%s takes %zu arguments, got %zd", name, strlen(sig), n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = args[i];
        switch (sig[i]) {
        case 'p': out[i].p = o == Py_None ? NULL : PyLong_AsVoidPtr(o); break;
        case 'l': out[i].l = PyLong_AsLong(o); break;
        default: out[i].f = (float)PyFloat_AsDouble(o); break;
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* def NAME(*args) -> None: parse SIG into `v`, run CALL without the GIL */
#define PYEXT_FUNCTION(NAME, SIG, CALL)                                                      \
    static PyObject *py_##NAME(PyObject *self, PyObject *const *args, Py_ssize_t n) {         \
        (void)self;                                                                           \
        pyext_arg v[sizeof(SIG) - 1];                                                         \
        if (pyext_parse(#NAME, SIG, args, n, v)) return NULL;                                 \
        Py_BEGIN_ALLOW_THREADS CALL;                                                          \
        Py_END_ALLOW_THREADS Py_RETURN_NONE;                                                  \
    }
#define PYEXT_METHOD(NAME) {#NAME, (PyCFunction)(void (*)(void))py_##NAME, METH_FASTCALL, NULL}

/* the module: PyInit_MODULE exposing the PYEXT_METHOD entries given */
#define PYEXT_MODULE(MODULE, ...)                                                             \
    static PyMethodDef MODULE##_methods[] = {__VA_ARGS__, {NULL, NULL, 0, NULL}};             \
    static struct PyModuleDef MODULE##_def = {PyModuleDef_HEAD_INIT, #MODULE, NULL, -1,       \
                                              MODULE##_methods, NULL, NULL, NULL, NULL};      \
    PyMODINIT_FUNC PyInit_##MODULE(void) { return PyModule_Create(&MODULE##_def); }
#endif
