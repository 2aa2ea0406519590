#include "fused_linear.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DPCUDA_AVX512_TRANSPOSE 1
#endif

#include "target.h"

namespace dpcuda {
namespace cpu {
namespace {

// bfloat16 as its bit patterns (uint16_t), the upper half of a float: widened exactly, and
// rounded from float to nearest even, as torch rounds (a value past the largest finite one
// becomes +-Inf); a NaN stays a quiet NaN of its sign. Branch-free, so the loops vectorise.
inline float widen(uint16_t b) { return poly::from_bits(static_cast<uint32_t>(b) << 16); }

inline uint16_t round_to_bfloat16(float f) {
  const uint32_t u = poly::to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                         : static_cast<uint16_t>(rounded);
}

// What a stored type computes in, and its conversions: float and double are their own;
// uint16_t holds bfloat16 and computes in float, each stored result rounded once.
template <typename S>
struct Compute {
  using type = S;
  static S load(S v) { return v; }
  static S store(S v) { return v; }
};

template <>
struct Compute<uint16_t> {
  using type = float;
  static float load(uint16_t b) { return widen(b); }
  static uint16_t store(float f) { return round_to_bfloat16(f); }
};

template <typename S>
using acc_of = typename Compute<S>::type;

// The bias-only pass ("none"): the column sums of a matrix whose columns are contiguous (a
// transposed one: row stride 1, column c at g + c * cs), where no pass writes g and the sums
// are the only reading of it:
// each column's rows [row_begin, row_end) go to kColumnLanes running sums (row r to sum
// (r - row_begin) % kColumnLanes, in row order within it), so that the loads are contiguous and
// the adds four independent vectors of lanes; the sums are then added in a fixed tree (lane j +=
// lane j + 32, + 16, + 8, + 4, + 2, + 1), and the result onto partial[c]. A fixed order, the
// same for any vector width (the lanes are the source's, not the compiler's), thread count or
// CPU; not the row-major loop's order, so the sums equal the contiguous gradient's within
// rounding, as torch's GEMMs over a transposed operand do. Added in row order, the pass cost
// 594 us against sum(0)'s 202 (256x256, batch 8192, float32). The adapter takes whole columns
// (column_major_totals), split between threads by column: chunks of rows, each with its tree,
// read a few cache lines of every column a chunk (a stream per column: more than the
// prefetcher follows) and spent more on the trees than on the adds (16 lanes, 4096x1024
// float32, 2 threads, through full_backward: 2.5 ms against torch's sum(0) 0.63 in one run;
// whole columns in 64 lanes: 0.76 against 0.99 in another).
// The lanes are GCC vectors of 16 (lowered to each clone's widths: the same adds in any),
// loaded from 16 consecutive elements, bfloat16 widened.
constexpr int64_t kColumnLanes = 64;
typedef float float_lanes __attribute__((vector_size(64)));
typedef double double_lanes __attribute__((vector_size(128)));

// (through a reference: a vector this wide returned by value draws GCC's ABI note)
template <typename T, typename Lanes>
inline void add_lanes(const T* p, Lanes& sums) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  sums += v;
}

inline void add_lanes(const uint16_t* p, float_lanes& sums) {
  typedef uint16_t half_bits __attribute__((vector_size(32)));
  typedef uint32_t float_bits __attribute__((vector_size(64)));
  half_bits h;
  std::memcpy(&h, p, sizeof h);
  const float_bits bits = __builtin_convertvector(h, float_bits) << 16;
  float_lanes v;
  std::memcpy(&v, &bits, sizeof v);
  sums += v;
}

template <typename S>
using lanes_of = typename std::conditional<std::is_same<S, double>::value, double_lanes,
                                           float_lanes>::type;

// The lanes' fixed tree: lane j += lane j + N/2 for j < N/2, then the same over the first half,
// down to lane 0 (N a power of two), in vector registers: through an array in memory each level
// waited on the last one's stores, and a short column (a chunk of 128 rows) spent more on its
// tree than on its loads (8192x64, the sums alone on one core: 270-380 us before, 123-151 after;
// through the layer's backward on 2 threads, bfloat16 177-210 -> 104-116 us, float32 160-185 ->
// 88-94, torch's sum(0) 43-59).
template <typename Acc, int N>
struct LaneTree {
  typedef Acc Lanes __attribute__((vector_size(N * sizeof(Acc))));
  typedef Acc Half __attribute__((vector_size(N / 2 * sizeof(Acc))));
  static Acc sum(const Lanes& v) {
    Half low, high;
    std::memcpy(&low, &v, sizeof low);
    std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
    return LaneTree<Acc, N / 2>::sum(low + high);
  }
};

template <typename Acc>
struct LaneTree<Acc, 2> {
  typedef Acc Lanes __attribute__((vector_size(2 * sizeof(Acc))));
  static Acc sum(const Lanes& v) { return v[0] + v[1]; }
};

// One column's n contiguous elements in the lanes, then the tree. (Inlined into each clone.)
template <typename S>
__attribute__((always_inline)) inline acc_of<S> column_block_sum(const S* __restrict__ column,
                                                                 int64_t n) {
  using Acc = acc_of<S>;
  constexpr int64_t kLanes = 16, kVectors = kColumnLanes / kLanes;
  static_assert(sizeof(lanes_of<S>) == kLanes * sizeof(Acc), "16 lanes");
  static_assert(kVectors == 4, "the tree below takes 4 vectors");
  lanes_of<S> v[kVectors] = {};
  int64_t i = 0;
  for (; i + kColumnLanes <= n; i += kColumnLanes) {
    for (int64_t k = 0; k < kVectors; ++k) add_lanes(column + i + k * kLanes, v[k]);
  }
  int64_t k = 0;  // (i is a multiple of kColumnLanes here: the rest starts at lane 0)
  for (; i + kLanes <= n; i += kLanes, ++k) add_lanes(column + i, v[k]);
  if (i < n) {  // (the last rows into the next vector's first lanes, in row order)
    Acc lane[kLanes];
    std::memcpy(lane, &v[k], sizeof lane);
    for (int64_t j = 0; i + j < n; ++j) lane[j] += Compute<S>::load(column[i + j]);
    std::memcpy(&v[k], lane, sizeof lane);
  }
  // lane j += lane j + 32 (j < 32), then j += j + 16 (j < 16), then the 16 lanes' tree
  v[0] += v[2];
  v[1] += v[3];
  v[0] += v[1];
  return LaneTree<Acc, kLanes>::sum(v[0]);
}

// A column of n contiguous elements: blocks of kColumnBlockRows rows, each summed by
// column_block_sum (each lane adds at most kMaxBiasChunkRows rows in order, as a chunk of the
// row-major pass), the blocks' sums then added pairwise in the tree of reduce_column_partials
// (a binary counter over the blocks: level b holds the sum of 2^b of them; the levels left at
// the end folded from the lowest up). Up to kColumnBlockRows rows, column_block_sum's bits.
constexpr int64_t kColumnBlockRows = kColumnLanes * kMaxBiasChunkRows;

template <typename S>
__attribute__((always_inline)) inline acc_of<S> column_sum(const S* __restrict__ column,
                                                           int64_t n) {
  using Acc = acc_of<S>;
  if (n <= kColumnBlockRows) return column_block_sum<S>(column, n);
  Acc level[64];
  uint64_t count = 0;
  for (int64_t i = 0; i < n; i += kColumnBlockRows) {
    Acc v = column_block_sum<S>(column + i, std::min(kColumnBlockRows, n - i));
    int b = 0;
    for (; (count >> b) & 1; ++b) v = level[b] + v;
    level[b] = v;
    ++count;
  }
  Acc total = Acc(0);
  bool first = true;
  for (int b = 0; b < 64; ++b) {
    if ((count >> b) & 1) {
      total = first ? level[b] : level[b] + total;
      first = false;
    }
  }
  return total;
}

template <typename S>
DPCUDA_CPU_CLONES void column_major_bias(const S* __restrict__ g,
                                         acc_of<S>* __restrict__ partial, int64_t row_begin,
                                         int64_t row_end, int64_t cols, int64_t cs) {
  for (int64_t c = 0; c < cols; ++c) {
    partial[c] += column_sum<S>(g + c * cs + row_begin, row_end - row_begin);
  }
}

// Whole columns: out[c] = 0 + column c's sum over rows [0, rows), the bits of column_major_bias
// over those rows onto a zeroed partial.
template <typename S>
DPCUDA_CPU_CLONES void column_major_totals(const S* __restrict__ g, acc_of<S>* __restrict__ out,
                                           int64_t rows, int64_t col_begin, int64_t col_end,
                                           int64_t cs) {
  using Acc = acc_of<S>;
  for (int64_t c = col_begin; c < col_end; ++c) out[c] = Acc(0) + column_sum<S>(g + c * cs, rows);
}

// One instantiation per (bias, pre) combination, so the inner loop has no branch left and
// vectorises (GCC does not unswitch a loop on two pointers reliably).
template <typename T, Activation A, bool kBias, bool kPre>
DPCUDA_CPU_CLONES void forward_rows(T* __restrict__ out, T* __restrict__ pre,
                                    const T* __restrict__ bias, int64_t row_begin,
                                    int64_t row_end, int64_t cols) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    T* __restrict__ row = out + r * cols;
    T* __restrict__ pre_row = kPre ? pre + r * cols : nullptr;
#pragma GCC ivdep
    for (int64_t c = 0; c < cols; ++c) {
      const T z = kBias ? row[c] + bias[c] : row[c];
      if (kPre) pre_row[c] = z;
      row[c] = activate<T>(A, z);
    }
  }
}

// pre_activation_forward's rows: z = pre + bias (written back only with a bias), out = act(z).
template <typename T, Activation A, bool kBias>
DPCUDA_CPU_CLONES void forward_rows_from_pre(T* __restrict__ out, T* __restrict__ pre,
                                             const T* __restrict__ bias, int64_t row_begin,
                                             int64_t row_end, int64_t cols) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    T* __restrict__ row = out + r * cols;
    T* __restrict__ pre_row = pre + r * cols;
#pragma GCC ivdep
    for (int64_t c = 0; c < cols; ++c) {
      const T z = kBias ? pre_row[c] + bias[c] : pre_row[c];
      if (kBias) pre_row[c] = z;
      row[c] = activate<T>(A, z);
    }
  }
}

// grad_out * act'(saved) for one element (activation_backward_value, shared with the CUDA
// kernel). relu's select of values loaded unconditionally vectorises: a conditional load
// becomes a branch on the sign, a coin toss on real data, and its mispredictions cost several
// times the whole pass.
template <typename T, Activation A>
inline T grad_pre_value(T go, T saved) {
  return activation_backward_value<T>(A, go, saved);
}

// bfloat16 with an activation computed from exp or tanh: kFloatBlock elements at a time are
// widened into float buffers, the activation's loop runs over the buffers alone, and the
// results are rounded and stored by a loop of their own (the same arithmetic for each element).
// In one loop the conversions and the function's constants outgrow the 32 vector registers (GCC
// spills them to the stack in every iteration). The backward takes it where the derivative is
// computed from the pre-activation (4096x256 with the bias sum, one core, ns an element, before
// and after: silu 0.76-0.78 -> 0.65-0.67, gelu 0.72-0.75 -> 0.66-0.70, gelu_tanh 1.00 ->
// 0.91-0.95); sigmoid's and tanh's, from the output, are a few multiplies, and the extra
// passes over the buffer made them slower (0.30 -> 0.33-0.36). Rows narrower than
// kFloatBlockMinCols go row by row in the one loop: four short loops a row cost more than the
// spills (gelu with the bias sum at batch 4096, one core, ns an element, one loop against
// blocks: 16 wide 1.21-1.29 against 2.75-2.87, 32 wide 0.85-0.90 against 0.92-0.98, 64 wide
// 0.78-0.81 against 0.76-0.85, 128 wide 0.77-0.78 against 0.69-0.77). (With the bias sums
// over a contiguous gradient, backward_pass runs such rows a group at a time as one row.)
constexpr int64_t kFloatBlock = 256, kFloatBlockMinCols = 128;
template <typename S, Activation A>
constexpr bool kBlocked = sizeof(S) == 2 && (A == Activation::kGelu ||
                                             A == Activation::kGeluTanh || A == Activation::kSilu);

// grad_out's row r at grad_out + r * rs, its column c at go[c] (kCol 1: unit stride, the loops
// vectorise), go[0] (kCol 0: an expanded gradient, one value per row, read as a broadcast) or
// go[c * cs] (kCol -1: any stride, a transposed or sliced gradient). S is the stored type; the
// values are computed in acc_of<S>, and the bias sums add g as it is stored (for bfloat16, its
// rounded value widened back: the sums of the stored g).
template <typename S, Activation A, int kCol>
DPCUDA_CPU_CLONES void backward_rows(const S* __restrict__ grad_out,
                                     const S* __restrict__ saved, S* __restrict__ grad_pre,
                                     acc_of<S>* __restrict__ bias_partial, int64_t row_begin,
                                     int64_t row_end, int64_t cols, int64_t rs, int64_t cs) {
  using T = acc_of<S>;
  using C = Compute<S>;
  // grad_out's column c of the row at go
  const auto at = [cs](const S* go, int64_t c) {
    return C::load(kCol == 1 ? go[c] : kCol == 0 ? go[0] : go[c * cs]);
  };
  int64_t r = row_begin;
  if constexpr (sizeof(S) >= 4) {
    // float and double with the bias sums: kSumRows rows at a time. Each column's partial sum
    // is loaded once, the rows' values are added to it in row order in a register (the same
    // additions in the same order as row by row) and it is stored once, where row by row it is
    // loaded and stored for every row. One core, ns an element, before and after: 256x256 (in
    // cache) relu 0.29-0.32 -> 0.22-0.25, sigmoid 0.26-0.29 -> 0.23-0.24, tanh 0.29-0.34 ->
    // 0.21-0.26, the sums alone 0.12-0.13 -> 0.10-0.11; an expanded gradient's sums alone
    // 0.036-0.039 -> 0.021-0.022 (4096x256, 1024x1024); the rest within noise (bfloat16 was
    // level or up to 9% slower with it: row by row there).
    constexpr int64_t kSumRows = 4;
    if (bias_partial) {
      for (; r + kSumRows <= row_end; r += kSumRows) {
        const S* __restrict__ go = grad_out + r * rs;
        if (grad_pre) {
          const S* __restrict__ s = saved + r * cols;
          S* __restrict__ g = grad_pre + r * cols;
#pragma GCC ivdep
          for (int64_t c = 0; c < cols; ++c) {
            T sum = bias_partial[c];
#pragma GCC unroll 4
            for (int64_t k = 0; k < kSumRows; ++k) {
              const S v =
                  C::store(grad_pre_value<T, A>(at(go + k * rs, c), C::load(s[k * cols + c])));
              g[k * cols + c] = v;
              sum += C::load(v);
            }
            bias_partial[c] = sum;
          }
        } else {
#pragma GCC ivdep
          for (int64_t c = 0; c < cols; ++c) {
            T sum = bias_partial[c];
#pragma GCC unroll 4
            for (int64_t k = 0; k < kSumRows; ++k) sum += at(go + k * rs, c);
            bias_partial[c] = sum;
          }
        }
      }
    }
  }
  for (; r < row_end; ++r) {
    const S* __restrict__ go = grad_out + r * rs;
    if constexpr (kBlocked<S, A>) {
      if (grad_pre && cols >= kFloatBlockMinCols) {
        const S* __restrict__ s = saved + r * cols;
        S* __restrict__ g = grad_pre + r * cols;
        float value[kFloatBlock], held[kFloatBlock];
        for (int64_t c0 = 0; c0 < cols; c0 += kFloatBlock) {
          const int64_t m = std::min(kFloatBlock, cols - c0);
          for (int64_t j = 0; j < m; ++j) value[j] = at(go, c0 + j);
          for (int64_t j = 0; j < m; ++j) held[j] = C::load(s[c0 + j]);
          for (int64_t j = 0; j < m; ++j) value[j] = grad_pre_value<T, A>(value[j], held[j]);
          if (bias_partial) {
            float* __restrict__ sums = bias_partial + c0;
#pragma GCC ivdep
            for (int64_t j = 0; j < m; ++j) {
              const S v = C::store(value[j]);
              g[c0 + j] = v;
              sums[j] += C::load(v);
            }
          } else {
#pragma GCC ivdep
            for (int64_t j = 0; j < m; ++j) g[c0 + j] = C::store(value[j]);
          }
        }
        continue;
      }
    }
    if (grad_pre) {
      const S* __restrict__ s = saved + r * cols;
      S* __restrict__ g = grad_pre + r * cols;
      // With the bias, g is added to the partial sums in the same loop, from registers.
      if (bias_partial) {
#pragma GCC ivdep
        for (int64_t c = 0; c < cols; ++c) {
          const S v = C::store(grad_pre_value<T, A>(at(go, c), C::load(s[c])));
          g[c] = v;
          bias_partial[c] += C::load(v);
        }
      } else {
#pragma GCC ivdep
        for (int64_t c = 0; c < cols; ++c) {
          g[c] = C::store(grad_pre_value<T, A>(at(go, c), C::load(s[c])));
        }
      }
    } else if (bias_partial) {
#pragma GCC ivdep
      for (int64_t c = 0; c < cols; ++c) bias_partial[c] += at(go, c);
    }
  }
}

// The bfloat16 forward pass over flat elements: out = act(z), computed in float and rounded
// once (z is the GEMM's result with the bias in it, rounded once, as torch's addmm gives it);
// out may be z itself. The activations computed from exp or tanh go kFloatBlock elements at a
// time through a float buffer (as kBlocked's backward rows, above): 4096x256 on one core, ns
// an element, before and after: silu 0.58 -> 0.39, sigmoid 0.51 -> 0.35, gelu 0.56 -> 0.46,
// tanh 0.56 -> 0.46.
template <Activation A>
DPCUDA_CPU_CLONES void bfloat16_forward_flat(const uint16_t* z, uint16_t* out, int64_t n) {
  if constexpr (A == Activation::kNone || A == Activation::kRelu) {
#pragma GCC ivdep
    for (int64_t i = 0; i < n; ++i) out[i] = round_to_bfloat16(activate<float>(A, widen(z[i])));
  } else {
    float value[kFloatBlock];
    for (int64_t i0 = 0; i0 < n; i0 += kFloatBlock) {
      const int64_t m = std::min(kFloatBlock, n - i0);
      for (int64_t j = 0; j < m; ++j) value[j] = widen(z[i0 + j]);
      for (int64_t j = 0; j < m; ++j) value[j] = activate<float>(A, value[j]);
#pragma GCC ivdep
      for (int64_t j = 0; j < m; ++j) out[i0 + j] = round_to_bfloat16(value[j]);
    }
  }
}

#if defined(DPCUDA_AVX512_TRANSPOSE)
// (GCC 12's AVX-512 headers fill the unused operand of an unmasked shuffle with a
// self-initialised _mm512_undefined_ps(), which -Wuninitialized reports at each use, and
// -Wmaybe-uninitialized where the function is built for one target alone: a sanitizer build.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 16 rows of 16 floats in registers, transposed in place: 64 shuffles. A move of bits: NaN
// payloads and signs as they were.
__attribute__((target("avx512f"), always_inline)) inline void transpose16_registers(__m512* a) {
  __m512 b[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of columns interleaved, 32-bit elements
    b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs of them
    const __m512d b0 = _mm512_castps_pd(b[i]), b1 = _mm512_castps_pd(b[i + 1]);
    const __m512d b2 = _mm512_castps_pd(b[i + 2]), b3 = _mm512_castps_pd(b[i + 3]);
    a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(b0, b2));
    a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(b0, b2));
    a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b1, b3));
    a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b1, b3));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes, twice
    b[i] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0x88);
    b[i + 4] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0xdd);
    b[i + 8] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0x88);
    b[i + 12] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0x88);
    a[i + 8] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0xdd);
  }
}

// 16 columns of 16 floats (column i at src + i * cs) into 16 rows (row i at dst + i * ld), in
// registers: 16 loads, 64 shuffles, 16 stores, where the element-by-element copy makes 256
// stores to 16 lines.
__attribute__((target("avx512f"))) void transpose16_avx512(const float* src, int64_t cs,
                                                          float* dst, int64_t ld) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(src + i * cs);
  transpose16_registers(a);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld, a[i]);
}

// 16 columns of 32 bfloat16 (column i's 64 bytes at src + i * cs) into 32 rows (row i at
// dst + i * ld): each 16-row half of the columns zero-extended into 32-bit lanes, transposed by
// the float shuffles (which move lanes as they are), and the lanes' low halves stored back:
// bits moved, never converted.
__attribute__((target("avx512f"))) void transpose16x32_bf16_avx512(const uint16_t* src,
                                                                  int64_t cs, uint16_t* dst,
                                                                  int64_t ld) {
  for (int half = 0; half < 2; ++half) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * cs + half * 16));
      a[i] = _mm512_castsi512_ps(_mm512_cvtepu16_epi32(v));
    }
    transpose16_registers(a);
    for (int i = 0; i < 16; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (half * 16 + i) * ld),
                          _mm512_cvtepi32_epi16(_mm512_castps_si512(a[i])));
    }
  }
}
#pragma GCC diagnostic pop

bool has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

// Rows [0, n_rows) of a column-major matrix (column c at src + c * cs) into a row-major block
// (row r at dst + r * ld): float blocks of 16 rows and bfloat16 blocks of 32 rows 16 columns at
// a time in registers where the CPU has AVX-512, the rest element by element.
template <typename T>
void transpose_block(const T* src, int64_t cs, int64_t n_rows, int64_t cols, T* dst,
                     int64_t ld) {
  int64_t c = 0;
#if defined(DPCUDA_AVX512_TRANSPOSE)
  if constexpr (std::is_same<T, float>::value) {
    if (n_rows == 16 && has_avx512f()) {
      for (; c + 16 <= cols; c += 16) transpose16_avx512(src + c * cs, cs, dst + c, ld);
    }
  }
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (n_rows == 32 && has_avx512f()) {
      for (; c + 16 <= cols; c += 16) transpose16x32_bf16_avx512(src + c * cs, cs, dst + c, ld);
    }
  }
#endif
  for (; c < cols; ++c) {
    const T* __restrict__ column = src + c * cs;
    for (int64_t r = 0; r < n_rows; ++r) dst[r * ld + c] = column[r];
  }
}

}  // namespace

// Without a bias an element's value does not depend on its column, and the rows are
// contiguous: rows [row_begin, row_end) are passed as one row of their elements, so that a
// narrow layer's pass is one long vector loop rather than one short loop per row (the same
// bits: each element's arithmetic is unchanged).
template <typename T>
void flatten_rows(T*& out, T*& pre, int64_t& row_begin, int64_t& row_end, int64_t& cols) {
  out += row_begin * cols;
  if (pre) pre += row_begin * cols;
  cols *= row_end - row_begin;
  row_begin = 0;
  row_end = cols > 0 ? 1 : 0;
}

template <typename T>
void bias_activation_forward(T* out, T* pre, const T* bias, int64_t row_begin, int64_t row_end,
                             int64_t cols, Activation act) {
  if (!bias) flatten_rows(out, pre, row_begin, row_end, cols);
  with_activation(act, [&](auto a) {
    constexpr Activation A = decltype(a)::value;
    if (bias && pre) {
      forward_rows<T, A, true, true>(out, pre, bias, row_begin, row_end, cols);
    } else if (bias) {
      forward_rows<T, A, true, false>(out, pre, bias, row_begin, row_end, cols);
    } else if (pre) {
      forward_rows<T, A, false, true>(out, pre, bias, row_begin, row_end, cols);
    } else {
      forward_rows<T, A, false, false>(out, pre, bias, row_begin, row_end, cols);
    }
  });
}

template <typename T>
void pre_activation_forward(T* out, T* pre, const T* bias, int64_t row_begin, int64_t row_end,
                            int64_t cols, Activation act) {
  if (!bias) flatten_rows(out, pre, row_begin, row_end, cols);
  with_activation(act, [&](auto a) {
    constexpr Activation A = decltype(a)::value;
    if (bias) {
      forward_rows_from_pre<T, A, true>(out, pre, bias, row_begin, row_end, cols);
    } else {
      forward_rows_from_pre<T, A, false>(out, pre, bias, row_begin, row_end, cols);
    }
  });
}

// When a column-major gradient is read in transposed blocks: rows of at least kBlockedCols
// columns at a column stride of at least kBlockedStride. Read row by row, each element is a
// cache line of its own, and at a column stride that is a multiple of 4 KB all of a row's lines
// fall in one set of the L1 cache. Measured on the 2-core AVX-512 machine (the pass alone with
// its bias sum, transposed, us; the row-by-row read, then blocks with the element-by-element
// copy into a padded buffer, then with the AVX-512 copy): sigmoid 1024x1024 2231, 1031-1103,
// 511-736; 4096x256 3276, 1042-1064, 581-648; 512x4096 2957, 1959-2018, 1015-1496; 256x4096
// 700, 659-691, 521-524; silu, tanh and relu alike. From 16 columns, for every activation and
// for float and bfloat16 alike (one core, batch 4096, with the bias sum, us, row by row against
// blocks with the AVX-512 copy; 2026-12-01): bfloat16 gelu 16 wide 200 -> 118, 64 wide 866 ->
// 365, 128 wide 1985 -> 686 (the contiguous gradient's pass 603), 512 wide 9338 -> 3423; relu
// 16 wide 142 -> 52, 128 wide 1865 -> 286; float32 gelu 64 wide 438 -> 257, 128 wide 945 ->
// 542; relu 16 wide 50 -> 29. (Before the bfloat16 copy, element by element, gelu and
// gelu_tanh hid the row-by-row read behind their arithmetic below 256 columns.)
constexpr int64_t kBlockedCols = 16;
constexpr int64_t kBlockedStride = 16;

namespace {

// Narrow rows (under kFloatBlockMinCols columns), rows of them contiguous at grad_out, saved
// and grad_pre: g for all of them as one run of elements, then the bias sums (bias_partial
// non-null) over the stored g, row by row. A loop per row cost more than its arithmetic; the
// bits are the row loop's: the same g, each column's sum adding the same values in row order.
template <typename S, Activation A>
void narrow_rows_then_sums(const S* grad_out, const S* saved, S* grad_pre,
                           acc_of<S>* bias_partial, int64_t rows, int64_t cols) {
  const int64_t m = rows * cols;
  backward_rows<S, A, 1>(grad_out, saved, grad_pre, nullptr, 0, 1, m, m, 1);
  if (bias_partial) {
    backward_rows<S, Activation::kNone, 1>(grad_pre, nullptr, nullptr, bias_partial, 0, rows,
                                           cols, cols, 1);
  }
}

// bfloat16's column sums alone (a "none" layer's bias gradient, or the sums over ATen's g where
// ATen's kernel made it) over a gradient of unit column stride, rows narrower than
// kFloatBlockMinCols: kSumRows rows at a time, each column's partial sum in a
// register over them, loaded and stored once (the same additions in row order as row by row,
// which loads and stores the partials for every row of a vector or two: 16 wide at batch 8192,
// 21 us against torch's sum's 9).
template <typename S>
DPCUDA_CPU_CLONES void narrow_sums(const S* __restrict__ grad_out,
                                   acc_of<S>* __restrict__ bias_partial, int64_t row_begin,
                                   int64_t row_end, int64_t cols, int64_t rs) {
  using T = acc_of<S>;
  using C = Compute<S>;
  constexpr int64_t kSumRows = 8;
  int64_t r = row_begin;
  for (; r + kSumRows <= row_end; r += kSumRows) {
    const S* __restrict__ go = grad_out + r * rs;
#pragma GCC ivdep
    for (int64_t c = 0; c < cols; ++c) {
      T sum = bias_partial[c];
#pragma GCC unroll 8
      for (int64_t k = 0; k < kSumRows; ++k) sum += C::load(go[k * rs + c]);
      bias_partial[c] = sum;
    }
  }
  for (; r < row_end; ++r) {
    const S* __restrict__ go = grad_out + r * rs;
#pragma GCC ivdep
    for (int64_t c = 0; c < cols; ++c) bias_partial[c] += C::load(go[c]);
  }
}

// Rows [row_begin, row_end) of an expanded gradient (row r's one value at grad_out[r * rs]):
// the values copied into rows of a buffer of kWidth elements, which the unit-stride loop reads
// (as many whole rows as it holds, or a wider row's columns kWidth at a time).
template <typename S, Activation A>
void expanded_rows(const S* grad_out, const S* saved, S* grad_pre, acc_of<S>* bias_partial,
                   int64_t row_begin, int64_t row_end, int64_t cols, int64_t rs) {
  constexpr int64_t kWidth = 1024;
  S buffer[kWidth];
  if (cols == 0) return;  // (no columns: nothing to read or write)
  if (cols <= kWidth) {
    const int64_t per_call = kWidth / cols;
    for (int64_t r0 = row_begin; r0 < row_end; r0 += per_call) {
      const int64_t n = std::min(per_call, row_end - r0);
      for (int64_t i = 0; i < n; ++i) {
        std::fill(buffer + i * cols, buffer + (i + 1) * cols, grad_out[(r0 + i) * rs]);
      }
      if (grad_pre && cols < kFloatBlockMinCols) {
        // Narrow rows: the buffer's rows through narrow_rows_then_sums. The layer (relu, gelu,
        // gelu_tanh: the activations whose backward over an expanded gradient is this pass),
        // eager/fused at 16 wide, batch 8192, without and with bias: gelu 1.036 and 1.047 ->
        // 1.108 and 1.102, gelu_tanh 1.128 and 1.109 -> 1.209 and 1.164, relu level (1.03); 64
        // wide within noise (sweep-narrow-expanded-cpu-2026-11-28*).
        narrow_rows_then_sums<S, A>(buffer, saved + r0 * cols, grad_pre + r0 * cols,
                                    bias_partial, n, cols);
        continue;
      }
      backward_rows<S, A, 1>(buffer, grad_pre ? saved + r0 * cols : nullptr,
                             grad_pre ? grad_pre + r0 * cols : nullptr, bias_partial, 0, n, cols,
                             cols, 1);
    }
    return;
  }
  for (int64_t r = row_begin; r < row_end; ++r) {
    std::fill(buffer, buffer + kWidth, grad_out[r * rs]);
    for (int64_t c0 = 0; c0 < cols; c0 += kWidth) {
      const int64_t width = std::min(kWidth, cols - c0), at = r * cols + c0;
      backward_rows<S, A, 1>(buffer, grad_pre ? saved + at : nullptr,
                             grad_pre ? grad_pre + at : nullptr,
                             bias_partial ? bias_partial + c0 : nullptr, 0, 1, width, 0, 1);
    }
  }
}

// activation_backward_rows for the stored type S (float, double, bfloat16 as uint16_t), onto
// the sums as they are (backward_pass zeroes them first).
template <typename S>
void backward_pass_rows(const S* grad_out, const S* saved, S* grad_pre, acc_of<S>* bias_partial,
                        int64_t row_begin, int64_t row_end, int64_t cols, Activation act,
                        int64_t go_row_stride, int64_t go_col_stride) {
  with_activation(act, [&](auto a) {
    constexpr Activation A = decltype(a)::value;
    const int64_t rs = go_row_stride, cs = go_col_stride;
    if constexpr (sizeof(S) == 2) {
      if (cs == 0) {
        // An expanded bfloat16 gradient takes the unit-stride loop over a row of its value:
        // with the value hoisted out of the loop, GCC 12 leaves relu's select of two constant
        // bit patterns scalar, with a branch (11 ms against 0.6 over 4096x1024).
        expanded_rows<S, A>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols,
                            rs);
        return;
      }
    }
    const int64_t n = (row_end - row_begin) * cols, offset = row_begin * cols;
    const bool flat = (cs == 1 && rs == cols) || (cs == 0 && rs == 0);
    if constexpr (sizeof(S) == 2) {
      if (!grad_pre && bias_partial && cs == 1 && cols < kFloatBlockMinCols) {
        narrow_sums<S>(grad_out, bias_partial, row_begin, row_end, cols, rs);
        return;
      }
      if (grad_pre && bias_partial && cs == 1 && rs == cols && cols < kFloatBlockMinCols) {
        // bfloat16 rows narrower than kFloatBlockMinCols over a contiguous gradient, with the
        // bias sums: a group of rows at a time (blocked where the activation is) through
        // narrow_rows_then_sums: each row's loop was a vector or two, its overhead the most of
        // it (16 wide silu at batch 8192 took 2.1 ns an element, ATen's silu_backward 0.7).
        const int64_t group = std::max<int64_t>(1, kFloatBlock * 16 / std::max<int64_t>(cols, 1));
        for (int64_t r0 = row_begin; r0 < row_end; r0 += group) {
          const int64_t r1 = std::min(r0 + group, row_end), at = r0 * cols;
          narrow_rows_then_sums<S, A>(grad_out + at, saved + at, grad_pre + at, bias_partial,
                                      r1 - r0, cols);
        }
        return;
      }
    }
    if (grad_pre && !bias_partial && n > 0 && flat) {
      // No bias sum, and grad_out contiguous or one value for all (y.sum()'s): one row of all
      // the elements, as in the forward's flatten_rows.
      if (cs == 1) {
        backward_rows<S, A, 1>(grad_out + offset, saved + offset, grad_pre + offset, nullptr,
                               0, 1, n, n, 1);
      } else {
        backward_rows<S, A, 0>(grad_out, saved + offset, grad_pre + offset, nullptr, 0, 1, n, 0,
                               0);
      }
    } else if (cs == 1) {
      backward_rows<S, A, 1>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols,
                             rs, cs);
    } else if (cs == 0) {
      backward_rows<S, A, 0>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols,
                             rs, cs);
    } else if (!grad_pre && bias_partial && rs == 1) {
      column_major_bias<S>(grad_out, bias_partial, row_begin, row_end, cols, cs);
    } else if (grad_pre && rs == 1 && cs >= kBlockedStride && cols >= kBlockedCols) {
      // A column-major gradient (a transposed one): read row by row, each element is a cache
      // line of its own, and a row's lines no longer stay in cache for the next row. Each
      // block of kBlock rows is first transposed into a small row-major buffer (64 bytes of
      // each column per block, 128 for double: a line or two, as the block falls), and the
      // block then takes the contiguous pass. The same bits: each element's arithmetic is
      // unchanged, and each column's bias sum still adds the rows in order.
      // The buffer's rows are kPad elements longer than a row: at a row length that is a
      // multiple of 1024 floats (4 KB) the rows would map to one set of the L1 cache, which
      // holds 12 of the 16 lines each column's copy writes.
      // (bfloat16: blocks of 32 rows, 64 bytes of each column too.)
      constexpr int64_t kBlock = sizeof(S) == 2 ? 32 : 16, kPad = 16;
      const int64_t ld = cols + kPad;
      const std::unique_ptr<S[]> block(new S[kBlock * ld]);  // (not zeroed: rows all written)
      for (int64_t r0 = row_begin; r0 < row_end; r0 += kBlock) {
        const int64_t r1 = std::min(r0 + kBlock, row_end), n_rows = r1 - r0;
        transpose_block<S>(grad_out + r0, cs, n_rows, cols, block.get(), ld);
        backward_rows<S, A, 1>(block.get(), saved + r0 * cols, grad_pre + r0 * cols,
                               bias_partial, 0, n_rows, cols, ld, 1);
      }
    } else {
      backward_rows<S, A, -1>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols,
                              rs, cs);
    }
  });
}

template <typename S>
void backward_pass(const S* grad_out, const S* saved, S* grad_pre, acc_of<S>* bias_partial,
                   int64_t row_begin, int64_t row_end, int64_t cols, Activation act,
                   int64_t go_row_stride, int64_t go_col_stride) {
  if (bias_partial) std::fill(bias_partial, bias_partial + cols, acc_of<S>(0));
  backward_pass_rows<S>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols, act,
                        go_row_stride, go_col_stride);
}

// Rows [0, n_rows) of a row-major block (row r at src + r * cols) into the columns of a
// column-major matrix (column c at dst + c * dst_col_stride): kGroup rows at a time, column by
// column. At a row length that is a multiple of 4 KB all the rows' lines fall in one set of the
// L1 cache: 32 rows at a time evicted each other (bfloat16 32x4096, gelu over a transposed
// gradient, the whole pass: 150 us writing g row-major; by columns 32 rows at a time 429, 16
// rows 297, 8 rows 213, 4 rows 216, 2 rows 228; 2-core AVX-512 machine, 2026-11-29).
template <typename S>
void rows_to_columns(const S* __restrict__ src, int64_t n_rows, int64_t cols,
                     S* __restrict__ dst, int64_t dst_col_stride) {
  constexpr int64_t kGroup = 8;
  for (int64_t r0 = 0; r0 < n_rows; r0 += kGroup) {
    const int64_t r1 = std::min(n_rows, r0 + kGroup);
    for (int64_t c = 0; c < cols; ++c) {
      S* __restrict__ column = dst + c * dst_col_stride;
      for (int64_t r = r0; r < r1; ++r) column[r] = src[r * cols + c];
    }
  }
}

// backward_pass writing g column-major (row r of column c at grad_pre + r + c * g_col_stride):
// each block of rows made row-major in a buffer by backward_pass_rows (the same values, and the
// same sums, added in the same order), then written out by columns.
template <typename S>
void backward_pass_to_columns(const S* grad_out, const S* saved, S* grad_pre,
                              acc_of<S>* bias_partial, int64_t row_begin, int64_t row_end,
                              int64_t cols, Activation act, int64_t go_row_stride,
                              int64_t go_col_stride, int64_t g_col_stride) {
  if (bias_partial) std::fill(bias_partial, bias_partial + cols, acc_of<S>(0));
  constexpr int64_t kBlock = 32;
  const int64_t block = std::min(kBlock, std::max<int64_t>(0, row_end - row_begin));
  const std::unique_ptr<S[]> buffer(new S[block * cols]);  // (not zeroed: rows all written)
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kBlock) {
    const int64_t n_rows = std::min(kBlock, row_end - r0);
    backward_pass_rows<S>(grad_out + r0 * go_row_stride, saved + r0 * cols, buffer.get(),
                          bias_partial, 0, n_rows, cols, act, go_row_stride, go_col_stride);
    rows_to_columns<S>(buffer.get(), n_rows, cols, grad_pre + r0, g_col_stride);
  }
}

}  // namespace

template <typename T>
void activation_backward_rows(const T* grad_out, const T* saved, T* grad_pre, T* bias_partial,
                              int64_t row_begin, int64_t row_end, int64_t cols, Activation act,
                              int64_t go_row_stride, int64_t go_col_stride) {
  backward_pass<T>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols, act,
                   go_row_stride, go_col_stride);
}

void bfloat16_activation_backward_rows(const uint16_t* grad_out, const uint16_t* saved,
                                       uint16_t* grad_pre, float* bias_partial,
                                       int64_t row_begin, int64_t row_end, int64_t cols,
                                       Activation act, int64_t go_row_stride,
                                       int64_t go_col_stride) {
  backward_pass<uint16_t>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols, act,
                          go_row_stride, go_col_stride);
}

void bfloat16_activation_backward_to_columns(const uint16_t* grad_out, const uint16_t* saved,
                                             uint16_t* grad_pre, float* bias_partial,
                                             int64_t row_begin, int64_t row_end, int64_t cols,
                                             Activation act, int64_t go_row_stride,
                                             int64_t go_col_stride, int64_t g_col_stride) {
  backward_pass_to_columns<uint16_t>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end,
                                     cols, act, go_row_stride, go_col_stride, g_col_stride);
}

template <typename T>
void column_major_bias_sums(const T* grad_out, T* out, int64_t rows, int64_t col_begin,
                            int64_t col_end, int64_t go_col_stride) {
  column_major_totals<T>(grad_out, out, rows, col_begin, col_end, go_col_stride);
}

void bfloat16_column_major_bias_sums(const uint16_t* grad_out, float* out, int64_t rows,
                                     int64_t col_begin, int64_t col_end,
                                     int64_t go_col_stride) {
  column_major_totals<uint16_t>(grad_out, out, rows, col_begin, col_end, go_col_stride);
}

void bfloat16_activation_forward(const uint16_t* z, uint16_t* out, int64_t begin, int64_t end,
                                 Activation act) {
  if (end <= begin) return;
  with_activation(act, [&](auto a) {
    bfloat16_forward_flat<decltype(a)::value>(z + begin, out + begin, end - begin);
  });
}

template <typename T>
void reduce_column_partials(T* partials, int64_t chunks, int64_t cols, T* out,
                            int64_t col_begin, int64_t col_end) {
  for (int64_t s = 1; s < chunks; s *= 2) {
    for (int64_t k = 0; k + s < chunks; k += 2 * s) {
      T* __restrict__ to = partials + k * cols;
      const T* __restrict__ from = partials + (k + s) * cols;
      for (int64_t c = col_begin; c < col_end; ++c) to[c] += from[c];
    }
  }
  // (0 + the tree: a sum that starts at +0 is never -0, as the chunks' own sums)
  for (int64_t c = col_begin; c < col_end; ++c) out[c] = chunks > 0 ? T(0) + partials[c] : T(0);
}

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template void bias_activation_forward<T>(T*, T*, const T*, int64_t, int64_t, int64_t,        \
                                           Activation);                                        \
  template void pre_activation_forward<T>(T*, T*, const T*, int64_t, int64_t, int64_t,         \
                                          Activation);                                         \
  template void activation_backward_rows<T>(const T*, const T*, T*, T*, int64_t, int64_t,      \
                                            int64_t, Activation, int64_t, int64_t);            \
  template void reduce_column_partials<T>(T*, int64_t, int64_t, T*, int64_t, int64_t);        \
  template void column_major_bias_sums<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t);

DPCUDA_INSTANTIATE(float)
DPCUDA_INSTANTIATE(double)
#undef DPCUDA_INSTANTIATE

}  // namespace cpu
}  // namespace dpcuda
