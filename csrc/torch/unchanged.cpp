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
//   kTensorIs object is a tensor of exactly expected's (type, sizes, strides, dtype, device,
//            data_ptr, requires_grad, hooked), read from its C object; a None among the last
//            five is not compared (hooked: a gradient hook, register_hook's or a
//            post-accumulate-grad hook). Only for types whose getters are torch's (exact
//            torch.Tensor and nn.Parameter, and nn.Parameter's subclasses that keep their
//            __torch_function__ off); a tensor whose sizes, strides or storage cannot be read
//            (nested, sparse, without storage) is a change.
//   kModuleAbsent  object, an nn.Module, has no attribute name where nn.Module's attribute
//            lookup would find one: not on its type, not in its __dict__ nor its _parameters,
//            _buffers or _modules (without running nn.Module.__getattr__, which raises an
//            AttributeError made in Python). expected is (nn.Module.__getattr__,
//            object.__getattribute__), which its type must still use.
// An error raised while reading (a property that raises) is cleared and counts as a change:
// the Python checks then run and raise it themselves. A check that is not of this form
// raises TypeError (a bug in the list, not a change).
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include "interned.h"
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
  kKeys = 7,
  kTensorIs = 8,
  kModuleAbsent = 9
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
  PyObject* value = nullptr;
  // (without making the AttributeError where the type's lookup need not: a function's)
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(obj, name, &value);
#else
  const int found = _PyObject_LookupAttr(obj, name, &value);
#endif
  Py_XDECREF(value);
  if (found < 0) {
    PyErr_Clear();  // (another error than an AttributeError: a change)
    return false;
  }
  return found == 0;
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

// A tuple of Python ints equal to values (false, the error cleared, where one is not an int).
bool ints_equal(PyObject* tuple, c10::IntArrayRef values) {
  if (!PyTuple_Check(tuple)) {
    malformed("kTensorIs expects sizes and strides as tuples of ints");
  }
  if (PyTuple_GET_SIZE(tuple) != static_cast<Py_ssize_t>(values.size())) {
    return false;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, static_cast<Py_ssize_t>(i)));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      malformed("kTensorIs expects sizes and strides as tuples of ints");
    }
    if (v != values[i]) {
      return false;
    }
  }
  return true;
}

bool slot_true(PyObject* slot) {
  if (slot == nullptr) {
    return false;
  }
  const int t = PyObject_IsTrue(slot);
  if (t < 0) {
    PyErr_Clear();
    return true;  // (counted as hooked: the Python checks then read it themselves)
  }
  return t != 0;
}

bool tensor_is_unchecked(PyObject* obj, PyObject* const* want) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != want[0] || !THPVariable_Check(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.is_nested() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      !ints_equal(want[1], t.sizes())) {
    return false;
  }
  if (!THPDtype_Check(want[3]) || !THPDevice_Check(want[4])) {
    malformed("kTensorIs expects a torch.dtype and a torch.device");
  }
  if (reinterpret_cast<THPDtype*>(want[3])->scalar_type != t.scalar_type() ||
      reinterpret_cast<THPDevice*>(want[4])->device != t.device()) {
    return false;
  }
  if (want[2] != Py_None || want[5] != Py_None) {
    if (t.layout() != at::kStrided || !t.has_storage()) {
      return false;
    }
    if (want[2] != Py_None && !ints_equal(want[2], t.strides())) {
      return false;
    }
    if (want[5] != Py_None) {
      void* ptr = PyLong_AsVoidPtr(want[5]);
      if (ptr == nullptr && PyErr_Occurred()) {
        PyErr_Clear();
        malformed("kTensorIs expects data_ptr as an int");
      }
      if (ptr != t.data_ptr()) {
        return false;
      }
    }
  }
  if (want[6] != Py_None && t.requires_grad() != (want[6] == Py_True)) {
    return false;
  }
  if (want[7] != Py_None) {
    const auto* var = reinterpret_cast<THPVariable*>(obj);
    const bool hooked =
        slot_true(var->backward_hooks) || slot_true(var->post_accumulate_grad_hooks);
    if (hooked != (want[7] == Py_True)) {
      return false;
    }
  }
  return true;
}

bool tensor_is(PyObject* obj, PyObject* expected) {
  if (!PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 8) {
    malformed("kTensorIs expects (type, sizes, strides, dtype, device, data_ptr, "
              "requires_grad, hooked)");
  }
  try {
    return tensor_is_unchecked(obj, &PyTuple_GET_ITEM(expected, 0));
  } catch (const c10::Error&) {
    return false;  // (torch refused to read it: a change; the Python checks then run)
  }
}

using dpcuda::interned;

// name is not a key of the dict d (false where the lookup raised: cleared)
bool missing_from(PyObject* d, PyObject* name) {
  if (PyDict_GetItemWithError(d, name) != nullptr) {
    return false;
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool module_absent(PyObject* obj, PyObject* name, PyObject* expected) {
  if (!PyTuple_Check(expected) || PyTuple_GET_SIZE(expected) != 2) {
    malformed("kModuleAbsent expects (nn.Module.__getattr__, object.__getattribute__)");
  }
  PyTypeObject* type = Py_TYPE(obj);
  // (_PyType_Lookup: the MRO's entry, borrowed, without running Python or raising)
  if (_PyType_Lookup(type, interned("__getattr__")) != PyTuple_GET_ITEM(expected, 0) ||
      _PyType_Lookup(type, interned("__getattribute__")) != PyTuple_GET_ITEM(expected, 1) ||
      _PyType_Lookup(type, name) != nullptr) {
    return false;
  }
  PyObject* d = PyObject_GenericGetDict(obj, nullptr);
  if (d == nullptr) {
    PyErr_Clear();
    return false;
  }
  const py::object owned = py::reinterpret_steal<py::object>(d);
  if (!PyDict_Check(d) || !missing_from(d, name)) {
    return false;
  }
  for (const char* dict_name : {"_parameters", "_buffers", "_modules"}) {
    PyObject* entries = PyDict_GetItemWithError(d, interned(dict_name));  // (borrowed)
    if (entries == nullptr) {
      PyErr_Clear();
      return false;
    }
    if (!PyDict_Check(entries) || !missing_from(entries, name)) {
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
    case kTensorIs:
      return tensor_is(obj, expected);
    case kModuleAbsent:
      if (!PyUnicode_Check(name)) {
        malformed("an attribute's name is not a str");
      }
      return module_absent(obj, name, expected);
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
