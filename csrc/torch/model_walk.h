// dpcuda._C._walk and _walk_setup (model_walk.cpp): DataParallel's walk over a model, in C.
#pragma once

#include <torch/extension.h>

namespace dpcuda {

void register_model_walk(py::module& m);

}  // namespace dpcuda
