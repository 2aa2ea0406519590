// dpcuda._C._unchanged (unchanged.cpp): whether objects still hold what a replayed step's
// checks read, in one call.
#pragma once

#include <torch/extension.h>

namespace dpcuda {

void register_unchanged(py::module& m);

}  // namespace dpcuda
