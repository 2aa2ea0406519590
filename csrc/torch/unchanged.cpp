// dpcuda._C._unchanged: whether the objects a graphed step's checks read still hold what they
// held when the checks last passed (dpcuda/parallel/replay_guard.py builds the list).
//
// A replayed step (DataParallel(graphs=True)) first checks that the model, the optimizer, the
// loss and the wrapper's settings are still those its graph captured. In Python those checks
// were most of a replayed step's host time, and on a GPU a small step's time is the host's.
// Most of them read the same objects at every step and find them unchanged; this function
// checks, in one call, that every object they read is still the same object, so that the
// Python checks run only when something did change.
//
// checks: a tuple of (op, object, name or key, expected) tuples, each one of
//   kAttrIs  getattr(object, name) is expected
//   kAbsent  object has no attribute name
//   kEmpty   len(object) == 0
//   kItems   object is a dict whose items are exactly expected's (key, value) pairs, in order,
//            each key and value the same object
//   kSame    object is a list or tuple of exactly expected's objects, in order
//   kTypeIs  type(object) is expected
//   kItemIs  object is a dict whose entry name is expected (present)
//   kKeys    object is a dict whose keys are exactly expected's, in order, each the same object
// An error raised while reading (a property that raises) is cleared and counts as a change:
// the Python checks then run and raise it themselves. A check that is not of this form
// raises TypeError (a bug in the list, not a change).
#include <Python.h>
#include <torch/extension.h>

#include "unchanged.h"

namespace {

enum Op : long {
  kAttrIs = 0,
  kAbsent = 1,
  kEmpty = 2,
  kItems = 3,
  kSame = 4,
  kTypeIs = 5,
  kItemIs = 6,
  kKeys = 7
};

[[noreturn]] void malformed(const char* why) {
  throw py::type_error(std::string("dpcuda._C._unchanged: ") + why);
}

bool attr_is(PyObject* obj, PyObject* name, PyObject* expected) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool same = value == expected;
  Py_DECREF(value);
  return same;
}

bool absent(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value != nullptr) {
    Py_DECREF(value);
    return false;
  }
  const bool missing = PyErr_ExceptionMatches(PyExc_AttributeError);
  PyErr_Clear();
  return missing;
}

bool empty(PyObject* obj) {
  const Py_ssize_t n = PyObject_Size(obj);
  if (n < 0) {
    PyErr_Clear();
    return false;
  }
  return n == 0;
}

// obj is a dict of exactly expected's entries, in order: match(entry, key, value) says whether
// one of expected's entries is the dict's (key, value).
template <typename Match>
bool dict_in_order(PyObject* obj, PyObject* expected, const char* what, Match&& match) {
  if (!PyTuple_Check(expected)) {
    malformed(what);
  }
  if (!PyDict_Check(obj) || PyDict_Size(obj) != PyTuple_GET_SIZE(expected)) {
    return false;
  }
  Py_ssize_t pos = 0;
  PyObject* key;
  PyObject* value;
  for (Py_ssize_t i = 0; PyDict_Next(obj, &pos, &key, &value); ++i) {
    if (!match(PyTuple_GET_ITEM(expected, i), key, value)) {
      return false;
    }
  }
  return true;
}

bool items(PyObject* obj, PyObject* expected) {
  return dict_in_order(obj, expected, "kItems expects a tuple of (key, value) pairs",
                       [](PyObject* pair, PyObject* key, PyObject* value) {
                         if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                           malformed("kItems expects a tuple of (key, value) pairs");
                         }
                         return PyTuple_GET_ITEM(pair, 0) == key &&
                                PyTuple_GET_ITEM(pair, 1) == value;
                       });
}

bool keys(PyObject* obj, PyObject* expected) {
  return dict_in_order(obj, expected, "kKeys expects a tuple of keys",
                       [](PyObject* want, PyObject* key, PyObject*) { return want == key; });
}

bool item_is(PyObject* obj, PyObject* key, PyObject* expected) {
  if (!PyDict_Check(obj)) {
    return false;
  }
  PyObject* value = PyDict_GetItemWithError(obj, key);  // (borrowed; no __missing__)
  if (value == nullptr) {
    PyErr_Clear();
    return false;
  }
  return value == expected;
}

bool same(PyObject* obj, PyObject* expected) {
  if (!PyTuple_Check(expected)) {
    malformed("kSame expects a tuple");
  }
  if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  if (n != PyTuple_GET_SIZE(expected)) {
    return false;
  }
  PyObject** got = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (got[i] != PyTuple_GET_ITEM(expected, i)) {
      return false;
    }
  }
  return true;
}

bool holds(PyObject* check) {
  if (!PyTuple_Check(check) || PyTuple_GET_SIZE(check) != 4) {
    malformed("each check is an (op, object, name, expected) tuple");
  }
  const long op = PyLong_AsLong(PyTuple_GET_ITEM(check, 0));
  if (op == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    malformed("a check's op is not an int");
  }
  PyObject* obj = PyTuple_GET_ITEM(check, 1);
  PyObject* name = PyTuple_GET_ITEM(check, 2);
  PyObject* expected = PyTuple_GET_ITEM(check, 3);
  switch (op) {
    case kAttrIs:
    case kAbsent:
      if (!PyUnicode_Check(name)) {
        malformed("an attribute's name is not a str");
      }
      return op == kAttrIs ? attr_is(obj, name, expected) : absent(obj, name);
    case kEmpty:
      return empty(obj);
    case kItems:
      return items(obj, expected);
    case kSame:
      return same(obj, expected);
    case kTypeIs:
      return reinterpret_cast<PyObject*>(Py_TYPE(obj)) == expected;
    case kItemIs:
      return item_is(obj, name, expected);
    case kKeys:
      return keys(obj, expected);
    default:
      malformed("unknown op");
  }
}

bool unchanged(py::handle checks) {
  PyObject* list = checks.ptr();
  if (!PyTuple_Check(list)) {
    malformed("checks is a tuple");
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(list);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!holds(PyTuple_GET_ITEM(list, i))) {
      return false;
    }
  }
  return true;
}

}  // namespace

namespace dpcuda {

void register_unchanged(py::module& m) {
  m.def("_unchanged", &unchanged, py::arg("checks"),
        "Whether every (op, object, name, expected) check holds (csrc/torch/unchanged.cpp)");
}

}  // namespace dpcuda
