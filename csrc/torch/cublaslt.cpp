// A linear layer's small GEMMs through cuBLASLt with algorithms of one pass over K: the forward
// with its bias (BIAS epilogue), the input gradient, and the weight gradient, with the bias
// gradient in the same call where it is wanted (BGRADB epilogue: the GEMM and one cuBLASLt
// kernel for the bias). On an H100 cuBLAS ran the weight-gradient GEMM of a small MLP as 4
// kernels (a beta scaling, a split-K GEMM, the split-K reduction, an epilogue): this is one.
#ifdef DPCUDA_WITH_CUDA

#include "cublaslt.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cublasLt.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace dpcuda {
namespace {

std::atomic<int> lt_mode{-1};  // -1: not read yet; 0: off; 1: on

// cuBLASLt's handle wants a current CUDA context (bind_cuda_context).
cublasLtHandle_t handle(int device) {
  bind_cuda_context(device);
  return at::cuda::getCurrentCUDABlasLtHandle();
}
std::atomic<int64_t> lt_calls{0};

bool lt_on() {
  int mode = lt_mode.load();
  if (mode < 0) {
    const char* env = std::getenv("DPCUDA_CUBLASLT");
    mode = env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1;
    int expected = -1;
    lt_mode.compare_exchange_strong(expected, mode);
    mode = lt_mode.load();
  }
  return mode == 1;
}

// The largest power of two up to 256 that divides the address (what cuBLASLt's alignment
// preferences ask for).
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

struct Types {
  cudaDataType_t data;
  cublasComputeType_t compute;
  cudaDataType_t scale;
};

std::optional<Types> types_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      // As at::mm: TF32 only where torch allows it for cuBLAS.
      return Types{CUDA_R_32F,
                   at::globalContext().allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                         : CUBLAS_COMPUTE_32F,
                   CUDA_R_32F};
    case at::kHalf:
      return Types{CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kBFloat16:
      return Types{CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    default:
      return std::nullopt;  // double: cuBLASLt has no bias-gradient epilogue for it
  }
}

// One GEMM as cuBLASLt sees it (column-major): D (m x n, ld m) = op(A) * op(B) (k deep), with
// an epilogue (none, add a bias of m, or the bias gradient: op(B)'s sums over k, n of them).
struct Gemm {
  bool trans_a, trans_b;
  int64_t m, n, k;
  cublasLtEpilogue_t epilogue;
};

// The descriptors of one call, destroyed with it.
struct Call {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  bool ok = true;

  Call(const Types& t, const Gemm& g, void* bias) {
    // A is stored m x k (k x m when transposed), B k x n (n x k), both packed.
    ok = cublasLtMatmulDescCreate(&desc, t.compute, t.scale) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&a, t.data, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k,
                                    g.trans_a ? g.k : g.m) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&b, t.data, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n,
                                    g.trans_b ? g.n : g.k) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&d, t.data, g.m, g.n, g.m) == CUBLAS_STATUS_SUCCESS;
    if (!ok) return;
    const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    ok = set(CUBLASLT_MATMUL_DESC_TRANSA, op_a) && set(CUBLASLT_MATMUL_DESC_TRANSB, op_b) &&
         set(CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue) &&
         (bias == nullptr || set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias));
  }
  template <typename V>
  bool set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)) ==
           CUBLAS_STATUS_SUCCESS;
  }
  ~Call() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
};

struct Key {
  int device, dtype, compute, trans_a, trans_b, epilogue;
  int64_t m, n, k;
  uint32_t align_a, align_b, align_d, align_bias;
  auto tied() const {
    return std::tie(device, dtype, compute, trans_a, trans_b, epilogue, m, n, k, align_a,
                    align_b, align_d, align_bias);
  }
  bool operator<(const Key& o) const { return tied() < o.tied(); }
};

struct Choice {
  bool found = false;
  cublasLtMatmulAlgo_t algo;
};

std::mutex cache_mutex;
std::map<Key, Choice> cache;

// The first of the heuristic's algorithms that makes the GEMM in one pass over K: no split-K,
// so no reduction kernel, no atomics and no workspace (on an H100, benchmarks/probe_cublaslt.py:
// one kernel, plus one for a bias gradient, where cuBLAS's choice for the MLP's weight gradients
// launches four).
Choice choose(const Types& t, const Gemm& g, const Key& k, void* bias) {
  Choice choice;
  Call call(t, g, bias);
  if (!call.ok) return choice;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return choice;
  struct Destroy {
    cublasLtMatmulPreference_t p;
    ~Destroy() { cublasLtMatmulPreferenceDestroy(p); }
  } destroy{pref};
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)) ==
           CUBLAS_STATUS_SUCCESS;
  };
  const bool prefs = set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(0)) &&
                     set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, k.align_a) &&
                     set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, k.align_b) &&
                     set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, k.align_d) &&
                     set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, k.align_d);
  constexpr int kAsked = 16;
  cublasLtMatmulHeuristicResult_t results[kAsked];
  int returned = 0;
  if (prefs && cublasLtMatmulAlgoGetHeuristic(handle(k.device), call.desc,
                                              call.a, call.b, call.d, call.d, pref, kAsked,
                                              results, &returned) == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < returned && !choice.found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS || results[i].workspaceSize != 0) continue;
      int32_t splits = 1;
      uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
      size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                               &splits, sizeof(splits), &written) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo,
                                               CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                               sizeof(scheme), &written) !=
              CUBLAS_STATUS_SUCCESS ||
          splits > 1 || scheme != CUBLASLT_REDUCTION_SCHEME_NONE) {
        continue;
      }
      choice.found = true;
      choice.algo = results[i].algo;
    }
  }
  return choice;
}

// Above this many multiply-adds a split-K GEMM is worth its extra kernels: on the H100 the
// one-pass algorithm took 88 us for 4096 x 784 x 256 (822M) where cuBLAS's split-K took 68 us
// plus the bias pass, and was level at 256 x 784 x 256 (51M), where launches dominate.
constexpr double kMaxMacs = double(1 << 28);

struct Plan {
  Types types;
  Gemm gemm;
  Key key;
};

// a, b, d: the row-major tensors whose pointers cuBLASLt reads and writes (a is its A).
std::optional<Plan> plan(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                         const at::Tensor& bias, const Gemm& g) {
  if (!lt_on() || !a.is_contiguous() || !b.is_contiguous() || !d.is_contiguous() ||
      (bias.defined() && !bias.is_contiguous())) {
    return std::nullopt;
  }
  const auto types = types_of(d.scalar_type());
  if (!types) return std::nullopt;
  // cuBLASLt takes int32 dimensions; an empty one is dpcuda's own path's (zeros, or the bias).
  constexpr int64_t kMax = 0x7fffffff;
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.m > kMax || g.n > kMax || g.k > kMax ||
      double(g.m) * double(g.n) * double(g.k) > kMaxMacs) {
    return std::nullopt;
  }
  const uint32_t align_bias = bias.defined() ? alignment(bias.data_ptr()) : 256;
  if (align_bias < 16) return std::nullopt;
  Key key{d.device().index(), static_cast<int>(d.scalar_type()),
          static_cast<int>(types->compute), g.trans_a, g.trans_b, static_cast<int>(g.epilogue),
          g.m, g.n, g.k, alignment(a.data_ptr()), alignment(b.data_ptr()),
          alignment(d.data_ptr()), align_bias};
  return Plan{*types, g, key};
}

Choice lookup(const Plan& p, void* bias) {
  {
    const std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(p.key);
    if (it != cache.end()) return it->second;
  }
  const Choice choice = choose(p.types, p.gemm, p.key, bias);
  const std::lock_guard<std::mutex> lock(cache_mutex);
  return cache.emplace(p.key, choice).first->second;
}

bool run(const Plan& p, const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
         const at::Tensor& bias) {
  void* bias_ptr = bias.defined() ? bias.data_ptr() : nullptr;
  const Choice choice = lookup(p, bias_ptr);
  if (!choice.found) return false;
  Call call(p.types, p.gemm, bias_ptr);
  if (!call.ok) return false;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status = cublasLtMatmul(
      handle(p.key.device), call.desc, &alpha, a.data_ptr(), call.a,
      b.data_ptr(), call.b, &beta, d.data_ptr(), call.d, d.data_ptr(), call.d, &choice.algo,
      nullptr, 0, at::cuda::getCurrentCUDAStream());
  if (status != CUBLAS_STATUS_SUCCESS) return false;
  lt_calls.fetch_add(1);
  return true;
}

// grad_weight (out x in) row-major is D (in x out): A = x (rows x in row-major: in x rows, not
// transposed), op(B) = g (rows x out row-major: out x rows, transposed); BGRADB sums op(B) over
// k = rows into grad_bias (out).
Gemm weight_grad_gemm(const at::Tensor& g, const at::Tensor& x, bool bias) {
  return Gemm{false, true, x.size(1), g.size(1), x.size(0),
              bias ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT};
}

// out (rows x out_features) row-major is D (out_features x rows) = op(A) = W (stored in x out,
// transposed) times B = x (in x rows), plus the bias (out_features) down each column.
Gemm forward_gemm(const at::Tensor& x, const at::Tensor& weight, bool bias) {
  return Gemm{true, false, weight.size(0), x.size(0), x.size(1),
              bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT};
}

}  // namespace

void bind_cuda_context(int device) {
  thread_local uint64_t bound = 0;  // a bit per device index below 64
  if (device >= 0 && device < 64 && !(bound & (uint64_t(1) << device))) {
    C10_CUDA_CHECK(c10::cuda::SetDevice(static_cast<c10::DeviceIndex>(device), true));
    bound |= uint64_t(1) << device;
  }
}

bool weight_grad_lt_available(const at::Tensor& g, const at::Tensor& x,
                              const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  const auto p = plan(x, g, grad_weight, grad_bias, weight_grad_gemm(g, x, grad_bias.defined()));
  return p && lookup(*p, grad_bias.defined() ? grad_bias.data_ptr() : nullptr).found;
}

bool weight_grad_lt(const at::Tensor& g, const at::Tensor& x, const at::Tensor& grad_weight,
                    const at::Tensor& grad_bias) {
  const auto p = plan(x, g, grad_weight, grad_bias, weight_grad_gemm(g, x, grad_bias.defined()));
  return p && run(*p, x, g, grad_weight, grad_bias);
}

bool input_grad_lt(const at::Tensor& g, const at::Tensor& weight, const at::Tensor& grad_input) {
  // grad_input (rows x in) row-major is D (in x rows) = A = W (in x out, not transposed) times
  // B = g (out x rows).
  const Gemm gemm{false, false, weight.size(1), g.size(0), weight.size(0),
                  CUBLASLT_EPILOGUE_DEFAULT};
  const auto p = plan(weight, g, grad_input, at::Tensor(), gemm);
  return p && run(*p, weight, g, grad_input, at::Tensor());
}

bool linear_lt(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
               const at::Tensor& out) {
  const Gemm gemm = forward_gemm(x, weight, bias.defined());
  const auto p = plan(weight, x, out, bias, gemm);
  return p && run(*p, weight, x, out, bias);
}

bool set_cublaslt(bool on) {
  const bool previous = lt_on();
  lt_mode.store(on ? 1 : 0);
  return previous;
}

int64_t cublaslt_calls() { return lt_calls.load(); }

}  // namespace dpcuda

#endif  // DPCUDA_WITH_CUDA
