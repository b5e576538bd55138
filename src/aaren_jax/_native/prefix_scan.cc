// The prefix-attention scan for XLA's CPU backend, as an XLA FFI custom call.
//
// XLA's CPU code for the blocked kernel's in-place position loop runs each step as separate
// fusions over strided slices on one thread (README, issue 13): no XLA loop came near the
// memory floor. This is the same recurrence written once, row by row: each row of R rows
// walks its T tokens with the state (m, u, w) in registers, reading each score and value
// once and writing each output once, rows spread over XLA's intra-op thread pool.
//
// Per token, exactly `combine(state, leaf)` of scan.py:
//   m' = max(m, s) (NaN propagates), ref = m' == -inf ? 0 : m',
//   u' = u exp(m - ref) + c exp(s - ref), w' = w exp(m - ref) + v exp(s - ref),
//   o = u' != 0 ? w' / u' : 0 (a NaN u' is not 0, so NaN reaches the output).
// Masked tokens come in as s = -inf, c = 0, v = 0 (the caller zeroes them).
//
// Buffers (R rows, T tokens, D value width; float32 or float64, all one dtype):
//   in:  scores [R, T], counts c [R, T], values [R, T, D], m0 [R], u0 [R], w0 [R, D]
//   out: outputs [R, T, D], refs [R, T], sums u [R, T] (relative to refs),
//        final m [R], final u [R], final w [R, D]

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <typename T>
inline T ExpOf(T x) {
  return x == T(0) ? T(1) : std::exp(x);
}

// x + y with what the addition rounds away (Knuth's TwoSum), as scan.py's _two_sum.
template <typename T>
inline T TwoSum(T x, T y, T* lost) {
  const T total = x + y;
  const T y_part = total - x;
  *lost = (x - (total - y_part)) + (y - y_part);
  return total;
}

// One row: T tokens from the state (m, u, w). The sums are compensated (Kahan): a row is a
// sequential sum of up to T terms, which would otherwise drift by up to T roundings, where
// the blocked and tree-shaped methods drift by about log T. `w` and `w_err` are scratch.
template <typename T>
void ScanRow(int64_t num_tokens, int64_t dim, const T* scores, const T* counts, const T* values,
             T m, T u, const T* w0, T* outputs, T* refs, T* sums, T* final_m, T* final_u,
             T* final_w, T* w, T* w_err) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::copy(w0, w0 + dim, w);
  std::fill(w_err, w_err + dim, T(0));
  T u_err = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T s = scores[t];
    const T next_m = (std::isnan(m) || std::isnan(s)) ? std::numeric_limits<T>::quiet_NaN()
                                                       : std::max(m, s);
    const T ref = next_m == neg_inf ? T(0) : next_m;
    // One of the two exponents is 0 unless nothing was seen yet: exp(0) = 1 exactly.
    const T scale_state = ExpOf(m - ref);
    const T scale_token = ExpOf(s - ref);
    T lost;
    u = TwoSum(u * scale_state, counts[t] * scale_token, &lost);
    u_err = u_err * scale_state + lost;
    const T u_total = u + u_err;
    const T* v = values + t * dim;
    T* o = outputs + t * dim;
    for (int64_t d = 0; d < dim; ++d) {
      T w_lost;
      w[d] = TwoSum(w[d] * scale_state, v[d] * scale_token, &w_lost);
      w_err[d] = w_err[d] * scale_state + w_lost;
    }
    if (u_total != T(0)) {
      for (int64_t d = 0; d < dim; ++d) o[d] = (w[d] + w_err[d]) / u_total;
    } else {
      std::fill(o, o + dim, T(0));
    }
    refs[t] = ref;
    sums[t] = u_total;
    m = next_m;
  }
  *final_m = m;
  *final_u = u + u_err;
  for (int64_t d = 0; d < dim; ++d) final_w[d] = w[d] + w_err[d];
}

// Rows in contiguous ranges, claimed from a shared counter by the calling thread and by
// tasks on XLA's pool (the caller never waits on a task that has not started: it does the
// work itself), so the call cannot deadlock on a busy pool.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

template <typename T>
ffi::Error Scan(ffi::ThreadPool pool, ffi::AnyBuffer scores, ffi::AnyBuffer counts,
                ffi::AnyBuffer values, ffi::AnyBuffer init_m, ffi::AnyBuffer init_u,
                ffi::AnyBuffer init_w, ffi::Result<ffi::AnyBuffer> outputs,
                ffi::Result<ffi::AnyBuffer> refs, ffi::Result<ffi::AnyBuffer> sums,
                ffi::Result<ffi::AnyBuffer> final_m, ffi::Result<ffi::AnyBuffer> final_u,
                ffi::Result<ffi::AnyBuffer> final_w) {
  const auto dims = values.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("values must be [..., T, D]");
  const int64_t num_tokens = dims[dims.size() - 2];
  const int64_t dim = dims[dims.size() - 1];
  const int64_t num_rows = num_tokens == 0 ? 0 : scores.element_count() / num_tokens;
  const T* s = scores.typed_data<T>();
  const T* c = counts.typed_data<T>();
  const T* v = values.typed_data<T>();
  const T* m0 = init_m.typed_data<T>();
  const T* u0 = init_u.typed_data<T>();
  const T* w0 = init_w.typed_data<T>();
  T* o = outputs->typed_data<T>();
  T* r = refs->typed_data<T>();
  T* su = sums->typed_data<T>();
  T* fm = final_m->typed_data<T>();
  T* fu = final_u->typed_data<T>();
  T* fw = final_w->typed_data<T>();

  auto rows = [=](int64_t begin, int64_t end) {
    std::vector<T> w(dim), w_err(dim);
    for (int64_t i = begin; i < end; ++i) {
      ScanRow<T>(num_tokens, dim, s + i * num_tokens, c + i * num_tokens,
                 v + i * num_tokens * dim, m0[i], u0[i], w0 + i * dim,
                 o + i * num_tokens * dim, r + i * num_tokens, su + i * num_tokens, fm + i, fu + i,
                 fw + i * dim, w.data(), w_err.data());
    }
  };

  // A few ranges per thread (rows cost alike, but threads are shared), and one range for
  // small calls, where a task costs more than it saves.
  const int64_t work_items = num_rows * num_tokens * std::max<int64_t>(dim, 1);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t ranges =
      work_items < (int64_t{1} << 16) ? 1 : std::min<int64_t>(num_rows, 4 * threads);
  if (ranges <= 1) {
    rows(0, num_rows);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  auto run = [=]() {
    for (int64_t k = work->next.fetch_add(1); k < ranges; k = work->next.fetch_add(1)) {
      rows(num_rows * k / ranges, num_rows * (k + 1) / ranges);
      if (work->done.fetch_add(1) + 1 == ranges) {
        std::lock_guard<std::mutex> lock(work->mutex);
        work->finished.notify_all();
      }
    }
  };
  for (int64_t k = 1; k < ranges; ++k) pool.Schedule([run] { run(); });
  run();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done.load() == ranges; });
  return ffi::Error::Success();
}

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer scores, ffi::AnyBuffer counts,
                    ffi::AnyBuffer values, ffi::AnyBuffer init_m, ffi::AnyBuffer init_u,
                    ffi::AnyBuffer init_w, ffi::Result<ffi::AnyBuffer> outputs,
                    ffi::Result<ffi::AnyBuffer> refs, ffi::Result<ffi::AnyBuffer> sums,
                    ffi::Result<ffi::AnyBuffer> final_m, ffi::Result<ffi::AnyBuffer> final_u,
                    ffi::Result<ffi::AnyBuffer> final_w) {
  switch (values.element_type()) {
    case ffi::DataType::F32:
      return Scan<float>(pool, scores, counts, values, init_m, init_u, init_w, outputs, refs,
                         sums, final_m, final_u, final_w);
    case ffi::DataType::F64:
      return Scan<double>(pool, scores, counts, values, init_m, init_u, init_w, outputs, refs,
                          sums, final_m, final_u, final_w);
    default:
      return ffi::Error::InvalidArgument("prefix scan: float32 or float64 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AarenPrefixScan, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
