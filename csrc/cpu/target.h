// Function multiversioning for the CPU kernels' loops: with GCC on x86-64 Linux each marked
// function is compiled twice, for x86-64-v3 (AVX2 + FMA) and for the baseline, and the loader
// picks the one the CPU runs (an ifunc, resolved once). The wheel's baseline is SSE2 only, which
// would leave the vectorised loops at a quarter of AVX2's width, while ATen's own kernels
// dispatch to AVX2. Elsewhere the macro is empty and the baseline build is all there is.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__) && __GNUC__ >= 11
#define DPCUDA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define DPCUDA_CPU_CLONES
#endif
