// The prefix-attention scan for XLA's CPU backend, as XLA FFI custom calls: the forward
// pass (AarenPrefixScan) and its backward pass (AarenPrefixScanBackward).
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
// Forward buffers (R rows, T tokens, D value width; float32 or float64, all one dtype):
//   in:  scores [R, T], counts c [R, T], values [R, T, D], m0 [R], u0 [R], w0 [R, D]
//   out: outputs [R, T, D], refs [R, T], sums u [R, T] (relative to refs),
//        final m [R], final u [R], final w [R, D]
// The backward pass: see BackwardRow.

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

// Software prefetch in the backward pass, kPrefetchBytes ahead in every stream: walking the
// tokens backwards, the hardware prefetcher alone left it 1.3x slower (AMD EPYC, N = 16,384;
// the forward pass, walking forwards, gained nothing from it).
constexpr int64_t kLine = 64;
constexpr int64_t kPrefetchBytes = 4096;

template <typename T>
inline int64_t Ahead(int64_t dim) {
  return std::max<int64_t>(1, kPrefetchBytes / (std::max<int64_t>(dim, 1) * sizeof(T)));
}

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

// The backward pass of one row: the transpose of scan.py's tangent (the JVP of the outputs,
// of u relative to itself and of the final state), walked from the last token to the first.
// With p_ti = exp(s_i - ref_t) / u_t, the cotangents g_t (outputs), h_t (du / u) and
// (gu, gw) (final state, relative to the final reference):
//   P_i = sum_{t>=i} p_ti g_t + exp(s_i - ref_F) gw,
//   Q_i = sum_{t>=i} p_ti (g_t . o_t - h_t) - exp(s_i - ref_F) gu,
//   dv_i = P_i, ds_i = v_i . P_i - Q_i (0 where masked),
// the initial state a token before the first (score m0): dw0 = P, du0 = -Q. The carries are
// the sums relative to ref_i (A, B: P_i = exp(s_i - ref_i) A_i), rescaled by
// exp(ref_i - ref_{i+1}) <= 1, and compensated like the forward sums. Where nothing is
// attended yet (u_t = 0) every earlier weight is 0: the carries restart from 0 there.
template <typename T>
void BackwardRow(int64_t num_tokens, int64_t dim, const T* scores, const T* counts,
                 const T* values, const T* outputs, const T* refs, const T* sums, T m0,
                 const T* g, const T* g_unorm, T g_final_u, const T* g_final_w, T* d_scores,
                 T* d_values, T* d_init_u, T* d_init_w, T* a, T* a_err) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  std::copy(g_final_w, g_final_w + dim, a);
  std::fill(a_err, a_err + dim, T(0));
  T b = -g_final_u, b_err = 0;
  const int64_t ahead = Ahead<T>(dim);
  T next_ref = num_tokens > 0 ? refs[num_tokens - 1] : T(0);
  for (int64_t t = num_tokens - 1; t >= 0; --t) {
    const T* gt = g + t * dim;
    T* dv = d_values + t * dim;
    if (t >= ahead) {
      for (int64_t d = 0; d < dim; d += kLine / sizeof(T)) {
        __builtin_prefetch(g + (t - ahead) * dim + d);
        __builtin_prefetch(outputs + (t - ahead) * dim + d);
        __builtin_prefetch(values + (t - ahead) * dim + d);
        __builtin_prefetch(d_values + (t - ahead) * dim + d, 1);
      }
    }
    const T u = sums[t];
    if (u == T(0)) {
      std::fill(a, a + dim, T(0));
      std::fill(a_err, a_err + dim, T(0));
      b = b_err = 0;
      std::fill(dv, dv + dim, T(0));
      d_scores[t] = 0;
      next_ref = refs[t];
      continue;
    }
    const T ref = refs[t];
    const T scale = ExpOf(ref - next_ref);
    const T inverse_u = T(1) / u;
    const T* o = outputs + t * dim;
    T g_dot_o = 0;
    // the dot products' order is free (-fopenmp-simd: vectorised; otherwise one add after
    // another, four times the time of the whole backward pass)
#pragma omp simd reduction(+ : g_dot_o)
    for (int64_t d = 0; d < dim; ++d) g_dot_o += gt[d] * o[d];
    T lost;
    b = TwoSum(b * scale, (g_dot_o - g_unorm[t]) * inverse_u, &lost);
    b_err = b_err * scale + lost;
    const T weight = ExpOf(scores[t] - ref);
    const T* v = values + t * dim;
    for (int64_t d = 0; d < dim; ++d) {
      T a_lost;
      a[d] = TwoSum(a[d] * scale, gt[d] * inverse_u, &a_lost);
      a_err[d] = a_err[d] * scale + a_lost;
      dv[d] = weight * (a[d] + a_err[d]);
    }
    T v_dot_p = 0;
#pragma omp simd reduction(+ : v_dot_p)
    for (int64_t d = 0; d < dim; ++d) v_dot_p += v[d] * dv[d];
    d_scores[t] = counts[t] != T(0) ? v_dot_p - weight * (b + b_err) : T(0);
    next_ref = ref;
  }
  if (m0 == neg_inf) {  // the identity: no weight anywhere (and exp(0 - ref_0) may overflow)
    *d_init_u = 0;
    std::fill(d_init_w, d_init_w + dim, T(0));
    return;
  }
  const T scale = ExpOf(m0 - next_ref);  // next_ref = ref_0 >= m0
  *d_init_u = -scale * (b + b_err);
  for (int64_t d = 0; d < dim; ++d) d_init_w[d] = scale * (a[d] + a_err[d]);
}

// Rows in contiguous ranges, claimed from a shared counter by the calling thread and by
// tasks on XLA's pool (the caller never waits on a task that has not started: it does the
// work itself), so the call cannot deadlock on a busy pool. A few ranges per thread (rows
// cost alike, but threads are shared), and one range for small calls, where a task costs
// more than it saves.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;
};

template <typename F>
void ForRows(ffi::ThreadPool& pool, int64_t num_rows, int64_t work_items, F rows) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t ranges =
      work_items < (int64_t{1} << 16) ? 1 : std::min<int64_t>(num_rows, 4 * threads);
  if (ranges <= 1) {
    rows(0, num_rows);
    return;
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
}

// Rows R (all leading axes), tokens T and value width D of scores [R..., T] and values
// [R..., T, D]; the work per call, for ForRows.
struct RowShape {
  int64_t rows, tokens, dim;
  int64_t work() const { return rows * tokens * std::max<int64_t>(dim, 1); }
};

inline RowShape ShapeOf(const ffi::AnyBuffer& scores, const ffi::AnyBuffer& values) {
  const auto dims = values.dimensions();
  const int64_t tokens = dims[dims.size() - 2];
  return {tokens == 0 ? 0 : static_cast<int64_t>(scores.element_count()) / tokens, tokens,
          dims[dims.size() - 1]};
}

// Runs `run(T{})` for the buffers' float type T; other types are an error.
template <typename F>
ffi::Error ForFloatType(const ffi::AnyBuffer& values, F run) {
  if (values.dimensions().size() < 2) {
    return ffi::Error::InvalidArgument("prefix scan: values must be [..., T, D]");
  }
  switch (values.element_type()) {
    case ffi::DataType::F32:
      run(float{});
      return ffi::Error::Success();
    case ffi::DataType::F64:
      run(double{});
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("prefix scan: float32 or float64 only");
  }
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer scores, ffi::AnyBuffer counts,
                   ffi::AnyBuffer values, ffi::AnyBuffer init_m, ffi::AnyBuffer init_u,
                   ffi::AnyBuffer init_w, ffi::Result<ffi::AnyBuffer> outputs,
                   ffi::Result<ffi::AnyBuffer> refs, ffi::Result<ffi::AnyBuffer> sums,
                   ffi::Result<ffi::AnyBuffer> final_m, ffi::Result<ffi::AnyBuffer> final_u,
                   ffi::Result<ffi::AnyBuffer> final_w) {
  return ForFloatType(values, [&](auto zero) {
    using T = decltype(zero);
    const RowShape n = ShapeOf(scores, values);
    const T *s = scores.typed_data<T>(), *c = counts.typed_data<T>();
    const T *v = values.typed_data<T>(), *m0 = init_m.typed_data<T>();
    const T *u0 = init_u.typed_data<T>(), *w0 = init_w.typed_data<T>();
    T *o = outputs->typed_data<T>(), *r = refs->typed_data<T>(), *su = sums->typed_data<T>();
    T *fm = final_m->typed_data<T>(), *fu = final_u->typed_data<T>();
    T* fw = final_w->typed_data<T>();
    ForRows(pool, n.rows, n.work(), [=](int64_t begin, int64_t end) {
      std::vector<T> w(n.dim), w_err(n.dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i * n.tokens, row_d = row * n.dim;
        ScanRow<T>(n.tokens, n.dim, s + row, c + row, v + row_d, m0[i], u0[i], w0 + i * n.dim,
                   o + row_d, r + row, su + row, fm + i, fu + i, fw + i * n.dim, w.data(),
                   w_err.data());
      }
    });
  });
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer scores, ffi::AnyBuffer counts,
                    ffi::AnyBuffer values, ffi::AnyBuffer outputs, ffi::AnyBuffer refs,
                    ffi::AnyBuffer sums, ffi::AnyBuffer init_m, ffi::AnyBuffer g,
                    ffi::AnyBuffer g_unorm, ffi::AnyBuffer g_final_u, ffi::AnyBuffer g_final_w,
                    ffi::Result<ffi::AnyBuffer> d_scores, ffi::Result<ffi::AnyBuffer> d_values,
                    ffi::Result<ffi::AnyBuffer> d_init_u, ffi::Result<ffi::AnyBuffer> d_init_w) {
  return ForFloatType(values, [&](auto zero) {
    using T = decltype(zero);
    const RowShape n = ShapeOf(scores, values);
    const T *s = scores.typed_data<T>(), *c = counts.typed_data<T>();
    const T *v = values.typed_data<T>(), *o = outputs.typed_data<T>();
    const T *r = refs.typed_data<T>(), *su = sums.typed_data<T>();
    const T *m0 = init_m.typed_data<T>(), *gg = g.typed_data<T>();
    const T *gn = g_unorm.typed_data<T>(), *gu = g_final_u.typed_data<T>();
    const T* gw = g_final_w.typed_data<T>();
    T *ds = d_scores->typed_data<T>(), *dv = d_values->typed_data<T>();
    T *du0 = d_init_u->typed_data<T>(), *dw0 = d_init_w->typed_data<T>();
    ForRows(pool, n.rows, n.work(), [=](int64_t begin, int64_t end) {
      std::vector<T> a(n.dim), a_err(n.dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = i * n.tokens, row_d = row * n.dim;
        BackwardRow<T>(n.tokens, n.dim, s + row, c + row, v + row_d, o + row_d, r + row,
                       su + row, m0[i], gg + row_d, gn + row, gu[i], gw + i * n.dim, ds + row,
                       dv + row_d, du0 + i, dw0 + i * n.dim, a.data(), a_err.data());
      }
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AarenPrefixScan, Forward,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(AarenPrefixScanBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // scores
                                  .Arg<ffi::AnyBuffer>()  // counts
                                  .Arg<ffi::AnyBuffer>()  // values
                                  .Arg<ffi::AnyBuffer>()  // outputs
                                  .Arg<ffi::AnyBuffer>()  // refs
                                  .Arg<ffi::AnyBuffer>()  // sums
                                  .Arg<ffi::AnyBuffer>()  // init m
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Arg<ffi::AnyBuffer>()  // g of du / u
                                  .Arg<ffi::AnyBuffer>()  // g of the final u
                                  .Arg<ffi::AnyBuffer>()  // g of the final w
                                  .Ret<ffi::AnyBuffer>()  // d scores
                                  .Ret<ffi::AnyBuffer>()  // d values
                                  .Ret<ffi::AnyBuffer>()  // d initial u
                                  .Ret<ffi::AnyBuffer>());  // d initial w
