// dpcuda::interned: an attribute name as an interned Python str, made once per name and kept
// for the life of the process (model_walk.cpp, unchanged.cpp). PyObject_GetAttrString would
// make and hash a new string at every call, which was the model walk's largest cost.
#pragma once

#include <Python.h>
#include <torch/extension.h>

#include <unordered_map>

namespace dpcuda {

// name: a string literal (its address is the key). Call with the GIL held.
inline PyObject* interned(const char* name) {
  static std::unordered_map<const char*, PyObject*> names;
  auto found = names.find(name);
  if (found != names.end()) {
    return found->second;
  }
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) {
    throw py::error_already_set();
  }
  names.emplace(name, s);
  return s;
}

}  // namespace dpcuda
