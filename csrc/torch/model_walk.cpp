// dpcuda._C._walk: ReplicaSet.walk (dpcuda/parallel/replicas.py) for the common model, in C.
//
// DataParallel walks the model at every step: its structure (a module, parameter or buffer
// added, removed or replaced), its hooks, and what a captured graph holds as it was at its
// capture (every module's public attributes, every buffer's storage). On a GPU a small step's
// time is the host's, and in Python that walk was the largest piece of a replayed step's host
// time. This is the same walk, returning the same objects, made with the Python C API.
//
// It returns None wherever the Python walk has something to say: a module of a type that walk
// may refuse (nn.Embedding, nn.EmbeddingBag), a parameter that is not an nn.Parameter, a
// parameter with a gradient hook on several replicas. The Python walk then runs and raises
// its error (or returns its result): there is one set of messages, in Python.
// tests/test_walk.py compares the two walks on random models.
#include <Python.h>
#include <torch/extension.h>

#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "model_walk.h"

namespace {

// The classes the walk tells apart, set once by dpcuda.parallel.replicas (_walk_setup).
struct Classes {
  PyObject* parameter = nullptr;  // torch.nn.Parameter
  PyObject* tensor = nullptr;     // torch.Tensor
  PyObject* refused = nullptr;    // (nn.Embedding, nn.EmbeddingBag)
  PyObject* values = nullptr;     // replicas._VALUES: attribute types held by value
  PyObject* nan = nullptr;        // "nan"
};
Classes classes;

// A new reference, or nullptr with the Python error set.
using Ref = py::object;

Ref steal(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(o);
}

// An attribute name as an interned string, made once per name: PyObject_GetAttrString would
// make and hash a new string at every call, which was the walk's largest cost.
PyObject* interned(const char* name) {
  static std::unordered_map<const char*, PyObject*> names;
  auto found = names.find(name);
  if (found != names.end()) {
    return found->second;
  }
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) {
    throw py::error_already_set();
  }
  names.emplace(name, s);  // (kept for the life of the process)
  return s;
}

Ref attr(PyObject* o, const char* name) { return steal(PyObject_GetAttr(o, interned(name))); }

bool truth(PyObject* o) {
  const int t = PyObject_IsTrue(o);
  if (t < 0) {
    throw py::error_already_set();
  }
  return t != 0;
}

bool is_instance(PyObject* o, PyObject* cls) {
  const int t = PyObject_IsInstance(o, cls);
  if (t < 0) {
    throw py::error_already_set();
  }
  return t != 0;
}

bool exact_value_type(PyObject* v) {
  PyObject* t = reinterpret_cast<PyObject*>(Py_TYPE(v));
  const Py_ssize_t n = PyTuple_GET_SIZE(classes.values);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyTuple_GET_ITEM(classes.values, i) == t) {
      return true;
    }
  }
  return false;
}

bool is_nan_float(PyObject* v) {
  return PyFloat_CheckExact(v) && PyFloat_AS_DOUBLE(v) != PyFloat_AS_DOUBLE(v);
}

Ref id_of(PyObject* o) { return steal(PyLong_FromVoidPtr(o)); }

// replicas._attribute_key(v, objects)
Ref attribute_key(PyObject* v, PyObject* objects) {
  if (exact_value_type(v)) {
    return py::reinterpret_borrow<py::object>(is_nan_float(v) ? classes.nan : v);
  }
  if (PyTuple_CheckExact(v)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(v);
    bool plain = true;
    for (Py_ssize_t i = 0; i < n && plain; ++i) {
      plain = exact_value_type(PyTuple_GET_ITEM(v, i));
    }
    if (plain) {
      Ref out = steal(PyTuple_New(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* e = PyTuple_GET_ITEM(v, i);
        PyObject* kept = is_nan_float(e) ? classes.nan : e;
        Py_INCREF(kept);
        PyTuple_SET_ITEM(out.ptr(), i, kept);
      }
      return out;
    }
  }
  if (is_instance(v, classes.tensor)) {
    // (v.data_ptr(), v.dtype, tuple(v.shape)); a tensor without storage (RuntimeError) is
    // held as an object
    PyObject* ptr = PyObject_CallMethodNoArgs(v, interned("data_ptr"));
    if (ptr != nullptr) {
      Ref p = steal(ptr);
      Ref dtype = attr(v, "dtype");
      Ref shape = steal(PySequence_Tuple(attr(v, "shape").ptr()));
      return steal(PyTuple_Pack(3, p.ptr(), dtype.ptr(), shape.ptr()));
    }
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) {
      throw py::error_already_set();
    }
    PyErr_Clear();
  }
  if (PyList_Append(objects, v) < 0) {
    throw py::error_already_set();
  }
  return id_of(v);
}

void append(PyObject* list, PyObject* item) {
  if (PyList_Append(list, item) < 0) {
    throw py::error_already_set();
  }
}

void append(PyObject* list, const Ref& item) { append(list, item.ptr()); }

// A module's own dict entry (m._parameters, ...) as a dict: these live in the instance's
// __dict__; anything else (a property, a subclass's slot) is read with getattr.
Ref module_dict(PyObject* m, const char* name) {
  Ref d = attr(m, name);
  if (!PyDict_Check(d.ptr())) {
    throw py::type_error(std::string("dpcuda: a module's ") + name + " is not a dict");
  }
  return d;
}

bool has_hooks(PyObject* m) {
  for (const char* name :
       {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"}) {
    if (truth(attr(m, name).ptr())) {
      return true;
    }
  }
  return false;
}

bool has_grad_hooks(PyObject* p) {
  return truth(attr(p, "_backward_hooks").ptr()) ||
         truth(attr(p, "_post_accumulate_grad_hooks").ptr());
}

py::object walk(py::handle model, bool graphed, int replicas) {
  if (classes.parameter == nullptr) {
    throw std::runtime_error("dpcuda._C._walk: _walk_setup was not called");
  }
  Ref params = steal(PyList_New(0));
  Ref buffers = steal(PyList_New(0));
  Ref key = steal(PyList_New(0));
  Ref state = steal(PyList_New(0));
  Ref objects = steal(PyList_New(0));
  bool hooked = false;
  std::unordered_set<PyObject*> seen;
  std::vector<PyObject*> stack{model.ptr()};  // (borrowed: the model holds every module)
  while (!stack.empty()) {
    PyObject* m = stack.back();
    stack.pop_back();
    if (!seen.insert(m).second) {
      continue;
    }
    append(key.ptr(), id_of(m));
    append(key.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(m)));
    if (graphed) {
      // every public attribute of the instance's __dict__, in its order (its items taken
      // first: a tensor subclass's data_ptr is Python code, and could change the dict)
      Ref items = steal(PyDict_Items(module_dict(m, "__dict__").ptr()));
      const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* item = PyList_GET_ITEM(items.ptr(), i);
        PyObject* k = PyTuple_GET_ITEM(item, 0);
        if (!PyUnicode_Check(k)) {
          return py::none();  // (the Python walk's k[:1] on a key that is not a str)
        }
        if (PyUnicode_GET_LENGTH(k) > 0 && PyUnicode_READ_CHAR(k, 0) == '_') {
          continue;
        }
        append(state.ptr(), attribute_key(PyTuple_GET_ITEM(item, 1), objects.ptr()));
      }
      hooked = hooked || has_hooks(m);
    }
    if (is_instance(m, classes.refused)) {
      return py::none();
    }
    Ref parameters = module_dict(m, "_parameters");
    Py_ssize_t pos = 0;
    PyObject *k, *p;
    while (PyDict_Next(parameters.ptr(), &pos, &k, &p)) {
      if (p == Py_None || seen.count(p) != 0) {
        continue;
      }
      if (Py_TYPE(p) != reinterpret_cast<PyTypeObject*>(classes.parameter) &&
          !is_instance(p, classes.parameter)) {
        return py::none();  // (the Python walk raises its error)
      }
      seen.insert(p);
      append(params.ptr(), p);
      append(key.ptr(), id_of(p));
      append(key.ptr(), attr(p, "shape"));
      append(key.ptr(), attr(p, "requires_grad"));
      const bool grad_hooked = has_grad_hooks(p);
      hooked = hooked || (graphed && grad_hooked);
      if (replicas > 1 && grad_hooked) {
        return py::none();
      }
    }
    Ref module_buffers = module_dict(m, "_buffers");
    pos = 0;
    PyObject* b;
    while (PyDict_Next(module_buffers.ptr(), &pos, &k, &b)) {
      if (b == Py_None || seen.count(b) != 0) {
        continue;
      }
      seen.insert(b);
      append(buffers.ptr(), b);
      append(key.ptr(), id_of(b));
      append(key.ptr(), attr(b, "shape"));
      if (graphed) {
        append(state.ptr(), steal(PyObject_CallMethodNoArgs(b, interned("data_ptr"))));
      }
    }
    Ref children = module_dict(m, "_modules");
    std::vector<PyObject*> found;
    pos = 0;
    PyObject* c;
    while (PyDict_Next(children.ptr(), &pos, &k, &c)) {
      if (c != Py_None) {
        found.push_back(c);
      }
    }
    stack.insert(stack.end(), found.rbegin(), found.rend());
  }
  Ref key_tuple = steal(PyList_AsTuple(key.ptr()));
  Ref state_tuple = steal(PyList_AsTuple(state.ptr()));
  Ref checks = steal(PyTuple_Pack(3, hooked ? Py_True : Py_False, state_tuple.ptr(),
                                  objects.ptr()));
  return steal(PyTuple_Pack(4, params.ptr(), buffers.ptr(), key_tuple.ptr(), checks.ptr()));
}

}  // namespace

namespace dpcuda {

void register_model_walk(py::module& m) {
  m.def(
      "_walk_setup",
      [](py::handle parameter, py::handle tensor, py::tuple refused, py::tuple values) {
        // (kept for the life of the process, as the classes themselves are)
        for (PyObject** slot : {&classes.parameter, &classes.tensor, &classes.refused,
                                &classes.values, &classes.nan}) {
          Py_XDECREF(*slot);
        }
        classes.parameter = parameter.inc_ref().ptr();
        classes.tensor = tensor.inc_ref().ptr();
        classes.refused = refused.inc_ref().ptr();
        classes.values = values.inc_ref().ptr();
        classes.nan = PyUnicode_FromString("nan");
      },
      "The classes _walk tells apart: nn.Parameter, torch.Tensor, the module types the Python "
      "walk may refuse, the attribute types held by value");
  m.def("_walk", &walk, py::arg("model"), py::arg("graphed"), py::arg("replicas"),
        "ReplicaSet.walk(graphed) for a model of replicas replicas, or None where the Python "
        "walk must run (it raises, or handles a module the C walk leaves to it)");
}

}  // namespace dpcuda
