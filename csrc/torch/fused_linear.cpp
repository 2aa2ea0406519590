// ATen adapters of full_forward and full_backward: checks, dtype dispatch, allocation and
// registration for the CPU and CUDA keys. The GEMMs go through ATen (MKL/oneDNN on the CPU,
// cuBLAS/cuBLASLt on CUDA); the passes around them are dpcuda's own kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "../cpu/fused_linear.h"
#include "aten_activation.h"
#include "checks.h"
#include "dispatch.h"

#ifdef DPCUDA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../kernels/fused_linear/epilogue.h"
#include "cublaslt.h"
#include "cuda_types.h"
#include "kernel_image.h"
#endif

namespace dpcuda {

// Whether torch's bfloat16 GEMM over a row-major left operand writes NaN into a row whose
// operands are finite, next to a row holding a NaN: oneDNN's AMX kernels did on a 2-core Xeon
// with AMX (torch 2.11.0, 2026-12-03: a NaN in row r of a 17x2050 g made row r-1 of g times a
// 2050x4 weight NaN; not at 2048 columns, not over g column-major, not with AMX disabled by
// ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; with torch 2.13.0's CPU wheel on the same CPU, from 33
// rows times 64 columns and not at 17 times 4). Probed once, by the products of 17 and 33 rows
// of 2047 and 2050 columns by 4 and 64 columns (some 9 MFLOP). Where it does, g takes
// the layout torch's activation backward gives it (the upstream gradient's; row-major for relu,
// whose threshold_backward writes it so), so that every GEMM runs over the operands torch's
// layer gives it and the layer's NaN and Inf are torch's (the speed rule below was measured on
// a CPU without AMX).
bool bfloat16_gemm_spreads_nan() {
  static const bool spreads = [] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto options = at::TensorOptions().dtype(at::kBFloat16);
    for (const int64_t rows : {17, 33}) {
      for (const int64_t inner : {2047, 2050}) {
        for (const int64_t cols : {4, 64}) {
          at::Tensor g = at::zeros({rows, inner}, options);
          g.select(0, 1).select(0, 0).fill_(std::numeric_limits<float>::quiet_NaN());
          const at::Tensor out = at::mm(g, at::ones({inner, cols}, options));
          if (out.select(0, 0).isnan().any().item<bool>()) return true;
        }
      }
    }
    return false;
  }();
  return spreads;
}

namespace {

using at::Tensor;

Tensor empty_like_options(const Tensor& t) { return at::empty({0}, t.options()); }

// The flattened (rows, in) view of the input that the GEMMs read. A matrix is taken as it is,
// and a matrix result is returned as it is (in_shape), not through reshape or view: in a small
// layer's step each such call is a measurable share (issue #27: the op's fixed cost).
Tensor as_matrix(const Tensor& input, const LinearShape& s) {
  return input.dim() == 2 ? input : input.reshape({s.rows, s.in_features});
}

// A (rows, features) result in the shape `sizes` of the layer's input or output.
Tensor in_shape(const Tensor& t, at::IntArrayRef sizes) {
  return sizes.size() == 2 ? t : t.view(sizes);
}

// A thread's buffer for g, the CPU backward's one (rows, out) temporary, which the two GEMMs read
// and nothing returns: reused from call to call instead of made and freed in each (kept until
// the thread ends, the size of its largest g so far). Why: glibc's malloc hands the top of its
// heap back to the system when a free leaves more than its trim threshold there, and a step whose
// g, input gradient and output are freed one after another above everything it keeps did so in
// every step and faulted the pages in again in the next (issue #27, the 2-core AMD CPU, glibc's
// thresholds as a new process has them: the bfloat16 64x8192 sigmoid layer with a bias, steps
// one after another, faulted 590-630 pages a step against torch eager's 140-230 and took
// 2270-2750 us against 1310-1660; with this buffer 140-170 faults and 1660-1820 us against
// 1720-2210). dpcuda/_heap.py sets those thresholds where glibc's heuristic ends at import,
// which removes the trimming for every tensor; the buffer still saves g's allocation (there,
// 12 cells alone, each one's ratio over the code without the buffer 0.95-1.09, geomean 1.01).
// From kScratchMinBytes, glibc's first mmap threshold (a smaller block comes from its bins, and
// a view costs more than one in a small layer's step, the op's fixed cost: scratch, a 16x1
// float32 gelu layer 2.86 -> 2.66 of torch eager with the buffer), to kScratchBytes, its
// largest. The storage is viewed in the call's dtype (layers of several dtypes share it), g one
// as_strided view of it. A buffer whose storage anything else still holds is not reused (a
// guard: nothing the backward calls while g is alive re-enters it). The rows x cols elements
// from its start, row-major, or column-major (by_columns).
constexpr int64_t kScratchMinBytes = int64_t{128} << 10;
constexpr int64_t kScratchBytes = int64_t{32} << 20;

Tensor g_scratch(int64_t rows, int64_t cols, const at::TensorOptions& options, bool by_columns) {
  thread_local Tensor buffer;
  const int64_t item = static_cast<int64_t>(options.dtype().itemsize());
  const int64_t bytes = rows * cols * item;
  const std::array<int64_t, 2> strides = by_columns ? std::array<int64_t, 2>{1, rows}
                                                     : std::array<int64_t, 2>{cols, 1};
  if (bytes < kScratchMinBytes || bytes > kScratchBytes) {
    return at::empty_strided({rows, cols}, strides, options);
  }
  const bool reusable = buffer.defined() && buffer.storage().use_count() == 1 &&
                        static_cast<int64_t>(buffer.storage().nbytes()) >= bytes;
  if (!reusable) {
    buffer = at::empty({rows * cols}, options);
  } else if (buffer.dtype() != options.dtype()) {
    const c10::Storage storage = buffer.storage();
    buffer = at::empty({0}, options).set_(
        storage, 0, {static_cast<int64_t>(storage.nbytes()) / item}, {1});
  }
  return buffer.as_strided({rows, cols}, strides);
}

// A thread's buffer of at least `bytes` for the bias's sums, which the CPU backward copies into
// the bias's gradient once its GEMMs are done (kept until the thread ends, the size of its
// largest so far; nothing the backward calls between the sums and the copy re-enters it).
// (Bytes: storage for float or double sums; new[]'s alignment serves both.)
void* bias_sums_buffer(int64_t bytes) {
  thread_local std::vector<unsigned char> buffer;
  if (buffer.size() < static_cast<size_t>(bytes)) buffer.resize(static_cast<size_t>(bytes));
  return buffer.data();
}

// What both backends' full_backward share: the checks, the flattened gradient, and the
// tensors the activation pass writes (g aliases grad_output for "none", which needs no pass).
struct BackwardPlan {
  Activation act;
  LinearShape shape;
  Tensor grad_out;   // (rows, out): contiguous, or (strided_ok) with the strides it came with
  Tensor saved;      // (rows, out), contiguous; undefined for "none"
  Tensor g;          // grad_out * act'(saved) (undefined, to be made, where g_buffer is false)
  Tensor grad_bias;  // (out,) or empty; undefined, to be made, where bias_later is true, the
                     // bias's gradient wanted and no destination given
  bool fused_pass;   // whether the activation pass has to run
};

BackwardPlan plan_backward(const Tensor& grad_output, const Tensor& input, const Tensor& weight,
                           const Tensor& saved, c10::string_view activation,
                           std::array<bool, 3> output_mask, void (*check_dtype)(const Tensor&,
                                                                              const char*),
                           const Tensor& grad_bias_into = Tensor(), bool strided_ok = false,
                           bool g_buffer = true, bool bias_later = false) {
  BackwardPlan p;
  p.act = check_activation(activation);
  p.shape = check_linear(input, weight, c10::nullopt);
  check_dtype(input, "input");
  check_same_dtype(grad_output, "grad_output", input, "input");
  check_same_device(grad_output, "grad_output", input, "input");
  check_backward(grad_output, saved, p.shape, p.act);
  const int64_t rows = p.shape.rows, out_f = p.shape.out_features;
  p.fused_pass = p.act != Activation::kNone;
  // The CPU's activation pass reads the upstream gradient where it lies (an expanded one from
  // sum() or mean(), a transposed one): no copy of it first; without an activation the GEMMs
  // read it as torch's linear backward does (a transposed one as BLAS's transposed operand).
  // Elsewhere it is made contiguous.
  p.grad_out = grad_output.dim() == 2 ? grad_output : grad_output.reshape({rows, out_f});
  if (!strided_ok) p.grad_out = p.grad_out.contiguous();
  const bool saved_matrix = saved.dim() == 2 && saved.size(0) == rows && saved.size(1) == out_f;
  p.saved = !p.fused_pass  ? Tensor()
            : saved_matrix ? saved.contiguous()
                           : saved.reshape({rows, out_f}).contiguous();
  p.g = !p.fused_pass ? p.grad_out
        : g_buffer    ? at::empty({rows, out_f}, p.grad_out.options())
                      : Tensor();
  p.grad_bias = !output_mask[2]                          ? empty_like_options(p.grad_out)
                : grad_bias_into.defined() || bias_later ? grad_bias_into
                                                         : at::empty({out_f}, p.grad_out.options());
  return p;
}

// g as the two GEMMs read it: where it lies if BLAS can (row- or column-major), and else (an
// expanded or sliced gradient, for "none") as it lies too, each at::mm copying it as torch's
// backward's do (in its own layout: with Inf or subnormal values the bfloat16 GEMMs' results
// can follow the layout, torch's own included), but for the half types up to 32 wide: there one
// contiguous copy for both. Measured on the 2-core AMD CPU, each cell (width x batch, as the
// sweep names them) in its own process (bench_sweep.py --cells, --consecutive-ms 2, 21 rounds,
// the null 0.99-1.03, once 1.08; issue #27), eager/fused with the one copy against without it:
// bfloat16 16x8192 1.16-1.21 against 1.01, but 128x4096 0.84 against 0.99 (with a bias 0.96 /
// 1.07), 256x4096 0.97 / 1.00, 1024x1 0.96 / 1.01 (2026-12-02; 2026-11-30's consecutive calls
// had 128x4096's two GEMMs at 1461 us without the copy and 1107 with it, no longer so: 834 / 836
// alone); float32 from 65 wide, where it was copied, 1024x1 with a bias 0.90 against 1.04,
// 1024x32 0.97 / 1.01, 256x256, 1024x256, 256x4096 and 4096x32 level; up to 64 wide the copy
// lost (16x8192's GEMMs 88 us without it, 115 with it, 2026-11-30).
Tensor gemm_operand(const Tensor& g) {
  if (!is_half_type(g) || g.size(1) > 32) return g;
  const auto ready = [](int64_t s0, int64_t s1, int64_t n0, int64_t n1) {
    return s1 == 1 && (n0 == 1 || s0 >= std::max<int64_t>(1, n1));
  };
  const bool blas = ready(g.stride(0), g.stride(1), g.size(0), g.size(1)) ||
                    ready(g.stride(1), g.stride(0), g.size(1), g.size(0));
  return blas ? g : g.contiguous();
}

// The two GEMMs of the CPU backward over g (as gemm_operand reads it): the input's gradient and
// the weight's (into grad_weight_into where it is given), each an empty tensor where the mask
// leaves it out. In the order of torch's node for the layer: MmBackward0 (no bias) computes the
// weight's gradient first, AddmmBackward0 (a bias) the input's. Their times depend on what the
// one before left in the caches (issue #27: in a "none" layer, 128x128 at batch 8192, the same
// three GEMMs took 5268 us a step in the other order against torch's 5090).
std::pair<Tensor, Tensor> backward_gemms(const Tensor& g_in, const Tensor& input,
                                         const Tensor& weight, const LinearShape& shape,
                                         std::array<bool, 3> output_mask,
                                         const Tensor& grad_weight_into = Tensor()) {
  const Tensor g = output_mask[0] || output_mask[1] ? gemm_operand(g_in) : g_in;
  Tensor grad_input, grad_weight;
  const auto input_gradient = [&] {
    grad_input = output_mask[0] ? in_shape(at::mm(g, weight), input.sizes())
                                : empty_like_options(g);
  };
  if (output_mask[2]) input_gradient();
  if (output_mask[1] && grad_weight_into.defined()) {
    Tensor out = grad_weight_into;
    at::mm_out(out, g.t(), as_matrix(input, shape));
    grad_weight = grad_weight_into;
  } else {
    grad_weight = output_mask[1] ? at::mm(g.t(), as_matrix(input, shape))
                                 : empty_like_options(g);
  }
  if (!output_mask[2]) input_gradient();
  return {grad_input, grad_weight};
}

// Once the CPU's activation pass has made g, what it was made from is not read again: the
// plan's reference dropped, and the autograd node's where it handed them over
// (SavedReleasedAfterPass). `saved` is not to be read after this.
void drop_saved(BackwardPlan& p, const Tensor& saved) {
  p.saved = Tensor();
  SavedReleasedAfterPass::release(saved);
}

// Float sums rounded to bfloat16 (to nearest even, as Tensor.to rounds every value but NaN), by
// a plain loop: a bias's few hundred values, where `to` takes four dispatcher calls and a
// TensorIterator, a share of a small layer's step (issue #27). A NaN becomes c10's quiet NaN,
// 0x7fc0, where ATen's vectorised conversion gives 0xffff in its full vectors (both NaN).
Tensor rounded_to_bfloat16(const Tensor& sums) {
  Tensor out = at::empty(sums.sizes(), sums.options().dtype(at::kBFloat16));
  const float* src = sums.const_data_ptr<float>();
  at::BFloat16* dst = out.mutable_data_ptr<at::BFloat16>();
  for (int64_t i = 0, n = sums.numel(); i < n; ++i) dst[i] = at::BFloat16(src[i]);
  return out;
}

// The destinations of full_backward_into: contiguous tensors of the gradient's shape, dtype and
// device, or empty where the mask leaves that gradient out.
void check_into(const Tensor& into, const char* name, bool wanted, const Tensor& like,
                at::IntArrayRef shape) {
  if (!wanted) return;
  TORCH_CHECK_VALUE(into.sizes() == shape, name, " must have shape ", shape, ", got ",
                    into.sizes());
  TORCH_CHECK_VALUE(into.scalar_type() == like.scalar_type(), name, " must have dtype ",
                    like.scalar_type(), ", got ", into.scalar_type());
  TORCH_CHECK_VALUE(into.device() == like.device(), name, " must be on ", like.device(),
                    ", got ", into.device());
  TORCH_CHECK_VALUE(into.is_contiguous(), name, " must be contiguous");
}

// Where the float forward with an activation adds its bias: -1 by the layer's size (below), 0 in
// dpcuda's pass after at::mm, 1 in the GEMM (at::addmm, torch's own call for F.linear).
// Measured on the 2-core AVX-512 "AMD EPYC" machine, 2026-11-29 (benchmarks/
// bench_activation_pass.py --bias-routes, bias-routes-cpu-2026-11-29.json: the layer's forward
// by each route, alternating, 31 rounds, 2 threads; widths 16-1024, batches 32-8192; silu,
// gelu, relu, tanh), the pass route's time over addmm's:
// - from 64K output elements: 1.005-1.30 up to 256 wide but for relu (16x8192 tanh 118 / 91 us,
//   128x8192 silu 1724 / 1709 us: where the pre-activation is kept, the pass that adds the bias
//   writes it back, a stream more than one that reads it), relu 0.98-1.08 (its pass is in
//   place either way), 0.99-1.03 at 1024 wide from batch 1024 (the GEMM's time);
// - below: 0.87-1.12; the pass route ahead at 128x256 (0.87-0.97: 2-12 us, addmm's bias copy)
//   and for relu mostly (0.92-1.04), addmm ahead in 16-wide layers from batch 256 (1.03-1.12,
//   0.4-1.7 us: the pass's loop over rows of 16 with a bias).
// From 64K elements the forward's GEMM is torch's own call, the same MKL call as torch's
// (issue #27: where dpcuda's mm trailed torch's addmm by 40-60 us a step). Not yet measured on
// another CPU.
std::atomic<int> float_bias_route{-1};

bool float_bias_in_gemm(int64_t rows, int64_t out_features) {
  const int forced = float_bias_route.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  return rows * out_features >= 65536;
}

// The bfloat16 forward's route where tests and benchmarks set it (set_bfloat16_forward_route):
// -1 the measured choice below, 0 ATen's kernel, 1 dpcuda's pass (every activation but gelu).
std::atomic<int> bfloat16_forward_route{-1};

// Where dpcuda's bfloat16 passes run instead of ATen's bfloat16 kernels: where they are the
// faster. Both compute in float and round once; they differ in the float functions. Measured
// on the 2-core AVX-512 machine, 4096x1024 (us, quartiles, dpcuda's pass / ATen's kernel, with
// the bias sum in both for the backward; 2026-11-28, the passes over blocks of floats):
// - forward (the layer with its GEMM, about 5 ms): silu 5209-5368 / 5264-5510 and sigmoid
//   5343-5467 / 5424-5578, level there; the pass alone, 4096x256 on one core, 0.36-0.39 /
//   0.50 and 0.32-0.35 / 0.48 ns an element. relu, gelu_tanh and tanh were ahead before (tanh
//   2137 / 4250: ATen's bfloat16 tanh runs at half its float speed). ATen's is the faster for
//   gelu, 5463-5790 / 5085-5379. "none" has no pass: the GEMM's result is the output.
// - backward over a dense gradient: gelu 1429-1471 / 1683-1767, silu 1353-1443 / 1417-1525,
//   sigmoid 623-643 / 658-682, tanh 624-692 / 662-682. Over an expanded one ATen's kernel,
//   with the sums after it, is the faster for sigmoid (692-715 / 527-560), tanh (708-726 /
//   538-571) and silu (1481-1561 / 1393-1477): its loop takes the one value as a scalar, where
//   dpcuda's reads a row buffer; not for gelu (1469-1503 / 2013-2196). relu's too over an
//   expanded gradient, at every size (the AMD CPU, 2026-12-02, 2 threads, medians of 50 calls
//   in us, ATen's threshold_backward then the sums over its g against dpcuda's pass; without a
//   bias ATen's alone against the pass): 256x8192 262 / 551, without the sums 251-378 /
//   358-414; 64x8192 87 / 140, 72 / 99; 1024x4096 698 / 875, 500 / 659; 128x256 25 / 23 (the
//   op's fixed cost, the one shape behind); issue #27's profiles of the 256x8192 layer without
//   a bias: 850 us a step of torch's own work against dpcuda's 1250. Without the bias sum
//   (a layer without a bias) silu's is ATen's over a dense gradient too: its silu_backward is
//   the faster per element, and the sum that dpcuda's pass takes in its stride is not there
//   (8192x256, the pass and the input's GEMM, malloc's trimming off: 1256-1294 / 1197-1248). Over
//   a transposed gradient dpcuda's reads in blocks, ATen's element by element: 2351-4199
//   against 10465-73227 for every activation.
// sigmoid's and tanh's stay dpcuda's over a dense gradient without the sum, though ATen's kernels
// timed alone were the faster there (the AMD CPU, 2026-12-02: sigmoid 1024x4096 500-576 /
// 614-641 us, 256x4096 110-112 / 129-130): as layers, in their own processes, each library in
// turn (21 rounds of 2 s, the null 0.93-1.08), eager/fused with dpcuda's pass, then ATen's:
// sigmoid 64x8192 1.03 / 1.02, 128x8192 1.03 / 0.99, 16x8192 1.06 / 1.06, tanh 64x8192 1.33 /
// 1.29.
// Measured again on a CPU without AVX512-BF16 or AMX (a 2-core "Intel Xeon Processor @ 2.50GHz"
// with AVX-512 and VNNI, 2026-11-28): the layer's forward by each route, alternating, 21 rounds,
// 2 threads (benchmarks/bench_activation_pass.py --routes, activation-routes-bf16-cpu-
// 2026-11-28.json: widths 16, 64, 256, batches 4096 and 16384, with and without bias), ATen's
// time over dpcuda's pass's: tanh 1.04-1.61, gelu_tanh 1.09-1.48, relu 1.01-1.11 (dpcuda's
// ahead), sigmoid 0.99-1.01 (level), silu 0.95-1.04 (ATen's 2-5% ahead in three cells at batch
// 4096, level at 16384; on the AMX machine dpcuda's pass was the faster, above). The choices
// stay the same on both CPUs: silu's edge there is under 1% of the layer.
// gelu's is ATen's whatever is set: ATen's gelu gives NaN for +Inf in its vectorised loop (Inf
// in its scalar tail; float32 too), which dpcuda's bfloat16 pass, not used, does not follow.
bool bfloat16_forward_pass_wins(Activation act) {
  if (act == Activation::kNone || act == Activation::kGelu) return false;  // ("none": no pass)
  const int forced = bfloat16_forward_route.load(std::memory_order_relaxed);
  return forced != 0;
}

bool bfloat16_backward_pass_wins(Activation act, const Tensor& grad_out, bool bias_sum) {
  const bool aten_reads_expanded_faster = act == Activation::kSigmoid ||
                                          act == Activation::kTanh || act == Activation::kSilu ||
                                          act == Activation::kRelu;
  if (aten_reads_expanded_faster && grad_out.stride(1) == 0) return false;
  return !(act == Activation::kSilu && !bias_sum && grad_out.stride(1) == 1);
}

std::tuple<Tensor, Tensor> full_forward_cpu(const Tensor& input, const Tensor& weight,
                                            const c10::optional<Tensor>& bias,
                                            c10::string_view activation) {
  const Activation act = check_activation(activation);
  const LinearShape s = check_linear(input, weight, bias);
  check_cpu_layer_dtype(input, "input");
  if (is_half_type(input)) {
    // The half types keep their data in the half type and round where torch rounds: the GEMM is
    // torch's, in the half type (float accumulation, one rounding, the bias in it; where it
    // overflows to +-Inf, as torch's does): on CPUs with AMX or AVX512-BF16 it runs several
    // times a float GEMM's speed (computed in float, bfloat16 layers ran at a quarter of
    // torch's speed: docs/results.md, the sweep). The activation is computed in float and
    // rounded once: for bfloat16 by dpcuda's pass where it is the faster (in place where the
    // pre-activation is not kept), else, and for float16, by torch's.
    const bool has_b = bias.has_value() && bias->defined();
    const Tensor x = as_matrix(input, s);
    const Tensor z = has_b ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
    const bool keep_pre = saved_for_backward(act) == Saved::kPreActivation;
    if (input.scalar_type() != at::kBFloat16 || !bfloat16_forward_pass_wins(act)) {
      return {in_shape(aten_activation(z, act), s.out_sizes),
              keep_pre ? in_shape(z, s.out_sizes) : empty_like_options(z)};
    }
    Tensor out = keep_pre ? at::empty_like(z) : z;
    const auto* z_bits = reinterpret_cast<const uint16_t*>(z.const_data_ptr<at::BFloat16>());
    auto* out_bits = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
    const int64_t grain = act == Activation::kRelu ? 32768 : 8192;  // (as the float pass's)
    at::parallel_for(0, z.numel(), grain, [&](int64_t begin, int64_t end) {
      cpu::bfloat16_activation_forward(z_bits, out_bits, begin, end, act);
    });
    return {in_shape(out, s.out_sizes),
            keep_pre ? in_shape(z, s.out_sizes) : empty_like_options(z)};
  }
  // The bias goes into the GEMM, as nn.Linear's (at::addmm), or, in a small layer (above), the
  // GEMM writes x @ W^T alone and our pass adds the bias as it applies the activation.
  // The GEMM writes into the output, which the pass rewrites in place; or, where the
  // pre-activation is kept, into the pre-activation, which the pass reads (adding the bias to
  // it on the pass route), so that no pass copies it.
  const bool has_bias = bias.has_value() && bias->defined();
  const Tensor x = as_matrix(input, s);
  const bool pass = act != Activation::kNone;
  const bool keep_pre = saved_for_backward(act) == Saved::kPreActivation;
  const bool bias_in_gemm = has_bias && (!pass || float_bias_in_gemm(s.rows, s.out_features));
  Tensor gemm = bias_in_gemm ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  Tensor out = keep_pre ? at::empty_like(gemm) : gemm;
  Tensor pre = keep_pre ? gemm : empty_like_options(gemm);
  if (pass) {
    const Tensor b = has_bias && !bias_in_gemm ? bias->contiguous() : Tensor();
    // Elements per task: ATen's 32K for relu, a memory-bound pass; 8K for the activations
    // computed from exp or tanh (about 0.5 ns an element on one core). Measured on the 2-core
    // machine: run on one thread after MKL's two-thread GEMM, such a pass ran at about half its
    // speed in a one-thread process; at 64x256 and 128x256 (16K and 32K elements) the tanh pass
    // took 18 and 30 us on one thread, 6 and 9 us split in two (issue #27).
    const int64_t per_task = act == Activation::kRelu ? 32768 : 8192;
    const int64_t grain = std::max<int64_t>(1, per_task / std::max<int64_t>(1, s.out_features));
    AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "full_forward_cpu", [&] {
      scalar_t* out_ptr = out.data_ptr<scalar_t>();
      scalar_t* pre_ptr = keep_pre ? pre.data_ptr<scalar_t>() : nullptr;
      const scalar_t* bias_ptr = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
      at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
        if (keep_pre) {
          cpu::pre_activation_forward<scalar_t>(out_ptr, pre_ptr, bias_ptr, begin, end,
                                                s.out_features, act);
        } else {
          cpu::bias_activation_forward<scalar_t>(out_ptr, nullptr, bias_ptr, begin, end,
                                                 s.out_features, act);
        }
      });
    });
  }
  return {in_shape(out, s.out_sizes), keep_pre ? in_shape(pre, s.out_sizes) : pre};
}

// The CPU backward's row pass and the bias gradient's fixed-order sum: rows in chunks of
// bias_chunk_rows (a function of the shape alone: the same bits for any thread count), each
// chunk's column sums from pass(r0, r1, partial) (partial null: no sums wanted), then the
// partials added pairwise (cpu::reduce_column_partials) into grad_bias (null: none). T is the
// sums' type.
template <typename T, typename Pass>
void chunked_rows(int64_t rows, int64_t cols, T* grad_bias, const at::TensorOptions& options,
                  Pass&& pass) {
  const int64_t chunk_rows = cpu::bias_chunk_rows(rows);
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  // One chunk sums straight into the bias gradient: the same bits as its partial sum added to
  // 0 (a sum that starts at +0 is never -0), without the buffer and the second pass.
  const bool direct = chunks == 1;
  Tensor partials = grad_bias && !direct ? at::empty({chunks, cols}, options) : Tensor();
  T* part = !grad_bias ? nullptr : direct ? grad_bias : partials.data_ptr<T>();
  // At least 32K elements a task, ATen's grain for elementwise passes: a parallel region costs
  // microseconds, more than a small layer's whole pass.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, chunk_rows * cols));
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r0 = k * chunk_rows;
      pass(r0, std::min(rows, r0 + chunk_rows), part ? part + k * cols : nullptr);
    }
  });
  if (grad_bias && !direct) {
    // At least 64K additions per task: a parallel region costs more than a smaller one.
    const int64_t reduce_grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, chunks));
    at::parallel_for(0, cols, reduce_grain, [&](int64_t begin, int64_t end) {
      cpu::reduce_column_partials<T>(part, chunks, cols, grad_bias, begin, end);
    });
  }
}

// The bias sums alone ("none") over a column-major gradient (row stride 1, column stride
// neither 0 nor 1): whole columns (cpu::column_major_bias_sums: the same bits for any thread
// count), the columns split between threads. sums(col_begin, col_end).
inline bool column_major(int64_t row_stride, int64_t col_stride) {
  return row_stride == 1 && col_stride != 0 && col_stride != 1;
}

// Whether dpcuda's bfloat16 pass writes g column-major, as torch's activation backward does over
// a column-major (transposed) upstream gradient, rather than row-major: where the input's
// gradient GEMM, g (rows x out) times the weight, is the faster for it, by more than the pass's
// writing g out by columns costs. On the 2-core AVX-512 machine (2026-11-29): under the
// profiler, the fused step's GEMMs took 1.013-1.036x as long over g row-major as over g
// column-major from 2048 wide up to 64 rows (the input's GEMM at 32 rows of 4096: 4732 ->
// 4334 us), 0.99-1.01x at 128 and 256 rows, 0.79-0.98x below 2048 wide (tanh; float32's GEMMs
// 0.95-1.05x either way: float32 keeps g row-major). The layer's backward, pass included
// (bench_activation_pass.py --g-layouts, g-layouts-cpu-2026-11-29.json, tanh and gelu, with and
// without the bias's sums; row-major's time over column-major's): 4096 wide 1.014-1.024 at 16
// and 32 rows, 0.991-0.999 at 64, 0.981-0.993 at 128 and 256; 2048 wide 1.03-1.075 at 16 rows,
// 0.963-1.039 at 32 (gelu without the sums the one below 1), 0.998-1.038 at 64 (quartiles
// 0.95-1.14), 0.975-1.045 from 128; 1024 wide 0.92-1.00. So: from 2048 wide, up to 32 rows
// (4096 wide at 64 rows is the one loss past it). (One row: the two layouts are the same
// memory, kept row-major.) Tests and benchmarks force either layout over any column-major
// gradient (set_bfloat16_g_layout) and read the rule (bfloat16_g_by_columns_for_tests).
std::atomic<int> bfloat16_g_layout{-1};

bool bfloat16_g_by_columns(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                           bool relu) {
  if (!column_major(row_stride, col_stride) || rows <= 1) return false;
  const int forced = bfloat16_g_layout.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  if (bfloat16_gemm_spreads_nan()) return !relu;
  return rows <= 32 && cols >= 2048;
}

template <typename Sums>
void column_major_sums(int64_t rows, int64_t cols, Sums&& sums) {
  // (at least 32K elements a task, as chunked_rows)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows));
  at::parallel_for(0, cols, grain, [&](int64_t begin, int64_t end) { sums(begin, end); });
}

std::tuple<Tensor, Tensor, Tensor> full_backward_cpu_into(
    const Tensor& grad_output, const Tensor& input, const Tensor& weight, const Tensor& saved,
    c10::string_view activation, std::array<bool, 3> output_mask,
    const Tensor& grad_weight_into, const Tensor& grad_bias_into) {
  if (is_half_type(input) && (grad_weight_into.defined() || grad_bias_into.defined())) {
    // The half types round each result once: the results are copied into the destinations.
    auto [gi, gw, gb] = full_backward_cpu_into(grad_output, input, weight, saved, activation,
                                               output_mask, Tensor(), Tensor());
    if (grad_weight_into.defined() && output_mask[1]) grad_weight_into.copy_(gw);
    if (grad_bias_into.defined() && output_mask[2]) grad_bias_into.copy_(gb);
    return {gi, grad_weight_into.defined() ? grad_weight_into : gw,
            grad_bias_into.defined() ? grad_bias_into : gb};
  }
  // (g is made below: a thread's buffer (g_scratch), or ATen's activation backward's for the
  // half types where torch's kernel is the one; the bias's gradient after the GEMMs, where no
  // destination is given)
  BackwardPlan p = plan_backward(grad_output, input, weight, saved, activation,
                                output_mask, &check_cpu_layer_dtype, grad_bias_into,
                                true, false, true);
  // Without an activation ("none") the two GEMMs come first and the bias's sums after them, into
  // a tensor allocated then: torch's order (AddmmBackward0's GEMMs, then the engine's sum_to),
  // so that the step's allocations follow torch's. The bias's gradient allocated first (where a
  // pass sums into it) placed the next step's tensors elsewhere in the heap: on the 2-core AMD
  // CPU (2026-12-02) torch's own addmm of a 1024-wide float32 layer at batch 1 took 1.035-1.06x
  // as long after this backward as after torch's (interleaved rounds, 101 of them), and 1.00x
  // with the bias summed last (issue #27). With an activation the pass comes first (the GEMMs
  // read its g) and, in float32 and float64, sums into a thread's buffer, copied into the bias's
  // gradient allocated after the GEMMs (bias_sums_buffer below): torch's order again; A/B in
  // their own processes, 21 rounds (2026-12-02): a 1024-wide relu layer at batch 1 1.03-1.04 ->
  // 1.09-1.10, the other three cells tried level or 0.01-0.03 up.
  const bool gemms_first = !p.fused_pass;
  if (is_half_type(input)) {
    // As torch: g = grad_output * act'(saved) computed in float and rounded to the half type
    // (where it may overflow as torch's does), then the GEMMs in the half type (torch's own:
    // float accumulation, one rounding) and the bias sum in float over the rounded g, rounded
    // once. For bfloat16 g and the bias sum are dpcuda's one pass, which reads the upstream
    // gradient where it lies (a transposed one through the blocks: ATen's tanh_backward took
    // 5.8 ms over a transposed 8192x256 one); for float16 g is torch's.
    const auto dtype = input.scalar_type();
    const int64_t rows = p.shape.rows, out_f = p.shape.out_features;
    const bool bf16 = dtype == at::kBFloat16;
    const bool own_pass = bf16 && p.fused_pass && bfloat16_backward_pass_wins(p.act, p.grad_out,
                                                                           output_mask[2]);
    const bool g_columns =
        own_pass && bfloat16_g_by_columns(p.grad_out.stride(0), p.grad_out.stride(1), rows, out_f,
                                          p.act == Activation::kRelu);
    Tensor g = !p.fused_pass ? p.grad_out
               : own_pass    ? g_scratch(rows, out_f, p.grad_out.options(), g_columns)
                             : aten_activation_backward(p.grad_out, p.saved, p.act);
    Tensor sum;
    // The float sums allocated (both half types), then for bfloat16 dpcuda's pass: g and its
    // sums, or the sums alone over g (ATen's, or the upstream gradient for "none"), read where
    // it lies. (float16's sums come after the GEMMs, below.)
    const auto sums_and_pass = [&] {
      if (output_mask[2]) sum = at::empty({out_f}, p.grad_out.options().dtype(at::kFloat));
      if (!bf16 || !(own_pass || output_mask[2])) return;
      const auto bits = [](const Tensor& t) {
        return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
      };
      const Tensor& read = own_pass ? p.grad_out : g;
      const uint16_t* go_bits = bits(read);
      const uint16_t* saved_bits = own_pass ? bits(p.saved) : nullptr;
      auto* g_bits =
          own_pass ? reinterpret_cast<uint16_t*>(g.mutable_data_ptr<at::BFloat16>()) : nullptr;
      const int64_t rs = read.stride(0), cs = read.stride(1);
      const Activation pass_act = own_pass ? p.act : Activation::kNone;
      if (!own_pass && column_major(rs, cs)) {
        float* out = sum.data_ptr<float>();
        column_major_sums(rows, out_f, [&](int64_t begin, int64_t end) {
          cpu::bfloat16_column_major_bias_sums(go_bits, out, rows, begin, end, cs);
        });
      } else {
        chunked_rows<float>(rows, out_f, output_mask[2] ? sum.data_ptr<float>() : nullptr,
                            p.grad_out.options().dtype(at::kFloat),
                            [&](int64_t r0, int64_t r1, float* partial) {
                              if (g_columns) {
                                cpu::bfloat16_activation_backward_to_columns(
                                    go_bits, saved_bits, g_bits, partial, r0, r1, out_f,
                                    pass_act, rs, cs, g.stride(1));
                              } else {
                                cpu::bfloat16_activation_backward_rows(
                                    go_bits, saved_bits, g_bits, partial, r0, r1, out_f,
                                    pass_act, rs, cs);
                              }
                            });
      }
    };
    Tensor gi, gw;
    if (gemms_first) std::tie(gi, gw) = backward_gemms(g, input, weight, p.shape, output_mask);
    sums_and_pass();
    drop_saved(p, saved);
    if (!gemms_first) std::tie(gi, gw) = backward_gemms(g, input, weight, p.shape, output_mask);
    // (each gradient left out an empty tensor of its own: an op's outputs must not alias)
    const auto none = [&] { return empty_like_options(g); };
    Tensor gb;
    if (output_mask[2]) {
      if (!bf16) {
        // The float path's fixed-order sum over g widened to float (exactly), rounded once.
        const Tensor gf = g.to(at::kFloat).contiguous();
        const float* g_ptr = gf.data_ptr<float>();
        chunked_rows<float>(rows, out_f, sum.data_ptr<float>(), sum.options(),
                            [&](int64_t r0, int64_t r1, float* partial) {
                              cpu::activation_backward_rows<float>(
                                  g_ptr, nullptr, nullptr, partial, r0, r1, out_f,
                                  Activation::kNone);
                            });
      }
      gb = bf16 ? rounded_to_bfloat16(sum) : sum.to(dtype);
    }
    return {gi, gw, output_mask[2] ? gb : none()};
  }
  const int64_t rows = p.shape.rows, out_f = p.shape.out_features;
  if (p.fused_pass) p.g = g_scratch(rows, out_f, p.grad_out.options(), false);
  Tensor grad_input, grad_weight;
  const auto gemms = [&] {
    std::tie(grad_input, grad_weight) =
        backward_gemms(p.g, input, weight, p.shape, output_mask, grad_weight_into);
  };
  if (gemms_first) gemms();
  // With an activation the pass sums into a thread's buffer and the bias's gradient is allocated
  // after the GEMMs, the sums copied into it: torch's order of allocations here too.
  // (Without one, "none", the sums go straight into the gradient, allocated after the GEMMs.)
  const bool bias_new = output_mask[2] && !p.grad_bias.defined();
  const bool sums_later = bias_new && p.fused_pass;
  const int64_t sums_bytes = out_f * p.grad_out.element_size();
  void* sums = sums_later ? bias_sums_buffer(sums_bytes) : nullptr;
  if (bias_new && !sums_later) p.grad_bias = at::empty({out_f}, p.grad_out.options());
  if (p.fused_pass || output_mask[2]) {
    AT_DISPATCH_FLOATING_TYPES(p.grad_out.scalar_type(), "full_backward_cpu", [&] {
      scalar_t* bias_out = !output_mask[2] ? nullptr
                           : sums_later    ? static_cast<scalar_t*>(sums)
                                           : p.grad_bias.data_ptr<scalar_t>();
      const scalar_t* go_ptr = p.grad_out.data_ptr<scalar_t>();
      const int64_t go_rs = p.grad_out.stride(0), go_cs = p.grad_out.stride(1);
      const scalar_t* saved_ptr = p.fused_pass ? p.saved.data_ptr<scalar_t>() : nullptr;
      scalar_t* g_ptr = p.fused_pass ? p.g.data_ptr<scalar_t>() : nullptr;
      if (!p.fused_pass && column_major(go_rs, go_cs)) {
        column_major_sums(rows, out_f, [&](int64_t begin, int64_t end) {
          cpu::column_major_bias_sums<scalar_t>(go_ptr, bias_out, rows, begin, end, go_cs);
        });
        return;
      }
      chunked_rows<scalar_t>(rows, out_f, bias_out, p.grad_out.options(),
                             [&](int64_t r0, int64_t r1, scalar_t* partial) {
                               cpu::activation_backward_rows<scalar_t>(
                                   go_ptr, saved_ptr, g_ptr, partial, r0, r1, out_f, p.act,
                                   go_rs, go_cs);
                             });
    });
  }
  drop_saved(p, saved);
  if (!gemms_first) gemms();
  if (sums_later) {
    p.grad_bias = at::empty({out_f}, p.grad_out.options());
    if (out_f > 0) std::memcpy(p.grad_bias.data_ptr(), sums, sums_bytes);
  }
  return {grad_input, grad_weight, p.grad_bias};
}

using BackwardInto = std::tuple<Tensor, Tensor, Tensor> (*)(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::string_view,
    std::array<bool, 3>, const Tensor&, const Tensor&);

// full_backward of a backend: its implementation with new tensors for the gradients.
template <BackwardInto Impl>
std::tuple<Tensor, Tensor, Tensor> full_backward(const Tensor& grad_output, const Tensor& input,
                                                 const Tensor& weight, const Tensor& saved,
                                                 c10::string_view activation,
                                                 std::array<bool, 3> output_mask) {
  return Impl(grad_output, input, weight, saved, activation, output_mask, Tensor(), Tensor());
}

// full_backward_into of a backend: the destinations checked (or left out where the mask leaves
// their gradient out), then its implementation writing into them.
template <BackwardInto Impl>
Tensor full_backward_into(const Tensor& grad_output, const Tensor& input, const Tensor& weight,
                          const Tensor& saved, c10::string_view activation,
                          std::array<bool, 3> output_mask, Tensor& grad_weight,
                          Tensor& grad_bias) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must have shape (out_features, in_features)");
  check_into(grad_weight, "grad_weight", output_mask[1], weight, weight.sizes());
  check_into(grad_bias, "grad_bias", output_mask[2], weight, {weight.size(0)});
  // The backward reads its inputs after it has written into the destinations (the weight's
  // gradient before the input's in a layer without bias; the bias sums in the activation
  // pass, or after the weight's gradient in a layer without activation): none may share them.
  // (saved: unread for "none", which may be given anything)
  const bool reads_saved = check_activation(activation) != Activation::kNone;
  const std::pair<const Tensor*, const char*> reads[] = {
      {&grad_output, "grad_output"}, {&input, "input"}, {&weight, "weight"},
      {reads_saved ? &saved : nullptr, "saved"}};
  const std::pair<const Tensor*, const char*> writes[] = {
      {output_mask[1] ? &grad_weight : nullptr, "grad_weight"},
      {output_mask[2] ? &grad_bias : nullptr, "grad_bias"}};
  for (const auto& [into, into_name] : writes) {
    if (!into) continue;
    for (const auto& [read, read_name] : reads) {
      TORCH_CHECK_VALUE(!read || !read->defined() || !overlap(*into, *read), into_name,
                        " shares memory with ", read_name, ", which the backward reads");
    }
  }
  TORCH_CHECK_VALUE(!(output_mask[1] && output_mask[2] && overlap(grad_weight, grad_bias)),
                    "grad_weight and grad_bias share memory");
  return std::get<0>(Impl(grad_output, input, weight, saved, activation, output_mask,
                          output_mask[1] ? grad_weight : Tensor(),
                          output_mask[2] ? grad_bias : Tensor()));
}

#ifdef DPCUDA_WITH_CUDA

std::tuple<Tensor, Tensor> full_forward_cuda(const Tensor& input, const Tensor& weight,
                                             const c10::optional<Tensor>& bias,
                                             c10::string_view activation) {
  const Activation act = check_activation(activation);
  const LinearShape s = check_linear(input, weight, bias);
  check_cuda_dtype(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  bind_cuda_context(input.device().index());
  check_kernel_image(input.device().index());
  const Tensor x = as_matrix(input, s);
  const bool has_bias = bias.has_value() && bias->defined();
  const bool keep_pre = saved_for_backward(act) == Saved::kPreActivation;
  // cuBLASLt's BIAS epilogue adds the bias inside the GEMM; our kernel then applies the
  // activation, writing next to z when z is kept for the backward and over it otherwise.
  // Not cuBLASLt's RELU_BIAS epilogue (at::_addmm_activation), which would save relu's launch:
  // its relu is a max(z, 0), which maps NaN to 0 where torch.relu keeps NaN, and with
  // in_features == 0 ATen returns the bias without the relu.
  // For a small GEMM, cuBLASLt with an algorithm of one kernel (cublaslt.cpp), where cuBLAS
  // may split K and launch two or more.
  Tensor z = at::empty({s.rows, s.out_features}, x.options());
  if (!linear_lt(x, weight, has_bias ? *bias : Tensor(), z)) {
    z = has_bias ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
  }
  if (act == Activation::kNone) return {in_shape(z, s.out_sizes), empty_like_options(z)};
  const Tensor out = keep_pre ? at::empty_like(z) : z;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "full_forward_cuda",
                                  [&] {
    using cuda_t = typename CudaType<scalar_t>::type;
    check_cuda(cuda::activation_forward<cuda_t>(
                   reinterpret_cast<const cuda_t*>(z.data_ptr<scalar_t>()),
                   reinterpret_cast<cuda_t*>(out.data_ptr<scalar_t>()), z.numel(), act,
                   at::cuda::getCurrentCUDAStream()),
               "activation_forward launch");
  });
  return {in_shape(out, s.out_sizes),
          keep_pre ? in_shape(z, s.out_sizes) : empty_like_options(z)};
}

// grad_input = g @ weight in the input's shape: a small GEMM by cuBLASLt with one kernel
// (cublaslt.cpp), where cuBLAS may split K; else ATen's.
Tensor input_grad_cuda(const Tensor& g, const Tensor& weight, const Tensor& input) {
  Tensor out = at::empty({g.size(0), weight.size(1)}, g.options());
  if (input_grad_lt(g, weight, out)) return in_shape(out, input.sizes());
  return in_shape(at::mm(g, weight), input.sizes());
}

// dpcuda's backward pass over (rows, out) grad_out: g = grad_out * act'(saved) (where g is
// given) and grad_bias = g's column sums (where grad_bias is given).
void activation_pass_cuda(const Tensor& grad_out, const Tensor& saved, const Tensor& g,
                          const Tensor& grad_bias, Activation act) {
  const int64_t rows = grad_out.size(0), cols = grad_out.size(1);
  const auto acc_dtype = grad_out.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor workspace = at::empty(
      {grad_bias.defined() ? cuda::activation_backward_workspace(rows, cols) : 0},
      grad_out.options().dtype(acc_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(),
                                  "full_backward_cuda", [&] {
    using cuda_t = typename CudaType<scalar_t>::type;
    auto ptr = [](const Tensor& t) {
      return t.defined() ? reinterpret_cast<cuda_t*>(t.data_ptr<scalar_t>()) : nullptr;
    };
    check_cuda(cuda::activation_backward<cuda_t>(ptr(grad_out), ptr(saved), ptr(g),
                                                 ptr(grad_bias), workspace.data_ptr(), rows,
                                                 cols, act, at::cuda::getCurrentCUDAStream()),
               "activation_backward launch");
  });
}

std::tuple<Tensor, Tensor, Tensor> full_backward_cuda_into(
    const Tensor& grad_output, const Tensor& input, const Tensor& weight, const Tensor& saved,
    c10::string_view activation, std::array<bool, 3> output_mask,
    const Tensor& grad_weight_into, const Tensor& grad_bias_into) {
  const BackwardPlan p = plan_backward(grad_output, input, weight, saved, activation,
                                      output_mask, &check_cuda_dtype, grad_bias_into);
  const c10::cuda::CUDAGuard guard(input.device());
  bind_cuda_context(input.device().index());
  check_kernel_image(input.device().index());
  // The weight gradient: one cuBLASLt GEMM where it can (cublaslt.cpp), with the bias gradient
  // in the same call where that is wanted and cuBLASLt can; else our pass sums the bias as it
  // applies the activation's derivative.
  const Tensor x = output_mask[1] ? as_matrix(input, p.shape) : Tensor();
  Tensor grad_weight =
      !output_mask[1]               ? empty_like_options(p.grad_out)
      : grad_weight_into.defined() ? grad_weight_into
                                   : at::empty({p.shape.out_features, p.shape.in_features},
                                               p.grad_out.options());
  const bool lt_bias = output_mask[1] && output_mask[2] &&
                       weight_grad_lt_available(p.g, x, grad_weight, p.grad_bias);
  const bool bias_pass = output_mask[2] && !lt_bias;
  if (p.fused_pass || bias_pass) {
    activation_pass_cuda(p.grad_out, p.fused_pass ? p.saved : Tensor(),
                         p.fused_pass ? p.g : Tensor(), bias_pass ? p.grad_bias : Tensor(),
                         p.act);
  }
  if (output_mask[1]) {
    bool done = lt_bias && weight_grad_lt(p.g, x, grad_weight, p.grad_bias);
    if (lt_bias && !done) {
      // cuBLASLt refused the call its heuristic offered: our pass sums the bias over g.
      activation_pass_cuda(p.g, Tensor(), Tensor(), p.grad_bias, Activation::kNone);
    }
    if (!done) done = weight_grad_lt(p.g, x, grad_weight, Tensor());
    if (!done) at::mm_out(grad_weight, p.g.t(), x);
  }
  Tensor grad_input = output_mask[0] ? input_grad_cuda(p.g, weight, input)
                                     : empty_like_options(p.grad_out);
  return {grad_input, grad_weight, p.grad_bias};
}

#endif  // DPCUDA_WITH_CUDA

}  // namespace

int set_bfloat16_forward_route(int route) {
  TORCH_CHECK_VALUE(route >= -1 && route <= 1,
                    "route must be -1 (the measured choice), 0 (ATen's) or 1 (dpcuda's), got ",
                    route);
  return bfloat16_forward_route.exchange(route);
}

bool bfloat16_g_by_columns_for_tests(int64_t row_stride, int64_t col_stride, int64_t rows,
                                     int64_t cols, bool relu) {
  return bfloat16_g_by_columns(row_stride, col_stride, rows, cols, relu);
}

int set_bfloat16_g_layout(int layout) {
  TORCH_CHECK_VALUE(layout >= -1 && layout <= 1,
                    "layout must be -1 (by the layer's size), 0 (row-major) or 1 (column-major), "
                    "got ", layout);
  return bfloat16_g_layout.exchange(layout);
}

int set_float_bias_route(int route) {
  TORCH_CHECK_VALUE(route >= -1 && route <= 1,
                    "route must be -1 (by the layer's size), 0 (dpcuda's pass) or 1 (addmm), "
                    "got ", route);
  return float_bias_route.exchange(route);
}

TORCH_LIBRARY_IMPL(dpcuda, CPU, m) {
  m.impl("full_forward", &full_forward_cpu);
  m.impl("full_backward", &full_backward<&full_backward_cpu_into>);
  m.impl("full_backward_into", &full_backward_into<&full_backward_cpu_into>);
}

#ifdef DPCUDA_WITH_CUDA
TORCH_LIBRARY_IMPL(dpcuda, CUDA, m) {
  m.impl("full_forward", &full_forward_cuda);
  m.impl("full_backward", &full_backward<&full_backward_cuda_into>);
  m.impl("full_backward_into", &full_backward_into<&full_backward_cuda_into>);
}
#endif

}  // namespace dpcuda
