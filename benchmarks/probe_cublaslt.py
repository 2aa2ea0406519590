"""Which cuBLASLt algorithms can make a linear layer's weight gradient (and, with the BGRADB
epilogue, its bias gradient) for the MLP's shapes, how many kernels each launches, and how long
each takes: the data behind csrc/torch/cublaslt.cpp's choice. Needs a CUDA GPU; compiles a small
probe with torch.utils.cpp_extension (about a minute).

    python benchmarks/probe_cublaslt.py [--json FILE]
"""
import argparse
import glob
import json
import os
import statistics

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

static std::vector<cublasLtMatmulHeuristicResult_t> found;

struct Descs {
  cublasLtMatmulDesc_t desc; cublasLtMatrixLayout_t a, b, d;
  Descs(int64_t rows, int64_t in, int64_t out, int64_t epi, void* bias) {
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&a, CUDA_R_32F, in, rows, in);
    cublasLtMatrixLayoutCreate(&b, CUDA_R_32F, out, rows, out);
    cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, in, out, in);
    cublasOperation_t n = CUBLAS_OP_N, t = CUBLAS_OP_T;
    cublasLtEpilogue_t e = epi ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &n, sizeof(n));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e));
    if (epi) cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  }
  ~Descs() { cublasLtMatrixLayoutDestroy(a); cublasLtMatrixLayoutDestroy(b);
             cublasLtMatrixLayoutDestroy(d); cublasLtMatmulDescDestroy(desc); }
};

template <typename V> int64_t cfg(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t a) {
  V v = 0; size_t w = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, a, &v, sizeof(v), &w) != CUBLAS_STATUS_SUCCESS) return -1;
  return (int64_t)v;
}

std::vector<std::vector<int64_t>> algos(at::Tensor x, at::Tensor g, at::Tensor db, int64_t epi,
                                        int64_t reduction_mask, int64_t workspace, int64_t asked) {
  const int64_t rows = x.size(0), in = x.size(1), out = g.size(1);
  Descs d(rows, in, out, epi, db.data_ptr());
  cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
  uint64_t ws = workspace; uint32_t mask = reduction_mask;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (reduction_mask >= 0)
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask));
  found.assign(asked, cublasLtMatmulHeuristicResult_t{});
  int n = 0;
  auto st = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), d.desc, d.a, d.b, d.d, d.d,
                                           pref, asked, found.data(), &n);
  cublasLtMatmulPreferenceDestroy(pref);
  std::vector<std::vector<int64_t>> out_rows;
  if (st != CUBLAS_STATUS_SUCCESS) { found.clear(); return {{-1, (int64_t)st}}; }
  found.resize(n);
  for (int i = 0; i < n; ++i) {
    const auto& a = found[i].algo;
    out_rows.push_back({i, cfg<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID), cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                        cfg<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                        cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), cfg<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                        (int64_t)found[i].workspaceSize, (int64_t)(found[i].wavesCount * 1000), (int64_t)found[i].state});
  }
  return out_rows;
}

int64_t run(int64_t i, at::Tensor x, at::Tensor g, at::Tensor dw, at::Tensor db, int64_t epi, at::Tensor ws) {
  const int64_t rows = x.size(0), in = x.size(1), out = g.size(1);
  Descs d(rows, in, out, epi, db.data_ptr());
  float alpha = 1, beta = 0;
  return (int64_t)cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), d.desc, &alpha, x.data_ptr(), d.a,
                                 g.data_ptr(), d.b, &beta, dw.data_ptr(), d.d, dw.data_ptr(), d.d, &found[i].algo,
                                 ws.data_ptr(), found[i].workspaceSize, at::cuda::getCurrentCUDAStream());
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**", "lib",
                                  "libcublasLt.so.*"), recursive=True)
    heads = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**",
                                   "include", "cublasLt.h"), recursive=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    mod = load_inline("probe_cublaslt", cpp_sources=SOURCE, functions=["algos", "run"],
                      with_cuda=True, extra_ldflags=libs[:1], verbose=False,
                      extra_include_paths=[os.path.dirname(h) for h in heads[:1]])
    report = []
    for rows, inf, outf in [(256, 784, 256), (256, 256, 10), (4096, 784, 256)]:
        x = torch.randn(rows, inf, device="cuda")
        g = torch.randn(rows, outf, device="cuda")
        want_w, want_b = (g.double().t() @ x.double()), g.double().sum(0)
        ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        torch.mm(g.t(), x)  # cuBLAS's own, for the time to beat
        for epi, mask, wsb in [(1, -1, 0), (1, -1, 32 << 20), (1, 1, 32 << 20), (0, 1, 0), (0, -1, 32 << 20)]:
            listed = mod.algos(x, g, torch.empty(outf, device="cuda"), epi, mask, wsb, 32)
            for row in listed:
                if row[0] < 0:
                    print(f"{rows}x{inf}x{outf} epi {epi} mask {mask} ws {wsb}: heuristic status {row[1]}")
                    continue
                i = row[0]
                dw = torch.empty(outf, inf, device="cuda")
                db = torch.full((outf,), float("nan"), device="cuda")
                status = mod.run(i, x, g, dw, db, epi, ws)
                torch.cuda.synchronize()
                if status != 0:
                    print("run status", status)
                    continue
                err_w = ((dw.double() - want_w).abs().max() / want_w.abs().max()).item()
                err_b = ((db.double() - want_b).abs().max() / want_b.abs().max()).item() if epi else 0.0
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        mod.run(i, x, g, dw, db, epi, ws)
                    torch.cuda.synchronize()
                kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
                count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 3
                times = []
                for _ in range(30):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(20):
                        mod.run(i, x, g, dw, db, epi, ws)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 20 * 1000)
                rec = dict(shape=[rows, inf, outf], epilogue="BGRADB" if epi else "DEFAULT", mask=mask,
                           workspace=wsb, index=i, algo_id=row[1], tile=row[2], splitk=row[3],
                           reduction=row[4], custom=row[5], stages=row[6], ws_needed=row[7],
                           waves=row[8] / 1000, kernels_per_call=count, kernel_names=kernels,
                           us=statistics.median(times), err_w=err_w, err_b=err_b)
                report.append(rec)
                print(f"{rows}x{inf}x{outf} {rec['epilogue']:7s} mask {mask:2d} ws {wsb>>20:2d}M #{i:2d} "
                      f"id {row[1]:3d} tile {row[2]:3d} sk {row[3]:2d} red {row[4]} cust {row[5]} "
                      f"wsn {row[7]:8d} k/call {count:.0f} {statistics.median(times):7.2f} us "
                      f"errw {err_w:.1e} errb {err_b:.1e} {' | '.join(k[:40] for k in kernels)}")
        t = []
        for _ in range(30):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                torch.mm(g.t(), x)
            e.record()
            e.synchronize()
            t.append(s.elapsed_time(e) / 20 * 1000)
        print(f"{rows}x{inf}x{outf} torch.mm(g.t(), x): {statistics.median(t):.2f} us")
        report.append(dict(shape=[rows, inf, outf], torch_mm_us=statistics.median(t)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
