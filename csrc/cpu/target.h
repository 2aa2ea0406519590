// Function multiversioning for the CPU kernels' loops: with GCC on x86-64 Linux each marked
// function is compiled three times, for x86-64-v4 (AVX-512), for x86-64-v3 (AVX2 + FMA) and for
// the baseline, and the loader picks the one the CPU runs (an ifunc, resolved once). The wheel's
// baseline is SSE2 only, which would leave the vectorised loops at a quarter of AVX2's width,
// while ATen's own kernels dispatch to AVX2 or AVX-512 (`torch.backends.cpu.
// get_cpu_capability()`): on an AVX-512 machine the AVX2 loops ran the exp-based activations at
// 0.7x the speed of the same loops in 512-bit vectors (benchmarks/results, issue #27).
// Elsewhere the macro is empty and the baseline build is all there is.
//
// Every clone computes the same bits: the loops are elementwise, or accumulate in an order the
// vector width does not change (no -fassociative-math), and -ffp-contract=off keeps the FMA
// units of v3 and v4 from fusing what the baseline rounds twice. tests/cpp/cpu_bits.cpp checks
// it: DPCUDA_CPU_TARGET builds the kernels for one target alone (a test build's knob).
// The polynomials' fused multiply-adds are one instruction in the v3 and v4 clones; the baseline
// clone, and a build without clones (clang, GCC < 11) for a CPU target without FMA, call libm's
// fmaf for them: the same bits, but loops that no longer vectorise.
#pragma once

#if defined(DPCUDA_CPU_TARGET)
#define DPCUDA_CPU_CLONES __attribute__((target(DPCUDA_CPU_TARGET)))
#elif defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__) && __GNUC__ >= 11
#define DPCUDA_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DPCUDA_CPU_CLONES
#endif
