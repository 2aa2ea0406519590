"""Builds dpcuda._C: a CUDA extension when torch is a CUDA build and the CUDA toolkit is found,
otherwise a CPU-only C++ extension (with a warning saying why).

Knobs (environment variables):
  CUDA_HOME               the CUDA toolkit; else /usr/local/cuda (checked for real headers).
  TORCH_CUDA_ARCH_LIST    target architectures, default "8.0;9.0+PTX" (sm_80, sm_90, PTX).
  DPCUDA_FORCE_CPU=1      build the CPU-only extension even where CUDA is available.
  MAX_JOBS                parallel compile jobs (read by torch's ninja builder).
"""

import glob
import importlib.util
import os
import shutil
import sys
import warnings

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# sm_75 (T4, the oldest architecture CUDA 13 supports) with its PTX, which newer GPUs can also
# JIT-compile; sm_80 and sm_90 machine code, and sm_90's PTX for GPUs newer than it.
DEFAULT_ARCH_LIST = "7.5+PTX;8.0;9.0+PTX"


def _is_toolkit(path):
    """A CUDA toolkit has nvcc and the runtime headers; a bin/ wrapper script alone is not one."""
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def find_cuda_home():
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        # nvcc on PATH may be a wrapper script outside the toolkit; follow links, and look two
        # levels up from the real binary only if that is a toolkit.
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for path in candidates:
        if _is_toolkit(path):
            return os.path.realpath(path)
    return None


def pip_cuda_dirs():
    """The folders of the pip CUDA wheels' `nvidia` package (none where it is not installed)."""
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations or []) if spec else []


def find_cublaslt(cuda_home):
    """Link arguments for cuBLASLt (dpcuda's own small GEMMs): the pip wheel's library, which
    torch itself loads (so the same one is used at run time), else the toolkit's."""
    for base in pip_cuda_dirs():
        hits = sorted(glob.glob(os.path.join(base, "**", "lib", "libcublasLt.so.*"), recursive=True))
        if hits:
            return {"extra_link_args": [hits[0]]}
    return {"libraries": ["cublasLt"], "library_dirs": [os.path.join(cuda_home, "lib64")]}


def find_pip_cuda_includes():
    """Header folders of the pip CUDA wheels (cuBLAS, cuSPARSE...), which torch's CUDA headers
    include but which are not under the toolkit on machines that only have the pip libraries."""
    found = []
    for base in pip_cuda_dirs():
        for header in ("cublas_v2.h", "cusparse.h"):
            for hit in glob.glob(os.path.join(base, "**", "include", header), recursive=True):
                folder = os.path.dirname(hit)
                if folder not in found:
                    found.append(folder)
    return found


# Flags of the CPU kernels, as torch builds its own: no errno from libm and no trapping floating
# point, so that loops with selects and divisions vectorise (neither changes a result); and no
# contraction into FMAs, because the loops are compiled for AVX2+FMA and for the baseline
# (csrc/cpu/target.h) and both must give the same bits. CMakeLists.txt uses the same flags.
CPU_KERNEL_FLAGS = ["-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def extension():
    import torch

    cuda_home = find_cuda_home()
    force_cpu = os.environ.get("DPCUDA_FORCE_CPU", "0") == "1"
    use_cuda = torch.version.cuda is not None and cuda_home is not None and not force_cpu
    if use_cuda:
        # torch.utils.cpp_extension reads CUDA_HOME once, at import: set it first, so its guess
        # from the nvcc wrapper on PATH is never used.
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    from torch.utils import cpp_extension

    sources = sorted(glob.glob(os.path.join("csrc", "torch", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++17"] + CPU_KERNEL_FLAGS
    if os.environ.get("DPCUDA_DEBUG_INFO", "0") != "1":
        # Without the debug information Python's flags ask for (-g): the adapters, each a
        # translation unit of ATen's headers, compile in about 60% of the time (csrc/torch/
        # module.cpp: 151 s -> 87 s on the 2-core machine), its object file 48x smaller.
        # DPCUDA_DEBUG_INFO=1 keeps it (for gdb, perf's line numbers).
        cxx_flags.append("-g0")
    if torch._C.has_openmp:
        # at::parallel_for is an inline `#pragma omp parallel` in torch's OpenMP builds: without
        # -fopenmp it silently runs on one thread. Compile only; the GOMP symbols bind to the
        # libgomp that libtorch_cpu already loads, so torch.set_num_threads governs our loops too.
        cxx_flags.append("-fopenmp")
    if not use_cuda:
        reason = (
            "DPCUDA_FORCE_CPU=1" if force_cpu
            else "torch is a CPU-only build" if torch.version.cuda is None
            else "no CUDA toolkit found (set CUDA_HOME)"
        )
        warnings.warn(f"dpcuda: building the CPU-only extension ({reason}); "
                      "CUDA kernels will not be available.")
        return cpp_extension.CppExtension(
            "dpcuda._C", sources, extra_compile_args={"cxx": cxx_flags}
        ), cpp_extension

    cpp_extension.CUDA_HOME = cuda_home
    sources += sorted(glob.glob(os.path.join("csrc", "kernels", "**", "*.cu"), recursive=True))
    includes = find_pip_cuda_includes()
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    return cpp_extension.CUDAExtension(
        "dpcuda._C",
        sources,
        include_dirs=includes,
        # The architectures, for the message of a GPU that none of them can run on.
        define_macros=[("DPCUDA_WITH_CUDA", None),
                       ("DPCUDA_CUDA_ARCHS", '"' + os.environ["TORCH_CUDA_ARCH_LIST"] + '"')],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        **find_cublaslt(cuda_home),
    ), cpp_extension


def main():
    ext, cpp_extension = extension()
    setup(
        name="dpcuda",
        version="0.1.0",
        description="Fused MLP layer kernels and peer-to-peer data-parallel training for PyTorch",
        packages=find_packages(include=["dpcuda", "dpcuda.*"]),
        ext_modules=[ext],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
        python_requires=">=3.10",
        # What `import dpcuda` and the command line need at run time besides torch (which the
        # build itself needs, so it is installed first: scripts/setup.sh).
        install_requires=["numpy", "tqdm", "scikit-learn", "matplotlib"],
        entry_points={"console_scripts": ["dpcuda=dpcuda.cli:main"]},
    )


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
