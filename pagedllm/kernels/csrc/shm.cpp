// Collectives of the tensor-parallel ranks of one machine, over a shared-memory segment (pagedllm.distributed.
// communicator): a rank copies its part into its slot, raises its flag to the round's number, waits until every
// rank's flag reaches it, and reads the others' slots. No system call on the way, so a round takes microseconds where
// gloo's TCP round trips over loopback take about a millisecond.
//
// Segment layout: one 64-byte line per rank holding {flag, pid}, then two sets of `world` slots of `slot_bytes`
// each. Round `seq` uses set seq % 2: a rank starts round seq only once every rank has raised its flag to seq - 1,
// that is, has finished reading round seq - 2's set, which round seq overwrites. A tensor larger than a slot goes in
// several rounds.
#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PAGEDLLM_PAUSE() asm volatile("yield")
#else
#define PAGEDLLM_PAUSE()
#endif

namespace pagedllm {
namespace {

constexpr int64_t kLineBytes = 64;
constexpr int kSpinsBeforeYield = 2048;
constexpr int kYieldsBetweenChecks = 4096;

struct Segment {
  uint8_t* base;
  int64_t world;
  int64_t slot_bytes;

  Segment(const at::Tensor& segment, int64_t world_size) : base(segment.data_ptr<uint8_t>()), world(world_size) {
    TORCH_CHECK(segment.is_contiguous() && segment.scalar_type() == at::kByte, "segment: a contiguous uint8 tensor");
    slot_bytes = (segment.numel() - world * kLineBytes) / (2 * world) / kLineBytes * kLineBytes;
    TORCH_CHECK(slot_bytes > 0, "segment: too small for ", world, " ranks");
  }
  int64_t* flag(int64_t rank) const { return reinterpret_cast<int64_t*>(base + rank * kLineBytes); }
  int64_t* pid(int64_t rank) const { return flag(rank) + 1; }
  uint8_t* slot(int64_t seq, int64_t rank) const {
    return base + world * kLineBytes + ((seq & 1) * world + rank) * slot_bytes;
  }
};

// Whether process `pid` runs: it exists and is not a zombie (a killed child stays one until its parent reaps it).
bool process_runs(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return true;  // no /proc here: existing is all we can tell
  char state = '?';
  int matched = std::fscanf(file, "%*d (%*[^)]) %c", &state);
  std::fclose(file);
  return matched != 1 || state != 'Z';
}

// Wait until every rank's flag reaches `seq`: spin, then yield; between stretches of yields check that the rank
// waited for still runs, and give up after `timeout_s` (a rank that failed before the collective never comes).
void wait_for_all(const Segment& seg, int64_t seq, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t rank = 0; rank < seg.world; ++rank) {
    int64_t spins = 0;
    while (__atomic_load_n(seg.flag(rank), __ATOMIC_ACQUIRE) < seq) {
      if (++spins < kSpinsBeforeYield) {
        PAGEDLLM_PAUSE();
        continue;
      }
      sched_yield();
      if (spins % kYieldsBetweenChecks != 0) continue;
      const int64_t pid = __atomic_load_n(seg.pid(rank), __ATOMIC_ACQUIRE);
      if (!process_runs(pid)) {
        throw std::runtime_error("tensor-parallel rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
                                 ") died");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("tensor-parallel rank " + std::to_string(rank) + " did not join a collective in " +
                                 std::to_string(timeout_s) + " s");
      }
    }
  }
}

// out[first + i] = slot 0's [i] + slot 1's [i] + ... in float32, in rank order on every rank (the same bits
// everywhere), rounded once to T; in tiles, so that the inner loops run over elements and vectorise.
template <typename T>
void sum_into(T* out, const Segment& seg, int64_t seq, int64_t first, int64_t count) {
  constexpr int64_t kTile = 1024;
  float acc[kTile];
  for (int64_t start = 0; start < count; start += kTile) {
    const int64_t n = std::min(kTile, count - start);
    const T* part = reinterpret_cast<const T*>(seg.slot(seq, 0)) + start;
    for (int64_t i = 0; i < n; ++i) acc[i] = to_float(part[i]);
    for (int64_t rank = 1; rank < seg.world; ++rank) {
      part = reinterpret_cast<const T*>(seg.slot(seq, rank)) + start;
      for (int64_t i = 0; i < n; ++i) acc[i] += to_float(part[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[first + start + i] = from_float<T>(acc[i]);
  }
}

}  // namespace

void shm_register(at::Tensor segment, int64_t rank, int64_t world, int64_t pid) {
  Segment seg(segment, world);
  __atomic_store_n(seg.pid(rank), pid, __ATOMIC_RELEASE);
}

int64_t shm_all_reduce(at::Tensor segment, at::Tensor x, int64_t rank, int64_t world, int64_t seq,
                       double timeout_s) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: a contiguous float32 or bfloat16 tensor");
  Segment seg(segment, world);
  const int64_t itemsize = x.element_size(), per_round = seg.slot_bytes / itemsize, numel = x.numel();
  for (int64_t first = 0; first < numel; first += per_round) {
    const int64_t count = std::min(per_round, numel - first);
    ++seq;
    std::memcpy(seg.slot(seq, rank), static_cast<uint8_t*>(x.data_ptr()) + first * itemsize, count * itemsize);
    __atomic_store_n(seg.flag(rank), seq, __ATOMIC_RELEASE);
    wait_for_all(seg, seq, timeout_s);
    if (x.scalar_type() == at::kFloat) {
      sum_into(x.data_ptr<float>(), seg, seq, first, count);
    } else {
      sum_into(x.data_ptr<at::BFloat16>(), seg, seq, first, count);
    }
  }
  return seq;
}

int64_t shm_gather(at::Tensor segment, at::Tensor x, c10::optional<at::Tensor> out, int64_t rank, int64_t world,
                   int64_t seq, double timeout_s) {
  TORCH_CHECK(x.is_contiguous(), "x: a contiguous tensor");
  Segment seg(segment, world);
  const int64_t numel_bytes = x.numel() * x.element_size();
  uint8_t* gathered = nullptr;
  if (out.has_value()) {
    TORCH_CHECK(out->is_contiguous() && out->scalar_type() == x.scalar_type() && out->numel() == world * x.numel(),
                "out: contiguous, x's dtype, world x x's elements");
    gathered = static_cast<uint8_t*>(out->data_ptr());
  }
  for (int64_t first = 0; first < numel_bytes; first += seg.slot_bytes) {
    const int64_t count = std::min(seg.slot_bytes, numel_bytes - first);
    ++seq;
    std::memcpy(seg.slot(seq, rank), static_cast<uint8_t*>(x.data_ptr()) + first, count);
    __atomic_store_n(seg.flag(rank), seq, __ATOMIC_RELEASE);
    wait_for_all(seg, seq, timeout_s);
    if (gathered != nullptr) {
      for (int64_t r = 0; r < world; ++r) std::memcpy(gathered + r * numel_bytes + first, seg.slot(seq, r), count);
    }
  }
  return seq;
}

}  // namespace pagedllm
