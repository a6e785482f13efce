// All-reduce (sum) and all-gather of fp32 tensors between tensor-parallel ranks on one machine, through a
// shared-memory segment every rank maps (model/tensor_parallel.py creates it).
//
// Why: over gloo each collective cost ~1.5 ms on loopback TCP, and a decode step makes two per layer: on a
// 1B model that was most of the step. Here a collective is a copy into the rank's slot, one barrier on
// counters in the same segment, and a read of every slot: microseconds. And the native decode step
// (decode_step.cpp) calls it between its products, so a rank's whole step stays one C++ call.
//
// Layout: a header of kMaxRanks cache lines (per rank: its generation counter, its pid), then per rank two
// slots of `slot_floats` floats. A collective of generation g writes the rank's slot g % 2, publishes g, waits
// for every rank's g, then reads the slots. Two slots suffice: a rank writes slot g % 2 only after every rank
// has published g - 1, which each does after it finished reading generation g - 2 (the same slot). Tensors
// larger than a slot go through in slot-sized chunks, a generation each. Every rank sums the slots in rank
// order, so all ranks hold the same bits.

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>
#include <torch/library.h>

#include <chrono>
#include <fstream>
#include <string>

#include "kernels.h"

namespace minivllm_native {

namespace {

constexpr int64_t kMaxRanks = 64;
constexpr int64_t kLineInts = 8;  // one 64-byte line per rank: [generation, pid, unused...]
constexpr int64_t kHeaderBytes = kMaxRanks * kLineInts * 8;
constexpr double kTimeoutSeconds = 600.0;  // a peer that is alive but this late is stuck: the step fails

struct Segment {
  int64_t* header;
  float* slots;
  int64_t slot_floats, rank, world;

  int64_t* generation(int64_t r) const { return header + r * kLineInts; }
  int64_t pid(int64_t r) const { return header[r * kLineInts + 1]; }
  float* slot(int64_t r, int64_t generation) const { return slots + (2 * r + (generation & 1)) * slot_floats; }
};

Segment segment(const at::Tensor& shm, int64_t rank, int64_t world) {
  TORCH_CHECK(shm.scalar_type() == at::kByte && shm.is_contiguous() && shm.dim() == 1,
              "the shared segment must be a contiguous uint8 tensor, got ", shm.sizes(), " ", shm.scalar_type());
  TORCH_CHECK(world >= 1 && world <= kMaxRanks && rank >= 0 && rank < world, "rank ", rank, " outside the ", world,
              " ranks (at most ", kMaxRanks, ")");
  const int64_t slot_floats = (shm.numel() - kHeaderBytes) / (2 * world * 4);
  TORCH_CHECK(slot_floats >= 16, "the shared segment of ", shm.numel(), " bytes has no room for ", world, " ranks");
  auto* base = shm.data_ptr<uint8_t>();
  return {reinterpret_cast<int64_t*>(base), reinterpret_cast<float*>(base + kHeaderBytes), slot_floats, rank, world};
}

// Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet); 0: a rank that has not
// mapped the segment yet, still starting.
bool process_ended(int64_t pid) {
  if (pid == 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z' || line[close + 2] == 'X';
}

// Waits until rank `r` has published generation `g`: spins briefly (the peer is usually microseconds
// away), then yields the core (fewer cores than busy threads), checking now and then that the peer lives.
void wait_for(const Segment& s, int64_t r, int64_t g) {
  const int64_t* counter = s.generation(r);
  int64_t spins = 0;
  const auto start = std::chrono::steady_clock::now();
  while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < g) {
    if (++spins < 4096) {
      _mm_pause();
      continue;
    }
    sched_yield();
    if (spins % 65536) continue;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    TORCH_CHECK(!process_ended(s.pid(r)), "tensor parallelism: rank ", r, " (pid ", s.pid(r),
                ") has exited; rank ", s.rank, " cannot finish the collective");
    TORCH_CHECK(waited < kTimeoutSeconds, "tensor parallelism: rank ", r, " has not reached the collective in ",
                kTimeoutSeconds, " s");
  }
}

// One generation: `n` floats of `src` into this rank's slot, published, every rank's awaited; then `read`
// with the generation's number (the slots to read).
template <typename Read>
void exchange(const Segment& s, const float* src, int64_t n, Read read) {
  const int64_t g = *s.generation(s.rank) + 1;  // only this rank writes its counter
  std::memcpy(s.slot(s.rank, g), src, n * sizeof(float));
  __atomic_store_n(s.generation(s.rank), g, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < s.world; ++r)
    if (r != s.rank) wait_for(s, r, g);
  read(g);
}

void check_floats(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              " takes a contiguous fp32 CPU tensor, got ", x.sizes(), " ", x.scalar_type(), " on ", x.device());
}

void shm_all_reduce_op(at::Tensor x, const at::Tensor& shm, int64_t rank, int64_t world) {
  check_floats(x, "shm_all_reduce_");
  shm_all_reduce_into(x.data_ptr<float>(), x.numel(), shm, rank, world);
}

// x [...] on every rank -> [world, ...]: rank r's x at index r.
at::Tensor shm_all_gather(const at::Tensor& x, const at::Tensor& shm, int64_t rank, int64_t world) {
  check_floats(x, "shm_all_gather");
  const Segment s = segment(shm, rank, world);
  std::vector<int64_t> shape{world};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, x.options());
  const int64_t n = x.numel();
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t start = 0; start < n; start += s.slot_floats) {
    const int64_t len = std::min(s.slot_floats, n - start);
    exchange(s, src + start, len, [&](int64_t g) {
      for (int64_t r = 0; r < world; ++r) std::memcpy(dst + r * n + start, s.slot(r, g), len * sizeof(float));
    });
  }
  return out;
}

// The segment's size for `world` ranks with slots of `slot_bytes` (model/tensor_parallel.py creates the file).
int64_t shm_segment_bytes(int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 1 && world <= kMaxRanks && slot_bytes >= 64, "no segment for ", world, " ranks of ",
              slot_bytes, "-byte slots");
  return kHeaderBytes + 2 * world * slot_bytes;
}

// This rank, having mapped the segment, writes its pid in its header line: a waiting peer checks that it lives.
void shm_join(const at::Tensor& shm, int64_t rank, int64_t world) {
  const Segment s = segment(shm, rank, world);
  __atomic_store_n(s.header + rank * kLineInts + 1, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
}

}  // namespace

void shm_all_reduce_into(float* data, int64_t n, const at::Tensor& shm, int64_t rank, int64_t world) {
  const Segment s = segment(shm, rank, world);
  for (int64_t start = 0; start < n; start += s.slot_floats) {
    const int64_t len = std::min(s.slot_floats, n - start);
    float* chunk = data + start;
    exchange(s, chunk, len, [&](int64_t g) {
      const float* first = s.slot(0, g);
      for (int64_t i = 0; i < len; ++i) chunk[i] = first[i];
      for (int64_t r = 1; r < world; ++r) {
        const float* part = s.slot(r, g);
        for (int64_t i = 0; i < len; ++i) chunk[i] += part[i];
      }
    });
  }
}

}  // namespace minivllm_native

TORCH_LIBRARY_FRAGMENT(minivllm_native, m) {
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor shm, int rank, int world) -> ()");
  m.def("shm_all_gather(Tensor x, Tensor shm, int rank, int world) -> Tensor");
  m.def("shm_segment_bytes(int world, int slot_bytes) -> int", &minivllm_native::shm_segment_bytes);
  m.def("shm_join(Tensor shm, int rank, int world) -> ()", &minivllm_native::shm_join);
}

TORCH_LIBRARY_IMPL(minivllm_native, CPU, m) {
  m.impl("shm_all_reduce_", &minivllm_native::shm_all_reduce_op);
  m.impl("shm_all_gather", &minivllm_native::shm_all_gather);
}
