// The host CPU's kernel for gated bf16 experts on cpu, bf16 or block-scaled FP8 weights, with its own threads and
// no Python: native.py's loader binds it with ctypes, and a captured decode step calls `offplan_run` as a CUDA
// host node.
//
// A job is one experts module's forward of T tokens (engine.py): for each (token, expert) pair p whose expert
// is on cpu, y[p] = down[e] @ (silu(gate_up[e][:I] @ x[t]) * gate_up[e][I:] @ x[t]), t = p / k, e = ids[p].
// Rounding is batched_mm's: each projection summed in fp32 and rounded to bf16, the gate rounded after silu
// and after the product. The sums run in another order than cuBLAS's: a value may differ by a unit in its last
// place.
//
// FP8 weights (format 1: E4M3 bytes, one f32 scale per block_rows x block_cols block, as quant.py stores them)
// are converted row by row as they are read: each byte to f32 exactly, times its block's scale (one f32
// multiply), rounded to bf16 (to nearest even): dequant.py's value, bitwise. The row is then dotted with the
// activations as a bf16 row is, in the same order, so the outputs are the bf16 kernel's on the dequantized
// experts, bitwise. Each row looks its scales up by its own index, so a chunk may straddle a block of rows.
//
// How the work is split: the pairs are grouped by expert, so that each weight row is read once from host
// memory and dotted with every token routed to its expert. Phase 1 deals the rows of the gate and up halves out
// in chunks (a chunk: the same rows of both halves, so its thread gates them at once, into h [P, I]); a
// barrier; phase 2 deals the rows of down. Chunks go to whichever thread takes the next (one atomic counter per
// phase), the calling thread working too.
//
// Threads: a pool of n - 1 workers plus the caller. Between jobs a worker spins for `spin_us` (a decode step's
// layers come well within that), then sleeps on a futex until the next job. The dot products use AVX512-BF16
// where the CPU has it, else AVX2 + FMA, else plain C (`offplan_pool_isa` reads and forces the choice). FP8 rows:
// AVX512-BF16 converts 32 bytes at a time in registers; AVX2 and plain C convert a row into a bf16 scratch row in
// plain C, then run their own bf16 dot product over it.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define API __attribute__((visibility("default")))  // the library's interface; the rest is hidden

namespace {

using Clock = std::chrono::steady_clock;

inline float from_bf16(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// out[j] = sum_i w[i] * xs[j][i] over n values, for m vectors xs (m <= 4), each in fp32.
using DotFn = void (*)(const uint16_t* w, const uint16_t* const* xs, int m, int64_t n, float* out);

void dot_plain(const uint16_t* w, const uint16_t* const* xs, int m, int64_t n, float* out) {
  for (int j = 0; j < m; ++j) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) acc[l] += from_bf16(w[i + l]) * from_bf16(xs[j][i + l]);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += from_bf16(w[i]) * from_bf16(xs[j][i]);
    out[j] = s;
  }
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

__attribute__((target("avx2,fma"))) void dot_avx2(const uint16_t* w, const uint16_t* const* xs, int m, int64_t n,
                                                  float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wv = load8(w + i);
    for (int j = 0; j < m; ++j) acc[j] = _mm256_fmadd_ps(wv, load8(xs[j] + i), acc[j]);
  }
  for (int j = 0; j < m; ++j) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[j]);
    float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (int64_t t = i; t < n; ++t) s += from_bf16(w[t]) * from_bf16(xs[j][t]);
    out[j] = s;
  }
}

// The 16 lanes of an accumulator summed in lane order: the one order of dot_bf16 and dot_fp8_bf16, whose sums
// must agree bit for bit.
__attribute__((target("avx512f"))) inline float sum16(__m512 acc) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float s = 0;
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot_bf16(const uint16_t* w, const uint16_t* const* xs,
                                                                      int m, int64_t n, float* out) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
    for (int j = 0; j < m; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], wv, (__m512bh)_mm512_loadu_si512(xs[j] + i));
  }
  for (int j = 0; j < m; ++j) {
    float s = sum16(acc[j]);
    for (int64_t t = i; t < n; ++t) s += from_bf16(w[t]) * from_bf16(xs[j][t]);
    out[j] = s;
  }
}

enum Isa : int { PLAIN = 0, AVX2 = 1, AVX512_BF16 = 2 };

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")) return AVX512_BF16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return PLAIN;
}

DotFn dot_for(int isa) { return isa == AVX512_BF16 ? dot_bf16 : isa == AVX2 ? dot_avx2 : dot_plain; }

// ---------------------------------------------------------------- FP8 E4M3 rows

constexpr float TWO_120 = 0x1p120f;  // E4M3's bias (7) below f32's (127)

// An E4M3 byte (the "fn" variant: no infinities, 0x7f and 0xff NaN) as f32, exactly: its exponent and mantissa
// bits placed at f32's, read as a float (a subnormal one where the exponent is 0, which comes out right) and
// scaled by 2^120, the sign carried through.
inline float from_fp8(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return std::nanf("");
  uint32_t u = (uint32_t(b & 0x7f) << 20) | (uint32_t(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &u, 4);
  return f * TWO_120;
}

// row[c] = bf16(fp8[c] * scales[c / b1]) over n values: dequant.py's formula, block of columns by block.
void fp8_row(const uint8_t* w, const float* scales, int64_t b1, int64_t n, uint16_t* row) {
  for (int64_t c0 = 0, blk = 0; c0 < n; c0 += b1, ++blk) {
    const float s = scales[blk];
    for (int64_t c = c0, end = std::min(n, c0 + b1); c < end; ++c) row[c] = to_bf16(from_fp8(w[c]) * s);
  }
}

// DotFn over an FP8 row w with its row of block scales (one per b1 columns); `row` [n] is scratch.
using Fp8DotFn = void (*)(const uint8_t* w, const float* scales, int64_t b1, uint16_t* row,
                          const uint16_t* const* xs, int m, int64_t n, float* out);

template <DotFn dot>
void dot_fp8_converted(const uint8_t* w, const float* scales, int64_t b1, uint16_t* row, const uint16_t* const* xs,
                       int m, int64_t n, float* out) {  // plain C's conversion, then the bf16 dot product
  fp8_row(w, scales, b1, n, row);
  dot(row, xs, m, n, out);
}

// 16 E4M3 bytes as f32 times `scale`, as from_fp8 and fp8_row do (the NaN codes made NaN before the multiplies).
// (The maskz forms with every lane set: GCC 12 warns of the plain forms' undefined source inlined here.)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512 fp8x16(__m128i bytes, __m512 scale) {
  const __mmask16 all = 0xffff;
  __m512i b = _mm512_maskz_cvtepu8_epi32(all, bytes);
  __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  __m512i bits = _mm512_or_si512(_mm512_maskz_slli_epi32(all, mag, 20),
                                 _mm512_maskz_slli_epi32(all, _mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)),
                               _mm512_set1_epi32(0x7fc00000));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(TWO_120)), scale);
}

// dot_bf16 over an FP8 row converted in registers, 32 values at a time: the same bf16 values (vcvtne2ps2bf16
// rounds to nearest even; it flushes subnormals, which vdpbf16ps would read as zero anyway), summed in the same
// order. A block narrower than 32 columns, or not a multiple of them, goes through the scratch row.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot_fp8_bf16(const uint8_t* w, const float* scales,
                                                                          int64_t b1, uint16_t* row,
                                                                          const uint16_t* const* xs, int m,
                                                                          int64_t n, float* out) {
  if (b1 % 32) return dot_fp8_converted<dot_bf16>(w, scales, b1, row, xs, m, n, out);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0, blk = 0, edge = b1;
  __m512 scale = _mm512_set1_ps(scales[0]);
  for (; i + 32 <= n; i += 32) {
    if (i == edge) scale = _mm512_set1_ps(scales[++blk]), edge += b1;  // 32 divides b1: i meets each edge
    __m512 lo = fp8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)), scale);
    __m512 hi = fp8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16)), scale);
    __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);  // the low 16 values from its second operand
    for (int j = 0; j < m; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], wv, (__m512bh)_mm512_loadu_si512(xs[j] + i));
  }
  for (int j = 0; j < m; ++j) {
    float s = sum16(acc[j]);
    for (int64_t t = i; t < n; ++t) s += from_bf16(to_bf16(from_fp8(w[t]) * scales[t / b1])) * from_bf16(xs[j][t]);
    out[j] = s;
  }
}

// AVX2 converts in plain C (fp8_row) and runs its own FMA dot product over the scratch row.
Fp8DotFn fp8_dot_for(int isa) {
  return isa == AVX512_BF16 ? dot_fp8_bf16 : isa == AVX2 ? dot_fp8_converted<dot_avx2> : dot_fp8_converted<dot_plain>;
}

}  // namespace

extern "C" {

// One experts module's call, shared with native.py (ctypes.Structure `Job`, same fields in the same order).
struct Job {
  const uint16_t* x;           // [T, H] bf16: the tokens
  const int64_t* ids;          // [T * k]: each pair's expert
  uint16_t* y;                 // [T * k, H] bf16: written at the pairs whose expert is on cpu, the rest untouched
  const void* gate_up;         // [E, 2I, H] bf16, or FP8 E4M3 bytes (format 1)
  const void* down;            // [E, H, I] likewise
  const float* gate_up_scale;  // format 1: [E, ceil(2I / b0), ceil(H / b1)] f32, b = (block_rows, block_cols)
  const float* down_scale;     // format 1: [E, ceil(H / b0), ceil(I / b1)] f32
  const uint8_t* on_cpu;       // [E]: 1 where the host computes the expert
  void* pool;
  int64_t tokens, top_k, hidden, inter, experts;
  int64_t format;                  // 0: bf16 weights; 1: block-scaled FP8 E4M3
  int64_t block_rows, block_cols;  // format 1: the elements a scale covers
  int64_t calls, nanos;     // out: calls done and their time in the calling thread
  int64_t error, bad;       // out: error 1 where a pair's expert id was not one (the first: bad); y is NaN
};

}  // extern "C"

namespace {

struct Group {  // one expert's pairs in a call
  int64_t expert;
  int first, count;  // into Task::pairs
};

struct Task {
  const Job* job = nullptr;
  std::vector<Group> groups;
  std::vector<int> pairs;       // pair indices, grouped by expert
  std::vector<uint16_t> h;      // [pairs, I] bf16: gated, indexed by a pair's position in `pairs`
  int64_t chunks1 = 0, chunks2 = 0;
  std::atomic<int64_t> next1{0}, next2{0};
};

constexpr int64_t ROWS1 = 16;  // gate rows (and as many up rows) a phase-1 chunk
constexpr int64_t ROWS2 = 32;  // down rows a phase-2 chunk

// One fused parameter of a job: `rows` x `cols` per expert, bf16 or FP8 with its block scales (Job).
struct Matrix {
  const void* data;
  const float* scale;  // null for bf16
  int64_t rows, cols, b0, b1, scale_rows, scale_cols;

  Matrix(const void* d, const float* s, int64_t r, int64_t c, const Job& j)
      : data(d), scale(j.format == 1 ? s : nullptr), rows(r), cols(c), b0(j.block_rows), b1(j.block_cols),
        scale_rows(scale ? (r + b0 - 1) / b0 : 0), scale_cols(scale ? (c + b1 - 1) / b1 : 0) {}

  // out[q] = expert e's row r . xs[q], q < m; `row` [cols]: an FP8 row's scratch
  void dot(int64_t e, int64_t r, const uint16_t* const* xs, int m, float* out, DotFn bf16, Fp8DotFn fp8,
           uint16_t* row) const {
    if (!scale) return bf16(static_cast<const uint16_t*>(data) + (e * rows + r) * cols, xs, m, cols, out);
    fp8(static_cast<const uint8_t*>(data) + (e * rows + r) * cols, scale + (e * scale_rows + r / b0) * scale_cols,
        b1, row, xs, m, cols, out);
  }
};

struct Pool {
  int threads = 1;
  int isa = PLAIN;
  int64_t spin_ns = 0;
  std::vector<std::thread> workers;
  std::atomic<uint32_t> generation{0};
  std::atomic<int> arrived{0};   // phase barrier
  std::atomic<int> finished{0};  // workers done with the generation's task
  std::atomic<bool> stopping{false};
  std::mutex busy;  // one job at a time: a replay's host node and an eager call on another thread take turns
  Task task;

  void barrier(int phase_target) {  // all threads meet: `arrived` counts up to threads * phase
    arrived.fetch_add(1, std::memory_order_acq_rel);
    while (arrived.load(std::memory_order_acquire) < phase_target) _mm_pause();
  }

  void work() {
    Task& t = task;
    const Job& j = *t.job;
    DotFn dot = dot_for(isa);
    Fp8DotFn dot8 = fp8_dot_for(isa);
    const int64_t H = j.hidden, I = j.inter;
    const Matrix gate_up(j.gate_up, j.gate_up_scale, 2 * I, H, j), down(j.down, j.down_scale, H, I, j);
    thread_local std::vector<uint16_t> row;  // an FP8 row, converted
    row.resize(std::max(H, I));
    const uint16_t* xs[4];
    float a[4], b[4];
    for (int64_t c; (c = t.next1.fetch_add(1, std::memory_order_relaxed)) < t.chunks1;) {
      const Group& g = t.groups[c / ((I + ROWS1 - 1) / ROWS1)];
      int64_t r0 = (c % ((I + ROWS1 - 1) / ROWS1)) * ROWS1, r1 = std::min(r0 + ROWS1, I);
      for (int q0 = 0; q0 < g.count; q0 += 4) {
        int m = std::min(4, g.count - q0);
        for (int q = 0; q < m; ++q) xs[q] = j.x + (t.pairs[g.first + q0 + q] / j.top_k) * H;
        for (int64_t r = r0; r < r1; ++r) {
          gate_up.dot(g.expert, r, xs, m, a, dot, dot8, row.data());      // gate
          gate_up.dot(g.expert, I + r, xs, m, b, dot, dot8, row.data());  // up
          for (int q = 0; q < m; ++q) {
            float gate = from_bf16(to_bf16(a[q]));
            float act = from_bf16(to_bf16(gate / (1.0f + std::exp(-gate))));
            t.h[int64_t(g.first + q0 + q) * I + r] = to_bf16(act * from_bf16(to_bf16(b[q])));
          }
        }
      }
    }
    barrier(threads);
    for (int64_t c; (c = t.next2.fetch_add(1, std::memory_order_relaxed)) < t.chunks2;) {
      const Group& g = t.groups[c / ((H + ROWS2 - 1) / ROWS2)];
      int64_t r0 = (c % ((H + ROWS2 - 1) / ROWS2)) * ROWS2, r1 = std::min(r0 + ROWS2, H);
      for (int q0 = 0; q0 < g.count; q0 += 4) {
        int m = std::min(4, g.count - q0);
        for (int q = 0; q < m; ++q) xs[q] = t.h.data() + int64_t(g.first + q0 + q) * I;
        for (int64_t r = r0; r < r1; ++r) {
          down.dot(g.expert, r, xs, m, a, dot, dot8, row.data());
          for (int q = 0; q < m; ++q) j.y[t.pairs[g.first + q0 + q] * H + r] = to_bf16(a[q]);
        }
      }
    }
  }

  void serve() {
    uint32_t seen = 0;
    for (;;) {
      auto spun = Clock::now();
      uint32_t now;
      while ((now = generation.load(std::memory_order_acquire)) == seen) {
        if (stopping.load(std::memory_order_relaxed)) return;
        if (Clock::now() - spun > std::chrono::nanoseconds(spin_ns)) {
          generation.wait(seen, std::memory_order_acquire);  // futex: until the next job (or stop)
        } else {
          _mm_pause();
        }
      }
      seen = now;
      if (stopping.load(std::memory_order_acquire)) return;
      work();
      finished.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void run(const Job& j) {  // on the calling thread: plan the task, wake the workers, work, wait for them
    std::lock_guard<std::mutex> hold(busy);
    Task& t = task;
    t.job = &j;
    t.groups.clear();
    t.pairs.clear();
    const int64_t P = j.tokens * j.top_k;
    for (int64_t e = 0, first = 0; e < j.experts; ++e) {  // pairs grouped by expert, in expert order
      if (!j.on_cpu[e]) continue;
      for (int64_t p = 0; p < P; ++p)
        if (j.ids[p] == e) t.pairs.push_back(int(p));
      if (int64_t(t.pairs.size()) > first) t.groups.push_back({e, int(first), int(t.pairs.size() - first)});
      first = int64_t(t.pairs.size());
    }
    if (t.pairs.empty()) return;
    t.h.resize(t.pairs.size() * j.inter);
    t.chunks1 = int64_t(t.groups.size()) * ((j.inter + ROWS1 - 1) / ROWS1);
    t.chunks2 = int64_t(t.groups.size()) * ((j.hidden + ROWS2 - 1) / ROWS2);
    t.next1.store(0, std::memory_order_relaxed);
    t.next2.store(0, std::memory_order_relaxed);
    arrived.store(0, std::memory_order_relaxed);
    finished.store(0, std::memory_order_relaxed);
    if (threads > 1) {
      generation.fetch_add(1, std::memory_order_acq_rel);
      generation.notify_all();
    }
    work();
    while (finished.load(std::memory_order_acquire) < threads - 1) _mm_pause();
  }
};

}  // namespace

extern "C" {

API void* offplan_pool_new(int threads, int64_t spin_us) {
  Pool* pool = new Pool;
  pool->threads = threads < 1 ? 1 : threads;
  pool->isa = best_isa();
  pool->spin_ns = spin_us * 1000;
  for (int i = 1; i < pool->threads; ++i) pool->workers.emplace_back([pool] { pool->serve(); });
  return pool;
}

// The dot product's instruction set: `force` >= 0 sets it (0 plain C, 1 AVX2 + FMA, 2 AVX512-BF16; one the CPU
// lacks is refused), -1 reads it. Returns the set in use, or -1 for a refused one.
API int offplan_pool_isa(void* handle, int force) {
  Pool* pool = static_cast<Pool*>(handle);
  if (force >= 0) {
    if (force > best_isa()) return -1;
    pool->isa = force;
  }
  return pool->isa;
}

API void offplan_pool_free(void* handle) {
  Pool* pool = static_cast<Pool*>(handle);
  pool->stopping.store(true, std::memory_order_release);
  pool->generation.fetch_add(1, std::memory_order_acq_rel);
  pool->generation.notify_all();
  for (auto& w : pool->workers) w.join();
  delete pool;
}

// A job, by the calling thread and the pool's workers (a CUDA host function's signature: one pointer).
API void offplan_run(void* handle) {
  Job& j = *static_cast<Job*>(handle);
  auto start = Clock::now();
  const int64_t P = j.tokens * j.top_k;
  for (int64_t p = 0; p < P; ++p) {
    if (j.ids[p] < 0 || j.ids[p] >= j.experts) {  // not an expert: NaN where the host would have written
      if (j.error == 0) j.error = 1, j.bad = j.ids[p];
      const uint16_t nan = 0x7fc0;
      for (int64_t q = 0; q < P; ++q)
        if (j.ids[q] < 0 || j.ids[q] >= j.experts || j.on_cpu[j.ids[q]])
          for (int64_t c = 0; c < j.hidden; ++c) j.y[q * j.hidden + c] = nan;
      return;
    }
  }
  static_cast<Pool*>(j.pool)->run(j);
  j.nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  j.calls += 1;
}

}  // extern "C"
