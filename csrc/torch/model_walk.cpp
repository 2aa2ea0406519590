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
// parameter with a gradient hook on several replicas, a module whose __dict__, _parameters,
// _buffers or _modules is not exactly a dict (a TorchScript module's wrapper, an OrderedDict
// with an order of its own). The Python walk then runs and raises its error (or returns its
// result): there is one set of messages, in Python.
// tests/test_walk.py compares the two walks on random models.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <unordered_set>
#include <vector>

#include "interned.h"
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

// An owned reference (empty: none).
using Ref = py::object;

// A new reference returned by the C API, owned; nullptr (the Python error set) raised.
Ref steal(PyObject* o) {
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(o);
}

using dpcuda::interned;

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

// (v.data_ptr(), v.dtype, tuple(v.shape)), or an empty object where one of them raised a
// RuntimeError (cleared); any other error is raised.
Ref tensor_key(PyObject* v) {
  PyObject* ptr = PyObject_CallMethodNoArgs(v, interned("data_ptr"));
  PyObject* dtype = ptr ? PyObject_GetAttr(v, interned("dtype")) : nullptr;
  PyObject* shape = dtype ? PyObject_GetAttr(v, interned("shape")) : nullptr;
  PyObject* dims = shape ? PySequence_Tuple(shape) : nullptr;
  Py_XDECREF(shape);
  if (dims == nullptr) {
    Py_XDECREF(ptr);
    Py_XDECREF(dtype);
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) {
      throw py::error_already_set();
    }
    PyErr_Clear();
    return Ref();
  }
  PyObject* key = PyTuple_Pack(3, ptr, dtype, dims);
  Py_DECREF(ptr);
  Py_DECREF(dtype);
  Py_DECREF(dims);
  return steal(key);
}

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
    // (v.data_ptr(), v.dtype, tuple(v.shape)); a RuntimeError from any of them (a tensor
    // without storage, a nested tensor's shape) holds the tensor as an object, as in Python
    Ref key = tensor_key(v);
    if (key) {
      return key;
    }
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

// A module's own dict (m._parameters, m._buffers, m._modules) as a list of its values, taken
// before anything else runs (the walk runs Python code: a tensor subclass's data_ptr, a hook
// dict's __bool__, which could change them); an empty object where it is not exactly a dict (a
// TorchScript module's wrapper, an OrderedDict whose order is its own), which the Python walk
// then handles.
Ref module_entries(PyObject* m, const char* name) {
  Ref d = attr(m, name);
  if (!PyDict_CheckExact(d.ptr())) {
    return Ref();
  }
  return steal(PyDict_Values(d.ptr()));
}

// A module's public attributes (an instance attribute whose name does not start with '_'), in
// __dict__'s order, held before any Python code runs (only the names are read while the dict
// is iterated; the module's private entries, most of its __dict__, are passed over without a
// copy); false where __dict__ is not exactly a dict or holds a name that is not a plain str
// (the Python walk's k[:1]), which the Python walk then handles.
bool public_attributes(PyObject* m, std::vector<Ref>* out) {
  const Ref d = attr(m, "__dict__");
  if (!PyDict_CheckExact(d.ptr())) {
    return false;
  }
  Py_ssize_t pos = 0;
  PyObject* k = nullptr;
  PyObject* v = nullptr;
  while (PyDict_Next(d.ptr(), &pos, &k, &v)) {
    if (!PyUnicode_CheckExact(k)) {
      return false;
    }
    if (PyUnicode_GET_LENGTH(k) > 0 && PyUnicode_READ_CHAR(k, 0) == '_') {
      continue;
    }
    out->push_back(py::reinterpret_borrow<py::object>(v));
  }
  return true;
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

// An exact nn.Parameter over a tensor with concrete sizes: its shape, requires_grad and hook
// slots are read from its C object, as the Python getters read them (a subclass, whose
// getters may be its own, goes through Python).
bool plain_parameter(PyObject* p) {
  return Py_TYPE(p) == reinterpret_cast<PyTypeObject*>(classes.parameter) &&
         !THPVariable_Unpack(p).unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// tuple(p.shape) (equal to the torch.Size the Python walk holds, with the same hash), or
// tuple(p.stride())
Ref shape_tuple(c10::IntArrayRef sizes) {
  Ref out = steal(PyTuple_New(static_cast<Py_ssize_t>(sizes.size())));
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i),
                     steal(PyLong_FromLongLong(sizes[i])).release().ptr());
  }
  return out;
}

bool slot_true(PyObject* slot) { return slot != nullptr && truth(slot); }

// replicas._strides(t): t.stride() for a strided tensor, else None (read from the C object
// for an exact nn.Parameter or torch.Tensor, through Python for another type)
Ref strides_key(PyObject* t) {
  const auto* type = reinterpret_cast<PyObject*>(Py_TYPE(t));
  if ((type == classes.parameter || type == classes.tensor) &&
      !THPVariable_Unpack(t).unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    const at::Tensor& v = THPVariable_Unpack(t);
    if (v.layout() != at::kStrided) {
      return py::none();
    }
    return shape_tuple(v.strides());
  }
  static PyObject* const strided = [] {
    const Ref torch = steal(PyImport_ImportModule("torch"));
    return attr(torch.ptr(), "strided").release().ptr();  // (kept for the process's life)
  }();
  if (attr(t, "layout").ptr() != strided) {
    return py::none();
  }
  return steal(PySequence_Tuple(steal(PyObject_CallMethodNoArgs(t, interned("stride"))).ptr()));
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
  // (strong references: Python code the walk runs could drop a module not yet visited)
  std::vector<Ref> stack{py::reinterpret_borrow<py::object>(model)};
  while (!stack.empty()) {
    const Ref module = std::move(stack.back());
    stack.pop_back();
    PyObject* m = module.ptr();
    if (!seen.insert(m).second) {
      continue;
    }
    append(key.ptr(), id_of(m));
    append(key.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(m)));
    if (graphed) {
      // every public attribute of the instance's __dict__, in its order
      std::vector<Ref> values;
      if (!public_attributes(m, &values)) {
        return py::none();
      }
      for (const Ref& v : values) {
        append(state.ptr(), attribute_key(v.ptr(), objects.ptr()));
      }
      hooked = hooked || has_hooks(m);
    }
    if (is_instance(m, classes.refused)) {
      return py::none();
    }
    const Ref parameters = module_entries(m, "_parameters");
    if (!parameters) {
      return py::none();
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parameters.ptr()); ++i) {
      PyObject* p = PyList_GET_ITEM(parameters.ptr(), i);
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
      bool grad_hooked;
      if (plain_parameter(p)) {
        const at::Tensor& t = THPVariable_Unpack(p);
        append(key.ptr(), shape_tuple(t.sizes()));
        append(key.ptr(), strides_key(p));
        append(key.ptr(), t.requires_grad() ? Py_True : Py_False);
        const auto* var = reinterpret_cast<THPVariable*>(p);
        grad_hooked =
            slot_true(var->backward_hooks) || slot_true(var->post_accumulate_grad_hooks);
      } else {
        append(key.ptr(), attr(p, "shape"));
        append(key.ptr(), strides_key(p));
        append(key.ptr(), attr(p, "requires_grad"));
        grad_hooked = has_grad_hooks(p);
      }
      hooked = hooked || (graphed && grad_hooked);
      if (replicas > 1 && grad_hooked) {
        return py::none();
      }
    }
    const Ref module_buffers = module_entries(m, "_buffers");
    if (!module_buffers) {
      return py::none();
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(module_buffers.ptr()); ++i) {
      PyObject* b = PyList_GET_ITEM(module_buffers.ptr(), i);
      if (b == Py_None || seen.count(b) != 0) {
        continue;
      }
      seen.insert(b);
      append(buffers.ptr(), b);
      append(key.ptr(), id_of(b));
      append(key.ptr(), attr(b, "shape"));
      append(key.ptr(), strides_key(b));
      if (graphed) {
        append(state.ptr(), steal(PyObject_CallMethodNoArgs(b, interned("data_ptr"))));
      }
    }
    const Ref children = module_entries(m, "_modules");
    if (!children) {
      return py::none();
    }
    for (Py_ssize_t i = PyList_GET_SIZE(children.ptr()) - 1; i >= 0; --i) {
      PyObject* c = PyList_GET_ITEM(children.ptr(), i);
      if (c != Py_None) {
        stack.push_back(py::reinterpret_borrow<py::object>(c));
      }
    }
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
        if (classes.nan == nullptr) {
          throw py::error_already_set();
        }
      },
      "The classes _walk tells apart: nn.Parameter, torch.Tensor, the module types the Python "
      "walk may refuse, the attribute types held by value");
  m.def("_walk", &walk, py::arg("model"), py::arg("graphed"), py::arg("replicas"),
        "ReplicaSet.walk(graphed) for a model of replicas replicas, or None where the Python "
        "walk must run (it raises, or handles a module the C walk leaves to it)");
}

}  // namespace dpcuda
