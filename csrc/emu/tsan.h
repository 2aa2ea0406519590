// How the emulator talks to ThreadSanitizer (DPCUDA_EMU_TSAN, the -DDPCUDA_SANITIZE=thread
// build). TSan must see exactly the happens-before edges that CUDA guarantees, and no others:
//   - the emulator's own bookkeeping (queues, maps, mutexes, condition variables, reports) is
//     hidden from it (Quiet), since its locks would order streams that CUDA leaves unordered;
//   - the edges CUDA gives are annotated where they happen: enqueue (host to stream), stream
//     completion (stream to a synchronising host), event record to stream wait, launch to the
//     block's threads, barrier to barrier, block to the end of the grid.
// Both files of the emulator are built without TSan instrumentation; kernels, tests and the
// copies that streams make (intercepted memcpy) are what TSan checks.
#pragma once

#if defined(DPCUDA_EMU_TSAN)
extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif

namespace dpcuda {
namespace emu {

// Everything the calling thread does while one is alive is invisible to TSan.
struct Quiet {
  Quiet() {
#if defined(DPCUDA_EMU_TSAN)
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
#endif
  }
  ~Quiet() {
#if defined(DPCUDA_EMU_TSAN)
    AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;
};

// A happens-before edge: everything before release(addr) happens before anything after a later
// acquire(addr). Never called inside a Quiet region (TSan would ignore it there).
inline void tsan_release(void* addr) {
#if defined(DPCUDA_EMU_TSAN)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}

inline void tsan_acquire(void* addr) {
#if defined(DPCUDA_EMU_TSAN)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

}  // namespace emu
}  // namespace dpcuda
