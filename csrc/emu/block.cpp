// The threads of an emulated block: one fiber per CUDA thread, all on the worker thread of the
// stream that runs the grid, switched at __syncthreads and at the warp intrinsics under a seeded
// random schedule. Misuse that would hang or be undefined on a GPU is reported instead: a block
// whose threads split between a barrier and an exit, a shuffle whose mask names a lane that
// exited or waits elsewhere, a lane outside its own mask, a source lane outside the mask.
//
// The blocks of a grid run at once: the stream's worker and a pool of block workers each take
// the next block of a seeded random order until none is left, so blocks interleave for real.
//
// ThreadSanitizer sees each fiber as a thread of its own (its fiber API); switches carry no
// synchronisation, and the only happens-before edges among the threads of a block are the ones
// the hardware gives: the barrier, __syncwarp, and the start and end of the grid. A missing
// barrier is then a race report. Between blocks the edges are the device memory model's: a
// __threadfence before an atomic read-modify-write releases what the thread wrote before it, to
// whoever reads that atomic and then fences (acquire), as C++ fences order relaxed atomics.
// Blocks that one worker runs one after another are ordered (they reuse its shared memory), so a
// race between two blocks is seen when they land on different workers. This file is built
// without TSan instrumentation (csrc/emu/tsan.h).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda.h"
#include "emu.h"
#include "internal.h"
#include "tsan.h"

#if defined(DPCUDA_EMU_TSAN)
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
}
constexpr unsigned kTsanNoSync = 1;  // __tsan_switch_to_fiber_no_sync
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DPCUDA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DPCUDA_EMU_ASAN 1
#endif
#endif
#if defined(DPCUDA_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64"
#endif

// Saves the callee-saved registers and the floating-point control words on the current stack,
// stores the stack pointer to *save, and resumes the stack `to` (saved the same way). Written
// out because ucontext's swapcontext makes a system call per switch, and the emulator switches
// at every barrier and every shuffle of every thread.
extern "C" void dpcuda_emu_switch(void** save, void* to);
asm(R"(
  .text
  .globl dpcuda_emu_switch
  .type dpcuda_emu_switch,@function
dpcuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dpcuda_emu_switch,.-dpcuda_emu_switch
)");

namespace dpcuda {
namespace emu {
namespace {

// Kernels are small; sanitizers grow frames several times.
constexpr size_t kStackBytes = 256 * 1024;

enum class State { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  ThreadBuiltins builtins;
  int linear = 0;
  State state = State::kReady;
  // The warp intrinsic this fiber waits in.
  unsigned mask = 0;
  uint64_t bits = 0;
  int src = 0;
  bool fence = false;
  const char* what = "";
  uint64_t result = 0;
  int generation = 0;  // of the barrier or __syncwarp the fiber waits in
  void* fake_stack = nullptr;
  void* tsan = nullptr;
  // The device memory model (thread_fence): whether the thread has fenced, and the atomics it
  // read since its last fence.
  bool fenced = false;
  void* atomics[8] = {};
  int atomic_count = 0;
};

struct Runner {
  std::vector<std::unique_ptr<Fiber>> fibers;
  void* main_sp = nullptr;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  const char* site = "";
  int nthreads = 0;
  int at_barrier = 0;
  int done = 0;
  bool failed = false;
  std::string message;
  // The fibers that can run, by warp, and how the next one is picked: in a block run in
  // "priority" mode the warps go in a fixed random order, the first warp with a runnable lane
  // first (one warp races ahead of the others, as warps drift apart on a GPU); otherwise a
  // random warp, then a random lane.
  std::vector<std::vector<int>> ready;
  int ready_count = 0;
  bool priority = false;
  std::vector<int> warp_order;
  std::mt19937_64 rng;
  void* tsan_main = nullptr;
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
  void* main_fake_stack = nullptr;
  // Barriers completed in this block, and __syncwarp groups completed per warp: a fiber waits
  // on one generation, and generations alternate between two synchronisation objects (a fiber
  // cannot be two generations ahead of one still waiting).
  int barrier_generation = 0;
  int warp_generation[32] = {};
  // Addresses that stand for the synchronisation objects of the block (TSan keys on them).
  char launch_sync = 0, end_sync = 0, barrier_sync[2] = {}, warp_sync[32][2] = {};
  ~Runner();
};

// Fibers outlive the worker thread that made them: a stream's worker ends with its stream, and
// a later worker takes its fibers (stack and TSan context) instead of making new ones, which
// under TSan is most of the cost of a short stream. A reused context brings no false ordering:
// a stream is drained before its worker ends, and the host that destroyed it is ordered after
// everything it ran. Made at start-up, before any worker exists.
struct FiberPool {
  std::mutex m;
  std::vector<std::unique_ptr<Fiber>> free;
};
FiberPool* const g_pool = new FiberPool;  // never destroyed: workers may end at exit

Runner::~Runner() {
  const Quiet quiet;
  const std::lock_guard<std::mutex> lock(g_pool->m);
  for (auto& f : fibers) g_pool->free.push_back(std::move(f));
}

thread_local Runner tl_runner;

std::string describe(const Fiber& f) {
  std::ostringstream s;
  s << "thread (" << f.builtins.thread_idx.x << "," << f.builtins.thread_idx.y << ","
    << f.builtins.thread_idx.z << ") of block (" << f.builtins.block_idx.x << ","
    << f.builtins.block_idx.y << "," << f.builtins.block_idx.z << ")";
  return s.str();
}

void fiber_entry();

// From the scheduler into fiber f.
void switch_to(Runner& r, Fiber* f) {
  r.current = f;
#if defined(DPCUDA_EMU_TSAN)
  __tsan_switch_to_fiber(f->tsan, kTsanNoSync);
#endif
#if defined(DPCUDA_EMU_ASAN)
  __sanitizer_start_switch_fiber(&r.main_fake_stack, f->stack, kStackBytes);
#endif
  dpcuda_emu_switch(&r.main_sp, f->sp);
#if defined(DPCUDA_EMU_ASAN)
  __sanitizer_finish_switch_fiber(r.main_fake_stack, nullptr, nullptr);
#endif
  r.current = nullptr;
}

// From the running fiber back to the scheduler; returns when the scheduler resumes it. What the
// fiber did so far happens before the end of the grid, even if it is never resumed (a block
// abandoned after a misuse).
void switch_to_main(Runner& r, Fiber* f) {
  tsan_release(&r.end_sync);
#if defined(DPCUDA_EMU_TSAN)
  __tsan_switch_to_fiber(r.tsan_main, kTsanNoSync);
#endif
#if defined(DPCUDA_EMU_ASAN)
  __sanitizer_start_switch_fiber(f->state == State::kDone ? nullptr : &f->fake_stack,
                                 r.main_stack_bottom, r.main_stack_size);
#endif
  dpcuda_emu_switch(&f->sp, r.main_sp);
#if defined(DPCUDA_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

// A misuse found in the running fiber: abandon the block (the fibers are never resumed; their
// stacks are reset before reuse) and go back to the scheduler, which reports `what`. The message
// is moved out of this frame first: nothing left on an abandoned stack may own memory.
[[noreturn]] void fail(Runner& r, std::string&& what) {
  r.message = std::move(what);
  r.failed = true;
  Fiber* f = r.current;
  f->state = State::kDone;
  switch_to_main(r, f);
  std::abort();  // never resumed
}

void fiber_entry() {
  Runner& r = tl_runner;
  Fiber* f = r.current;
#if defined(DPCUDA_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &r.main_stack_bottom, &r.main_stack_size);
#endif
  // Everything the stream did before the launch happens before the kernel's threads.
  tsan_acquire(&r.launch_sync);
  (*r.body)();
  f->state = State::kDone;
  ++r.done;
  switch_to_main(r, f);
  std::abort();  // a finished fiber is never resumed
}

Fiber* make_fiber() {
  Runner& r = tl_runner;
  {
    const Quiet quiet;
    const std::lock_guard<std::mutex> lock(g_pool->m);
    if (!g_pool->free.empty()) {
      r.fibers.push_back(std::move(g_pool->free.back()));
      g_pool->free.pop_back();
      return r.fibers.back().get();
    }
  }
  auto f = std::make_unique<Fiber>();
  // A guard page at the stack's low end: an overflow faults instead of corrupting a neighbour.
  void* mem = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (mem == MAP_FAILED || mprotect(mem, 4096, PROT_NONE) != 0) {
    std::fprintf(stderr, "dpcuda-emu: cannot map a fiber stack\n");
    std::abort();
  }
  f->stack = static_cast<char*>(mem);
#if defined(DPCUDA_EMU_TSAN)
  f->tsan = __tsan_create_fiber(0);
#endif
  r.fibers.push_back(std::move(f));
  return r.fibers.back().get();
}

// A stack that dpcuda_emu_switch resumes into fiber_entry, as if fiber_entry had been called
// (the stack pointer 8 bytes past a 16-byte boundary at its entry), with a null return address.
void* initial_stack(char* stack) {
  auto* top = reinterpret_cast<uint64_t*>(
      (reinterpret_cast<uintptr_t>(stack) + kStackBytes) & ~uintptr_t(15));
  uint64_t* ret = top - 2;  // 16-byte aligned
  ret[1] = 0;
  ret[0] = reinterpret_cast<uint64_t>(&fiber_entry);
  uint64_t* sp = ret - 7;  // control words, r15, r14, r13, r12, rbx, rbp
  for (int i = 1; i < 7; ++i) sp[i] = 0;
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(reinterpret_cast<char*>(sp), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  return sp;
}

void make_ready(Runner& r, Fiber* f) {
  f->state = State::kReady;
  r.ready[f->linear / 32].push_back(f->linear);
  ++r.ready_count;
}

void run_block(Runner& r, uint3 block_idx, dim3 block_dim, dim3 grid_dim) {
  const int n = r.nthreads;
  while (static_cast<int>(r.fibers.size()) < n) make_fiber();
  const int warps = (n + 31) / 32;
  r.ready.assign(warps, {});
  r.ready_count = 0;
  r.barrier_generation = 0;
  for (int& g : r.warp_generation) g = 0;
  r.priority = r.rng() % 2 == 0;
  r.warp_order.resize(warps);
  for (int w = 0; w < warps; ++w) r.warp_order[w] = w;
  std::shuffle(r.warp_order.begin(), r.warp_order.end(), r.rng);
  r.at_barrier = 0;
  r.done = 0;
  for (int i = 0; i < n; ++i) {
    Fiber* f = r.fibers[i].get();
    f->linear = i;
    f->builtins.thread_idx = make_uint3(i % block_dim.x, (i / block_dim.x) % block_dim.y,
                                        i / (block_dim.x * block_dim.y));
    f->builtins.block_idx = block_idx;
    f->builtins.block_dim = block_dim;
    f->builtins.grid_dim = grid_dim;
    f->fake_stack = nullptr;
    f->fenced = false;
    f->atomic_count = 0;
#if defined(DPCUDA_EMU_ASAN)
    // A fiber abandoned by a failure leaves its frames' redzones poisoned.
    ASAN_UNPOISON_MEMORY_REGION(f->stack + 4096, kStackBytes - 4096);
#endif
    f->sp = initial_stack(f->stack);
    make_ready(r, f);
  }
  while (r.ready_count > 0 && !r.failed) {
    std::vector<int>* lanes = nullptr;
    if (r.priority) {
      for (int w : r.warp_order) {
        if (!r.ready[w].empty()) {
          lanes = &r.ready[w];
          break;
        }
      }
    } else {
      do {
        lanes = &r.ready[r.rng() % r.ready.size()];
      } while (lanes->empty());
    }
    const size_t k = static_cast<size_t>(r.rng() % lanes->size());
    const int i = (*lanes)[k];
    (*lanes)[k] = lanes->back();
    lanes->pop_back();
    --r.ready_count;
    switch_to(r, r.fibers[i].get());
  }
  if (r.failed) {
    tsan_acquire(&r.end_sync);  // the message was written by the failing fiber
    report(std::string("kernel ") + r.site + ": " + r.message);
    r.message.clear();
    return;
  }
  if (r.done == n) return;
  // Nobody can run and not everyone finished: the block would hang on a GPU.
  std::ostringstream s;
  int exited = 0, barrier = 0, warp = 0;
  const Fiber* first_barrier = nullptr;
  const Fiber* first_warp = nullptr;
  for (int i = 0; i < n; ++i) {
    const Fiber& f = *r.fibers[i];
    if (f.state == State::kDone) ++exited;
    if (f.state == State::kBarrier && !first_barrier) first_barrier = &f;
    if (f.state == State::kBarrier) ++barrier;
    if (f.state == State::kWarp && !first_warp) first_warp = &f;
    if (f.state == State::kWarp) ++warp;
  }
  s << "kernel " << r.site << ": block (" << block_idx.x << "," << block_idx.y << ","
    << block_idx.z << ") of " << n << " threads cannot go on (it would hang on a GPU): " << barrier
    << " wait at __syncthreads, " << warp << " wait in warp intrinsics, " << exited
    << " have exited";
  if (barrier > 0 && exited > 0) s << "; the threads split between a barrier and an exit";
  if (first_warp) {
    s << "; " << describe(*first_warp) << " waits in " << first_warp->what << " with mask 0x"
      << std::hex << first_warp->mask << std::dec;
    const int base = first_warp->linear - first_warp->linear % 32;
    for (int l = 0; l < 32; ++l) {
      if (!(first_warp->mask >> l & 1u) || base + l >= n) continue;
      const Fiber& g = *r.fibers[base + l];
      if (g.state == State::kWarp && g.mask == first_warp->mask) continue;
      s << "; lane " << l << " of the mask "
        << (g.state == State::kDone      ? "has exited"
            : g.state == State::kBarrier ? "waits at __syncthreads"
                                         : "waits in another warp intrinsic or mask");
      break;
    }
  } else if (first_barrier) {
    s << "; " << describe(*first_barrier) << " waits at __syncthreads";
  }
  r.failed = true;
  report(s.str());
}

}  // namespace

const ThreadBuiltins& builtins() {
  Fiber* f = tl_runner.current;
  if (f == nullptr) {
    std::fprintf(stderr, "dpcuda-emu: threadIdx/blockIdx read outside a kernel\n");
    std::abort();
  }
  return f->builtins;
}

int lane_id() {
  (void)builtins();  // aborts outside a kernel
  return tl_runner.current->linear % 32;
}

// A device atomic and the release that follows it are one step for any other atomic on that
// address (a lock striped by address; this file is not instrumented, so TSan does not see it):
// a thread whose read-modify-write comes later in the address's order acquires after the
// earlier ones' releases, with no window between an access and its release.
std::atomic_flag g_atomic_locks[64];

std::atomic_flag& atomic_lock_of(void* address) {
  return g_atomic_locks[(reinterpret_cast<uintptr_t>(address) >> 2) % 64];
}

void before_atomic(void* address) {
  std::atomic_flag& lock = atomic_lock_of(address);
  while (lock.test_and_set(std::memory_order_acquire)) {
  }
}

void after_atomic(void* address) {
  Fiber* f = tl_runner.current;
  if (f != nullptr) {
    // A release after the read-modify-write: what the thread wrote before its fence, and the
    // atomic access itself, happen before whoever acquires it.
    if (f->fenced) tsan_release(address);
    bool known = false;
    for (int i = 0; i < f->atomic_count; ++i) known = known || f->atomics[i] == address;
    if (!known && f->atomic_count < 8) {
      f->atomics[f->atomic_count++] = address;
    } else if (!known) {
      tsan_acquire(address);  // (more than the list holds: an acquire at once, a stronger order)
    }
  }
  atomic_lock_of(address).clear(std::memory_order_release);
}

void thread_fence() {
  Fiber* f = tl_runner.current;
  if (f == nullptr) return;
  for (int i = 0; i < f->atomic_count; ++i) tsan_acquire(f->atomics[i]);
  f->atomic_count = 0;
  f->fenced = true;
}

int checked_width(int width, const char* what) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    fail(tl_runner, std::string(what) + ": width " + std::to_string(width) +
                        " is not a power of two from 1 to 32");
  }
  return width;
}

void sync_block() {
  Runner& r = tl_runner;
  Fiber* f = r.current;
  if (f == nullptr) {
    std::fprintf(stderr, "dpcuda-emu: __syncthreads called outside a kernel\n");
    std::abort();
  }
  f->generation = r.barrier_generation;
  tsan_release(&r.barrier_sync[f->generation % 2]);
  f->state = State::kBarrier;
  if (++r.at_barrier == r.nthreads) {
    r.at_barrier = 0;
    ++r.barrier_generation;
    for (int i = 0; i < r.nthreads; ++i) {
      if (r.fibers[i]->state == State::kBarrier) make_ready(r, r.fibers[i].get());
    }
  }
  // Always yield: who passes the barrier first is the scheduler's choice.
  switch_to_main(r, f);
  tsan_acquire(&r.barrier_sync[f->generation % 2]);
}

namespace {

// DPCUDA_EMU_REMOVE_BARRIER=PATH:LINE, read once: the barrier call site to skip (none: line 0).
struct RemovedBarrier {
  std::string path;
  int line = 0;
  mutable std::atomic<bool> said{false};  // (said once)
  RemovedBarrier() {
    const char* spec = std::getenv("DPCUDA_EMU_REMOVE_BARRIER");
    if (spec == nullptr || *spec == '\0') return;
    const char* colon = std::strrchr(spec, ':');
    char* end = nullptr;
    const long at = colon != nullptr && colon != spec ? std::strtol(colon + 1, &end, 10) : 0;
    if (at <= 0 || at > INT32_MAX || end == colon + 1 || *end != '\0') {
      std::fprintf(stderr, "dpcuda-emu: DPCUDA_EMU_REMOVE_BARRIER=%s is not PATH:LINE\n", spec);
      std::exit(2);
    }
    line = static_cast<int>(at);
    path.assign(spec, colon);
  }
  // (the call site's file as the compiler named it, or with its ".." resolved: a header found
  // through "../x.h" is named ".../kernels/y/../x.h")
  bool matches(const char* file, int at) const {
    if (at != line) return false;
    char resolved[PATH_MAX];
    for (const char* name : {file, static_cast<const char*>(realpath(file, resolved))}) {
      if (name == nullptr) continue;
      const size_t n = std::strlen(name);
      if (n >= path.size() && std::strcmp(name + n - path.size(), path.c_str()) == 0 &&
          (n == path.size() || name[n - path.size() - 1] == '/')) {
        return true;
      }
    }
    return false;
  }
};

const RemovedBarrier& removed_barrier() {
  static RemovedBarrier removed;
  return removed;
}

// (read, and a bad value refused, as the program starts: not in a worker, mid-kernel)
const bool kRemovedBarrierRead = (removed_barrier(), true);

}  // namespace

void sync_block_at(const char* file, int line) {
  const RemovedBarrier& removed = removed_barrier();
  if (removed.line != 0 && removed.matches(file, line)) {
    if (!removed.said.exchange(true)) {
      std::fprintf(stderr, "dpcuda-emu: the __syncthreads() at %s:%d is removed "
                   "(DPCUDA_EMU_REMOVE_BARRIER)\n", file, line);
    }
    return;
  }
  sync_block();
}

uint64_t warp_exchange(unsigned mask, uint64_t bits, int src, const char* what) {
  Runner& r = tl_runner;
  Fiber* f = r.current;
  if (f == nullptr) {
    std::fprintf(stderr, "dpcuda-emu: %s called outside a kernel\n", what);
    std::abort();
  }
  const int lane = f->linear % 32;
  const int base = f->linear - lane;
  const bool fence = what[0] == '_' && std::strcmp(what, "__syncwarp") == 0;
  auto where = [&] {
    std::ostringstream w;
    w << what << " in " << describe(*f) << " (lane " << lane << ", mask 0x" << std::hex << mask
      << std::dec << ")";
    return w.str();
  };
  if (!(mask >> lane & 1u)) fail(r, where() + ": the calling lane is not in the mask");
  if (base + 32 > r.nthreads) {
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l & 1u) && base + l >= r.nthreads) {
        fail(r, where() + ": the mask names lane " + std::to_string(l) +
                    ", which this block of " + std::to_string(r.nthreads) + " threads lacks");
      }
    }
  }
  if (!fence && src != lane && !(mask >> src & 1u)) {
    fail(r, where() + ": reads lane " + std::to_string(src) + ", which is not in the mask");
  }
  f->state = State::kWarp;
  f->mask = mask;
  f->bits = bits;
  f->src = src;
  f->fence = fence;
  f->what = what;
  const int warp = base / 32;
  f->generation = r.warp_generation[warp];
  if (fence) tsan_release(&r.warp_sync[warp][f->generation % 2]);
  bool complete = true;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Fiber& g = *r.fibers[base + l];
    if (g.state == State::kDone) {
      fail(r, where() + ": lane " + std::to_string(l) + " of the mask has exited");
    }
    if (g.state == State::kWarp && g.mask != mask) {
      fail(r, where() + ": lane " + std::to_string(l) + " waits in " + g.what +
                  " with another mask");
    }
    if (g.state != State::kWarp) complete = false;
  }
  if (complete) {
    ++r.warp_generation[warp];
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber* g = r.fibers[base + l].get();
      g->result = r.fibers[base + g->src]->bits;
      make_ready(r, g);
    }
  }
  switch_to_main(r, f);
  if (fence) tsan_acquire(&r.warp_sync[warp][f->generation % 2]);
  return f->result;
}

namespace {

// One grid being run: its blocks in a random order, handed out one at a time.
struct GridJob {
  const std::function<void()>* body = nullptr;
  const char* site = "";
  dim3 grid, block;
  uint64_t seed = 0;
  std::vector<uint64_t> order;
  size_t next = 0;  // the next block to hand out (under the pool's lock)
  int active = 0;   // workers running this grid's blocks
  bool failed = false;
  std::condition_variable done;
  // What the launch did happens before every block; every block happens before the grid's end.
  char launch_sync = 0, end_sync = 0;
};

// The block workers: threads that join whatever grid has blocks left. Their bookkeeping is
// hidden from TSan (Quiet): the edges are the grid's own.
struct BlockPool {
  std::mutex m;
  std::condition_variable work;
  std::vector<GridJob*> jobs;
};
BlockPool* const g_blocks = new BlockPool;  // never destroyed: its workers run until exit
constexpr int kBlockWorkers = 1;
std::once_flag g_blocks_started;

bool has_blocks(const GridJob& job) { return !job.failed && job.next < job.order.size(); }

// Runs the grid's blocks on this thread until none is left (or one failed).
void serve(GridJob& job) {
  Runner& r = tl_runner;
#if defined(DPCUDA_EMU_TSAN)
  if (r.tsan_main == nullptr) r.tsan_main = __tsan_get_current_fiber();
#endif
  r.body = job.body;
  r.site = job.site;
  r.failed = false;
  r.nthreads = static_cast<int>(job.block.x * job.block.y * job.block.z);
  r.rng.seed(job.seed ^ reinterpret_cast<uintptr_t>(&r));
  tsan_acquire(&job.launch_sync);
  const dim3 grid = job.grid;
  const uint64_t plane = static_cast<uint64_t>(grid.x) * grid.y;
  for (;;) {
    uint64_t b;
    {
      const Quiet quiet;
      const std::lock_guard<std::mutex> lock(g_blocks->m);
      if (!has_blocks(job)) break;
      b = job.order[job.next++];
    }
    // Blocks on one worker reuse its shared memory one after another: everything an earlier
    // block did happens before the next block's threads start.
    tsan_acquire(&r.end_sync);
    tsan_release(&r.launch_sync);
    const uint3 idx = make_uint3(static_cast<unsigned>(b % grid.x),
                                 static_cast<unsigned>(b / grid.x % grid.y),
                                 static_cast<unsigned>(b / plane));
    run_block(r, idx, job.block, grid);
    if (r.failed) {
      const Quiet quiet;
      const std::lock_guard<std::mutex> lock(g_blocks->m);
      job.failed = true;
      break;
    }
  }
  tsan_acquire(&r.end_sync);
  tsan_release(&job.end_sync);
  r.body = nullptr;
}

void block_worker() {
  for (;;) {
    GridJob* job = nullptr;
    {
      const Quiet quiet;
      std::unique_lock<std::mutex> lock(g_blocks->m);
      g_blocks->work.wait(lock, [&] {
        for (GridJob* j : g_blocks->jobs) {
          if (has_blocks(*j)) {
            job = j;
            return true;
          }
        }
        return false;
      });
      ++job->active;
    }
    serve(*job);
    {
      const Quiet quiet;
      const std::lock_guard<std::mutex> lock(g_blocks->m);
      if (--job->active == 0) job->done.notify_all();
    }
  }
}

}  // namespace

bool run_grid(dim3 grid, dim3 block, const std::function<void()>& body, const char* site,
              uint64_t seed) {
  GridJob job;
  job.body = &body;
  job.site = site;
  job.grid = grid;
  job.block = block;
  job.seed = seed;
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  // A random order: a kernel must not depend on which block runs first.
  std::mt19937_64 rng(seed);
  job.order.resize(blocks);
  for (uint64_t b = 0; b < blocks; ++b) job.order[b] = b;
  std::shuffle(job.order.begin(), job.order.end(), rng);
  tsan_release(&job.launch_sync);
  if (blocks > 1) {
    std::call_once(g_blocks_started, [] {
      const Quiet quiet;
      for (int i = 0; i < kBlockWorkers; ++i) std::thread(block_worker).detach();
    });
    const Quiet quiet;
    const std::lock_guard<std::mutex> lock(g_blocks->m);
    job.active = 1;  // this thread
    g_blocks->jobs.push_back(&job);
    g_blocks->work.notify_all();
  } else {
    job.active = 1;
  }
  serve(job);
  if (blocks > 1) {
    const Quiet quiet;
    std::unique_lock<std::mutex> lock(g_blocks->m);
    g_blocks->jobs.erase(std::find(g_blocks->jobs.begin(), g_blocks->jobs.end(), &job));
    --job.active;
    job.done.wait(lock, [&] { return job.active == 0; });
  }
  // The kernel's writes happen before whatever the stream does next.
  tsan_acquire(&job.end_sync);
  return !job.failed;
}

}  // namespace emu
}  // namespace dpcuda
