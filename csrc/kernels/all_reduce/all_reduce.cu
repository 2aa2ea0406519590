#include "all_reduce.h"

#include <algorithm>

#include "../common.cuh"
#include "../optim/clip.h"
#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The wrapper's SGD (DataParallel's lr, momentum and weight_decay) as dpcuda.optim's SGD
// (optim/update.h: one element formula for every update): torch.optim.SGD with dampening 0 and
// no Nesterov, its momentum buffer starting at zero, the values in the accumulation type A.
template <typename A>
__device__ __forceinline__ optim::Hyper<A> sgd_hyper(const SgdArgs& s, bool use_momentum) {
  double v[optim::kHyper] = {};
  v[optim::kLr] = s.lr;
  v[optim::kWeightDecay] = s.weight_decay;
  v[optim::kMomentum] = s.momentum;
  v[optim::kOneMinusDampening] = 1.0;
  return optim::Hyper<A>(v, use_momentum, false);
}

// What the records say (StepRecords): skip the update, or apply it with the gradient times fix.
struct Verdict {
  bool skip;
  double fix;
};

// Thread 0 reads the records once for the block (and block 0's writes the loss); the others
// take its verdict after the barrier.
__device__ __forceinline__ Verdict read_records(const StepRecords& records) {
  __shared__ int skip;
  __shared__ double fix;
  if (threadIdx.x == 0) {
    int s = 0;
    double loss = 0.0, rows = 0.0;
    for (int r = 0; r < records.n; ++r) {
      const double* rec = records.ptr[r];
      s |= rec[1] != 0.0 || rec[2] != 0.0 ? 1 : 0;
      loss += rec[0];
      rows += rec[3];
    }
    double f = 1.0;
    if (records.scaled_by > 0.0) {
      if (rows > 0.0) {
        f = records.scaled_by / rows;
        loss = mul_rn(loss, f);
      } else {
        loss = static_cast<double>(NAN);  // a mean over no rows, as torch's
      }
    }
    skip = s;
    fix = f;
    if (records.loss_out != nullptr && blockIdx.x == 0) *records.loss_out = loss;
  }
  __syncthreads();
  return {skip != 0, fix};
}

// The reduced gradient (already rounded to T) times the records' fix, rounded to T again.
template <typename T, typename A>
__device__ __forceinline__ A rescaled(A g, bool rescale, A fix) {
  return rescale ? to_acc(from_acc<T>(mul_rn(g, fix))) : g;
}

// The element-wise kernels below (reduce_sgd, chain, sgd) move kLanes<T> elements per thread
// and iteration: 16 bytes of the accumulation type (4 floats, 2 doubles; 4 halves, 8 bytes)
// when every pointer is aligned to a whole pack at the range's start, else one element. Each
// is a functor whose run<K>(i) handles elements i .. i+K-1, and for_each_pack drives it.
template <typename T>
constexpr int kLanes = static_cast<int>(16 / sizeof(acc_t<T>));
// The plain reduction reads and writes only T: 16 bytes of it.
template <typename T>
constexpr int kReduceLanes = static_cast<int>(16 / sizeof(T));

template <typename T, int K>
struct alignas(sizeof(T) * K) Pack {
  T v[K];
};

template <int K, typename T>
__device__ __forceinline__ Pack<T, K> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, K>*>(p);
}

template <int K, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, K>& x) {
  *reinterpret_cast<Pack<T, K>*>(p) = x;
}

// Grid-stride over [begin, end): whole packs of K first (when vectorised), then the tail one
// element at a time by the same threads.
template <int K, typename Op>
__device__ __forceinline__ void for_each_pack(const Op& op, int64_t begin, int64_t end,
                                              bool vectorised) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_from = begin;
  if (vectorised) {
    const int64_t packs = (end - begin) / K;
    for (int64_t v = tid; v < packs; v += stride) op.template run<K>(begin + v * K);
    scalar_from = begin + packs * K;
  }
  for (int64_t i = scalar_from + tid; i < end; i += stride) op.template run<1>(i);
}

// The fixed-order sum (in[0] + in[1] + ..., then / nin for a mean) of elements i .. i+K-1, in
// the accumulation type: what every algorithm computes, so every algorithm gives the same bits.
template <int K, typename T>
__device__ __forceinline__ void sum_pack(const Replicas<const T>& in, int nin, int64_t i,
                                         bool mean, acc_t<T> (&acc)[K]) {
  Pack<T, K> x = load_pack<K>(in.ptr[0] + i);
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = to_acc(x.v[k]);
  for (int r = 1; r < nin; ++r) {
    x = load_pack<K>(in.ptr[r] + i);
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = acc[k] + to_acc(x.v[k]);
  }
  if (mean) {
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = acc[k] / static_cast<acc_t<T>>(nin);
  }
}

// The sum (or mean) of the replicas, written to every out.
template <typename T>
struct ReduceOp {
  const Replicas<const T>& in;
  int nin;
  const Replicas<T>& out;
  int nout;
  bool mean;

  template <int K>
  __device__ __forceinline__ void run(int64_t i) const {
    acc_t<T> acc[K];
    sum_pack<K>(in, nin, i, mean, acc);
    Pack<T, K> y;
#pragma unroll
    for (int k = 0; k < K; ++k) y.v[k] = from_acc<T>(acc[k]);
    for (int o = 0; o < nout; ++o) store_pack<K>(out.ptr[o] + i, y);
  }
};

// 16 bytes of T per thread when aligned (4 floats, 2 doubles, 8 halves), grid-stride; the tail
// past the last whole pack element by element by the same threads.
template <typename T>
__global__ void reduce_kernel(const __grid_constant__ Replicas<const T> in, int nin,
                              const __grid_constant__ Replicas<T> out, int nout,
                              int64_t begin, int64_t end, bool mean, bool vectorised) {
  const ReduceOp<T> op{in, nin, out, nout, mean};
  for_each_pack<kReduceLanes<T>>(op, begin, end, vectorised);
}

// Sum of the gradients in replica order, the step on replica 0's parameters and momentum, the
// results written to every replica. Holds references to the kernel's __grid_constant__
// parameters, so the pointer arrays stay in parameter space.
template <typename T>
struct ReduceSgdOp {
  const Replicas<const T>& grads;
  int ngrads;
  const Replicas<T>& params;
  int nparams;
  const Replicas<T>& momenta;
  int nmomenta;
  bool mean;
  const optim::Hyper<acc_t<T>>& sgd;
  bool rescale;
  acc_t<T> fix;

  template <int K>
  __device__ __forceinline__ void run(int64_t i) const {
    using A = acc_t<T>;
    A g[K];
    sum_pack<K>(grads, ngrads, i, mean, g);
    const Pack<T, K> p = load_pack<K>(params.ptr[0] + i);
    Pack<T, K> m{};
    if (nmomenta) m = load_pack<K>(momenta.ptr[0] + i);
    Pack<T, K> np, nm;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      // The reduced gradient is rounded to T, as the unfused path (all-reduce, then SGD)
      // stores it, so every algorithm gives the same bits for the half types too.
      const A gk = rescaled<T>(to_acc(from_acc<T>(g[k])), rescale, fix);
      A mk = nmomenta ? to_acc(m.v[k]) : A(0);
      np.v[k] = from_acc<T>(optim::sgd(gk, to_acc(p.v[k]), mk, sgd));
      nm.v[k] = from_acc<T>(mk);
    }
    for (int o = 0; o < nparams; ++o) store_pack<K>(params.ptr[o] + i, np);
    for (int o = 0; o < nmomenta; ++o) store_pack<K>(momenta.ptr[o] + i, nm);
  }
};

template <typename T>
__global__ void reduce_sgd_kernel(const __grid_constant__ Replicas<const T> grads, int ngrads,
                                  const __grid_constant__ Replicas<T> params, int nparams,
                                  const __grid_constant__ Replicas<T> momenta, int nmomenta,
                                  int64_t begin, int64_t end, bool mean,
                                  const __grid_constant__ SgdArgs sgd,
                                  const __grid_constant__ StepRecords records, bool vectorised) {
  Verdict v{false, 1.0};
  if (records.n > 0) v = read_records(records);
  if (v.skip) return;
  const optim::Hyper<acc_t<T>> in = sgd_hyper<acc_t<T>>(sgd, nmomenta > 0);
  const ReduceSgdOp<T> op{grads, ngrads, params, nparams, momenta, nmomenta, mean, in,
                          v.fix != 1.0, static_cast<acc_t<T>>(v.fix)};
  for_each_pack<kLanes<T>>(op, begin, end, vectorised);
}

// Sum of the gradients in replica order, an optimizer's update of params.ptr[0]'s values and the
// state, the parameter written to every replica. References the kernel's __grid_constant__
// parameters, as ReduceSgdOp.
template <typename T>
struct ReduceUpdateOp {
  const Replicas<const T>& grads;
  int ngrads;
  const Replicas<T>& params;
  int nparams;
  T* s1;
  T* s2;
  T* s3;
  bool mean;
  optim::Kind kind;
  const optim::Hyper<acc_t<T>>& h;
  const double* scale;
  bool rescale;
  acc_t<T> fix;

  template <int K>
  __device__ __forceinline__ void run(int64_t i) const {
    using A = acc_t<T>;
    A g[K];
    sum_pack<K>(grads, ngrads, i, mean, g);
    if (rescale) {
#pragma unroll
      for (int k = 0; k < K; ++k) g[k] = rescaled<T>(to_acc(from_acc<T>(g[k])), true, fix);
    }
    if (scale) {
      // torch's clip_grad_norm_: grad.mul_(clip_coef), the product rounded to T.
      const A s = static_cast<A>(*scale);
#pragma unroll
      for (int k = 0; k < K; ++k) g[k] = to_acc(from_acc<T>(mul_rn(to_acc(from_acc<T>(g[k])), s)));
    }
    const Pack<T, K> p = load_pack<K>(params.ptr[0] + i);
    Pack<T, K> a{}, b{}, c{};
    if (s1) a = load_pack<K>(s1 + i);
    if (s2) b = load_pack<K>(s2 + i);
    if (s3) c = load_pack<K>(s3 + i);
    Pack<T, K> np;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const A gk = to_acc(from_acc<T>(g[k]));
      const A pk = to_acc(p.v[k]);
      if (kind == optim::Kind::kSgd) {
        A buf = s1 && !h.has(optim::kFirst) ? to_acc(a.v[k]) : A(0);
        np.v[k] = from_acc<T>(optim::sgd(gk, pk, buf, h));
        a.v[k] = from_acc<T>(buf);
      } else {
        A m = to_acc(a.v[k]), v = to_acc(b.v[k]), w = s3 ? to_acc(c.v[k]) : A(0);
        np.v[k] = from_acc<T>(optim::adam(gk, pk, m, v, w, h));
        a.v[k] = from_acc<T>(m);
        b.v[k] = from_acc<T>(v);
        c.v[k] = from_acc<T>(w);
      }
    }
    for (int o = 0; o < nparams; ++o) store_pack<K>(params.ptr[o] + i, np);
    if (s1) store_pack<K>(s1 + i, a);
    if (s2) store_pack<K>(s2 + i, b);
    if (s3) store_pack<K>(s3 + i, c);
  }
};

template <typename T>
__global__ void reduce_update_kernel(const __grid_constant__ Replicas<const T> grads, int ngrads,
                                     const __grid_constant__ Replicas<T> params, int nparams,
                                     T* s1, T* s2, T* s3, int64_t begin, int64_t end, bool mean,
                                     optim::Kind kind, const double* hyper, bool vectorised,
                                     const double* scale,
                                     const __grid_constant__ StepRecords records) {
  Verdict v{false, 1.0};
  if (records.n > 0) v = read_records(records);
  if (v.skip) return;
  const optim::Hyper<acc_t<T>> h(hyper, s1 != nullptr, s3 != nullptr);
  const ReduceUpdateOp<T> op{grads, ngrads, params, nparams, s1, s2, s3, mean, kind, h, scale,
                             v.fix != 1.0, static_cast<acc_t<T>>(v.fix)};
  for_each_pack<kLanes<T>>(op, begin, end, vectorised);
}

// The lanes' sums of a block added as clip.h's tree; lane 0 ends with the total.
__device__ __forceinline__ double block_tree(double* s, int l) {
  __syncthreads();
  for (int w = optim::kNormLanes / 2; w > 0; w /= 2) {
    if (l < w) s[l] = add_rn(s[l], s[l + w]);
    __syncthreads();
  }
  return s[0];
}

template <typename T>
__global__ void reduce_square_sum_kernel(const __grid_constant__ Replicas<const T> in, int nin,
                                         T* out, int64_t len, bool mean, double* partials,
                                         const __grid_constant__ StepRecords records) {
  using A = acc_t<T>;
  Verdict v{false, 1.0};
  if (records.n > 0) v = read_records(records);
  const bool rescale = v.fix != 1.0;
  const A fix = static_cast<A>(v.fix);
  __shared__ double s[optim::kNormLanes];
  const int l = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * optim::kNormChunk;
  double acc = 0.0;
  for (int j = 0; j < optim::kNormPerLane; ++j) {
    const int64_t i = base + l + static_cast<int64_t>(j) * optim::kNormLanes;
    if (i >= len) break;
    A x = to_acc(in.ptr[0][i]);
    for (int r = 1; r < nin; ++r) x = x + to_acc(in.ptr[r][i]);
    if (mean) x = x / static_cast<A>(nin);
    const T t = from_acc<T>(rescaled<T>(to_acc(from_acc<T>(x)), rescale, fix));
    if (out) out[i] = t;
    const double v = static_cast<double>(to_acc(t));
    acc = add_rn(acc, mul_rn(v, v));
  }
  s[l] = acc;
  const double total = block_tree(s, l);
  if (l == 0) partials[blockIdx.x] = total;
}

// A value of the accumulation type stored as T and read back (clip.h's rounding).
template <typename T>
struct RoundTo {
  __device__ __forceinline__ acc_t<T> operator()(acc_t<T> x) const {
    return to_acc(from_acc<T>(x));
  }
};

template <typename T>
__global__ void clip_coefficient_kernel(const __grid_constant__ NormParts parts, double max_norm,
                                        double* coef, T* norm_out,
                                        const __grid_constant__ StepRecords records) {
  using A = acc_t<T>;
  Verdict v{false, 1.0};
  if (records.n > 0) v = read_records(records);
  __shared__ double s[optim::kNormLanes];
  const int l = threadIdx.x;
  // Lane l sums the partials at l, l + kNormLanes, ... of the shards' concatenation.
  double acc = 0.0;
  int64_t offset = 0;
  for (int k = 0; k < parts.n; ++k) {
    const int64_t first = offset + ((l - offset) % optim::kNormLanes + optim::kNormLanes) %
                                       optim::kNormLanes;
    for (int64_t g = first; g < offset + parts.count[k]; g += optim::kNormLanes) {
      acc = add_rn(acc, parts.ptr[k][g - offset]);
    }
    offset += parts.count[k];
  }
  s[l] = acc;
  const double total = block_tree(s, l);
  if (l == 0) {
    A norm;
    const A c = optim::clip_coefficient<A>(total, max_norm, &norm, RoundTo<T>{});
    *coef = static_cast<double>(c);
    // (a skipped step's norm is NaN: nothing was clipped, and no number to act on)
    if (norm_out) *norm_out = from_acc<T>(v.skip ? static_cast<A>(NAN) : norm);
  }
}

// One link of the ring's chain: work (or final_out, divided by divide_by when positive) =
// previous partial (prev_x in T, or prev_acc in the accumulation type) + own.
template <typename T, typename A>
struct ChainOp {
  const T* prev_x;
  const A* prev_acc;
  const T* own;
  A* work;
  T* final_out;
  int divide_by;

  template <int K>
  __device__ __forceinline__ void run(int64_t i) const {
    A acc[K];
    if (prev_x) {
      const Pack<T, K> x = load_pack<K>(prev_x + i);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = to_acc(x.v[k]);
    } else {
      const Pack<A, K> x = load_pack<K>(prev_acc + i);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = x.v[k];
    }
    const Pack<T, K> o = load_pack<K>(own + i);
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = acc[k] + to_acc(o.v[k]);
    if (final_out) {
      Pack<T, K> y;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        y.v[k] = from_acc<T>(divide_by > 0 ? acc[k] / static_cast<A>(divide_by) : acc[k]);
      }
      store_pack<K>(final_out + i, y);
    } else {
      Pack<A, K> y;
#pragma unroll
      for (int k = 0; k < K; ++k) y.v[k] = acc[k];
      store_pack<K>(work + i, y);
    }
  }
};

template <typename T, typename A>
__global__ void chain_kernel(const T* prev_x, const A* prev_acc, const T* own, A* work,
                             T* final_out, int64_t begin, int64_t end, int divide_by,
                             bool vectorised) {
  const ChainOp<T, A> op{prev_x, prev_acc, own, work, final_out, divide_by};
  for_each_pack<kLanes<T>>(op, begin, end, vectorised);
}

// The SGD step of one replica from its own (already reduced) gradient.
template <typename T>
struct SgdOp {
  const T* grad;
  T* param;
  T* momentum;
  const optim::Hyper<acc_t<T>>& sgd;
  bool rescale;
  acc_t<T> fix;

  template <int K>
  __device__ __forceinline__ void run(int64_t i) const {
    using A = acc_t<T>;
    const Pack<T, K> g = load_pack<K>(grad + i);
    const Pack<T, K> p = load_pack<K>(param + i);
    Pack<T, K> m{};
    if (momentum) m = load_pack<K>(momentum + i);
    Pack<T, K> np, nm;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      A mk = momentum ? to_acc(m.v[k]) : A(0);
      np.v[k] = from_acc<T>(optim::sgd(rescaled<T>(to_acc(g.v[k]), rescale, fix),
                                       to_acc(p.v[k]), mk, sgd));
      nm.v[k] = from_acc<T>(mk);
    }
    store_pack<K>(param + i, np);
    if (momentum) store_pack<K>(momentum + i, nm);
  }
};

template <typename T>
__global__ void sgd_kernel(const T* grad, T* param, T* momentum, int64_t n,
                           const __grid_constant__ SgdArgs sgd,
                           const __grid_constant__ StepRecords records, bool vectorised) {
  Verdict v{false, 1.0};
  if (records.n > 0) v = read_records(records);
  if (v.skip) return;
  const optim::Hyper<acc_t<T>> in = sgd_hyper<acc_t<T>>(sgd, momentum != nullptr);
  const SgdOp<T> op{grad, param, momentum, in, v.fix != 1.0, static_cast<acc_t<T>>(v.fix)};
  for_each_pack<kLanes<T>>(op, 0, n, vectorised);
}

int blocks_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min(ceil_div(work, kThreads), max_grid_x())));
}


// Whether p is aligned to a whole pack of `lanes` elements of its type U (T or acc_t<T>); a
// null pointer (an absent buffer) does not count against it.
template <typename T, typename U>
bool pack_aligned(const U* p, int lanes = kLanes<T>) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (sizeof(U) * lanes) == 0;
}

// The most blocks step_status launches: enough to keep every SM of a large GPU streaming.
constexpr int kStatusBlocks = 264;

template <typename T, typename L>
__global__ void step_status_kernel(const T* __restrict__ grad, int64_t n, const L* loss,
                                   int64_t loss_n, const int64_t* labels, int64_t labels_n,
                                   int64_t ignore_index, int* label_flag, bool clear_flag,
                                   int* work, double* record) {
  static_assert((kThreads & (kThreads - 1)) == 0, "the loss sum halves the block");
  __shared__ int block_bad;
  __shared__ int is_last;
  __shared__ double sums[kThreads];
  __shared__ long long counts[kThreads];
  if (threadIdx.x == 0) block_bad = 0;
  __syncthreads();
  int bad = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    bad |= is_finite(to_acc(grad[i])) ? 0 : 1;
  }
  if (bad) atomicOr(&block_bad, 1);
  __syncthreads();
  // work[0]: the ticket counter; work[1 + b]: block b's verdict.
  unsigned int* ticket = reinterpret_cast<unsigned int*>(work);
  if (threadIdx.x == 0) {
    work[1 + blockIdx.x] = block_bad;
    __threadfence();  // the verdict is visible before the ticket says this block is done
    is_last = atomicAdd(ticket, 1u) == gridDim.x - 1 ? 1 : 0;
  }
  __syncthreads();
  if (!is_last) return;  // the rest is the last block's
  __threadfence();  // every other block's verdict is visible
  // The loss: the sum of its elements in float64, in an order fixed by loss_n alone (each
  // thread's stride, then halving), so it never depends on the grid.
  // The rows that count (labels not ignored) the same way, in the same tree.
  double s = 0.0;
  if (loss != nullptr) {
    for (int64_t i = threadIdx.x; i < loss_n; i += blockDim.x) s += static_cast<double>(loss[i]);
  }
  long long c = 0;
  if (labels != nullptr) {
    for (int64_t i = threadIdx.x; i < labels_n; i += blockDim.x) {
      c += labels[i] != ignore_index ? 1 : 0;
    }
  }
  sums[threadIdx.x] = s;
  counts[threadIdx.x] = c;
  for (unsigned int half = kThreads / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.x < half) {
      sums[threadIdx.x] += sums[threadIdx.x + half];
      counts[threadIdx.x] += counts[threadIdx.x + half];
    }
  }
  if (threadIdx.x != 0) return;
  int any = 0;
  for (unsigned int b = 0; b < gridDim.x; ++b) {
    any |= *static_cast<volatile int*>(work + 1 + b);
  }
  record[0] = loss != nullptr ? sums[0] : static_cast<double>(NAN);
  record[1] = any ? 1.0 : 0.0;
  record[2] = label_flag != nullptr ? static_cast<double>(*label_flag) : 0.0;
  record[3] = static_cast<double>(counts[0]);
  if (clear_flag && label_flag != nullptr) *label_flag = 0;
  *ticket = 0u;  // ready for the next launch
}

}  // namespace

int64_t step_status_workspace() { return 1 + kStatusBlocks; }

template <typename T, typename L>
cudaError_t step_status(const T* grad, int64_t n, const L* loss, int64_t loss_n,
                        const int64_t* labels, int64_t labels_n, int64_t ignore_index,
                        int* label_flag, bool clear_flag, int* work, double* record,
                        cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>(kStatusBlocks, blocks_for(n));
  return launch(step_status_kernel<T, L>, dim3(static_cast<unsigned int>(blocks)),
                dim3(kThreads), 0, stream, grad, n, loss, loss_n, labels, labels_n,
                ignore_index, label_flag, clear_flag, work, record);
}

template <typename T>
cudaError_t reduce_range(Replicas<const T> in, int nin, Replicas<T> out, int nout,
                         int64_t begin, int64_t end, bool mean, cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  bool vectorised = true;
  for (int r = 0; r < nin; ++r) vectorised &= pack_aligned<T>(in.ptr[r] + begin, kReduceLanes<T>);
  for (int o = 0; o < nout; ++o) vectorised &= pack_aligned<T>(out.ptr[o] + begin, kReduceLanes<T>);
  const int64_t work = vectorised ? ceil_div(end - begin, kReduceLanes<T>) : end - begin;
  return launch(reduce_kernel<T>, dim3(blocks_for(work)), dim3(kThreads), 0, stream, in, nin, out,
                nout, begin, end, mean, vectorised);
}

template <typename T>
cudaError_t reduce_sgd_range(Replicas<const T> grads, int ngrads, Replicas<T> params,
                             int nparams, Replicas<T> momenta, int nmomenta, int64_t begin,
                             int64_t end, bool mean, SgdArgs sgd, StepRecords records,
                             cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  bool vectorised = true;
  for (int r = 0; r < ngrads; ++r) vectorised &= pack_aligned<T>(grads.ptr[r] + begin);
  for (int o = 0; o < nparams; ++o) vectorised &= pack_aligned<T>(params.ptr[o] + begin);
  for (int o = 0; o < nmomenta; ++o) vectorised &= pack_aligned<T>(momenta.ptr[o] + begin);
  const int64_t work = vectorised ? ceil_div(end - begin, kLanes<T>) : end - begin;
  return launch(reduce_sgd_kernel<T>, dim3(blocks_for(work)), dim3(kThreads), 0, stream, grads,
                ngrads, params, nparams, momenta, nmomenta, begin, end, mean, sgd, records,
                vectorised);
}

template <typename T>
cudaError_t reduce_update_range(Replicas<const T> grads, int ngrads, Replicas<T> params,
                                int nparams, T* s1, T* s2, T* s3, int64_t begin, int64_t end,
                                bool mean, optim::Kind kind, const double* hyper,
                                cudaStream_t stream, const double* scale, StepRecords records) {
  if (end <= begin) return cudaSuccess;
  bool vectorised = pack_aligned<T>(s1 ? s1 + begin : nullptr) &&
                    pack_aligned<T>(s2 ? s2 + begin : nullptr) &&
                    pack_aligned<T>(s3 ? s3 + begin : nullptr);
  for (int r = 0; r < ngrads; ++r) vectorised &= pack_aligned<T>(grads.ptr[r] + begin);
  for (int o = 0; o < nparams; ++o) vectorised &= pack_aligned<T>(params.ptr[o] + begin);
  const int64_t work = vectorised ? ceil_div(end - begin, kLanes<T>) : end - begin;
  return launch(reduce_update_kernel<T>, dim3(blocks_for(work)), dim3(kThreads), 0, stream,
                grads, ngrads, params, nparams, s1, s2, s3, begin, end, mean, kind, hyper,
                vectorised, scale, records);
}

template <typename T>
cudaError_t reduce_square_sum(Replicas<const T> in, int nin, T* out, int64_t len, bool mean,
                              double* partials, cudaStream_t stream, StepRecords records) {
  if (len <= 0) return cudaSuccess;
  return launch(reduce_square_sum_kernel<T>, dim3(static_cast<unsigned>(optim::norm_chunks(len))),
                dim3(optim::kNormLanes), 0, stream, in, nin, out, len, mean, partials, records);
}

template <typename T>
cudaError_t clip_coefficient(const NormParts& parts, double max_norm, double* coef, T* norm_out,
                             cudaStream_t stream, StepRecords records) {
  return launch(clip_coefficient_kernel<T>, dim3(1), dim3(optim::kNormLanes), 0, stream, parts,
                max_norm, coef, norm_out, records);
}

template <typename T, typename A>
cudaError_t chain_accumulate(const T* prev_x, const A* prev_acc, const T* own, A* work,
                             T* final_out, int64_t begin, int64_t end, int divide_by,
                             cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  const bool vectorised = pack_aligned<T>(prev_x ? prev_x + begin : nullptr) &&
                          pack_aligned<T>(prev_acc ? prev_acc + begin : nullptr) &&
                          pack_aligned<T>(own + begin) &&
                          pack_aligned<T>(work ? work + begin : nullptr) &&
                          pack_aligned<T>(final_out ? final_out + begin : nullptr);
  const int64_t items = vectorised ? ceil_div(end - begin, kLanes<T>) : end - begin;
  return launch(chain_kernel<T, A>, dim3(blocks_for(items)), dim3(kThreads), 0, stream, prev_x,
                prev_acc, own, work, final_out, begin, end, divide_by, vectorised);
}

template <typename T>
cudaError_t sgd_range(const T* grad, T* param, T* momentum, int64_t n, SgdArgs sgd,
                      StepRecords records, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const bool vectorised = pack_aligned<T>(grad) && pack_aligned<T>(param) &&
                          pack_aligned<T>(momentum);
  const int64_t items = vectorised ? ceil_div(n, kLanes<T>) : n;
  return launch(sgd_kernel<T>, dim3(blocks_for(items)), dim3(kThreads), 0, stream, grad, param,
                momentum, n, sgd, records, vectorised);
}

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template cudaError_t reduce_range<T>(Replicas<const T>, int, Replicas<T>, int, int64_t,      \
                                       int64_t, bool, cudaStream_t);                           \
  template cudaError_t reduce_sgd_range<T>(Replicas<const T>, int, Replicas<T>, int,           \
                                           Replicas<T>, int, int64_t, int64_t, bool, SgdArgs,  \
                                           StepRecords, cudaStream_t);                         \
  template cudaError_t chain_accumulate<T, acc_t<T>>(const T*, const acc_t<T>*, const T*,      \
                                                     acc_t<T>*, T*, int64_t, int64_t, int,     \
                                                     cudaStream_t);                            \
  template cudaError_t sgd_range<T>(const T*, T*, T*, int64_t, SgdArgs, StepRecords,          \
                                    cudaStream_t);                                             \
  template cudaError_t reduce_update_range<T>(Replicas<const T>, int, Replicas<T>, int, T*,    \
                                              T*, T*, int64_t, int64_t, bool, optim::Kind,     \
                                              const double*, cudaStream_t, const double*,      \
                                              StepRecords);                                    \
  template cudaError_t reduce_square_sum<T>(Replicas<const T>, int, T*, int64_t, bool, double*, \
                                            cudaStream_t, StepRecords);                        \
  template cudaError_t clip_coefficient<T>(const NormParts&, double, double*, T*, cudaStream_t, \
                                           StepRecords);                                       \
  template cudaError_t step_status<T, float>(const T*, int64_t, const float*, int64_t,        \
                                             const int64_t*, int64_t, int64_t, int*, bool,    \
                                             int*, double*, cudaStream_t);                    \
  template cudaError_t step_status<T, double>(const T*, int64_t, const double*, int64_t,      \
                                              const int64_t*, int64_t, int64_t, int*, bool,   \
                                              int*, double*, cudaStream_t);

DPCUDA_FOR_EACH_TYPE(DPCUDA_INSTANTIATE)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
