// ringflex cli: reading, running and writing an attention job (see attn_job.h).
#include "cli/attn_job.h"

#include <chrono>
#include <climits>
#include <cmath>

#include "cli/finite.h"
#include "comm/agree.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/row_meta.h"
#include "cp/rows.h"
#include "cpu/attention.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "report/plan_report.h"

namespace rf::cli {

namespace {

using io::StDType;

// A dimension read from the file as an int (the kernels' index type), or an error naming it.
int int_dim(const io::DimSizes& dims, const char* letter, const std::string& file) {
  const int64_t n = dims[letter];
  RF_CHECK(n <= INT_MAX, file, ": ", letter, " = ", n, " is too large (at most ", INT_MAX, ")");
  return static_cast<int>(n);
}

std::vector<std::byte> copy_bytes(const io::TensorView& v) { return {v.bytes.begin(), v.bytes.end()}; }

// The [B, S] int32 tensor `t` (nullptr when absent: no ids) checked element by element against `ok`; `rule`
// says which values are legal.
template <typename Predicate>
std::vector<int32_t> checked_ids(const io::TensorView* t, int S, const std::string& file, Predicate ok,
                                 const char* rule) {
  if (!t) return {};
  std::vector<int32_t> ids = io::copy_as<int32_t>(*t);
  for (size_t i = 0; i < ids.size(); ++i)
    RF_CHECK(ok(ids[i]), file, ": tensor `", t->name, "` has ", ids[i], " at [", i / S, ", ", i % S, "]; ", rule);
  return ids;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

AttnChunk AttnJob::whole_chunk() const {
  AttnChunk c;
  c.shape = shape;
  c.dtype = dtype;
  c.q = q.data();
  c.k = k.data();
  c.v = v.data();
  c.q_meta = meta.data();
  c.k_meta = meta.data();
  c.mask = mask;
  c.scale = scale;
  return c;
}

AttnJob read_attn_job(const std::string& path, const LayerMask& mask, std::optional<float> scale, bool check_finite,
                      const BeforeCopying& before_copying) {
  RF_CHECK(mask.window >= 0, "--window ", mask.window, " is negative (0 means no window)");
  RF_CHECK(!scale || std::isfinite(*scale), "--scale ", *scale, " is not a finite number");

  const io::SafetensorsFile f = io::SafetensorsFile::open(path);
  io::DimSizes dims;
  const std::vector<std::string> q_dims = {"B", "Hq", "S", "D"}, kv_dims = {"B", "Hkv", "S", "D"},
                                 row_dims = {"B", "S"};
  const io::TensorView& q = io::require(f, {"q", {StDType::F32, StDType::BF16}, q_dims, ""}, dims);
  const std::string like_q = "like `q`";
  const io::TensorView& k = io::require(f, {"k", {q.dtype}, kv_dims, like_q}, dims);
  const io::TensorView& v = io::require(f, {"v", {q.dtype}, kv_dims, like_q}, dims);
  const io::TensorView* dout = io::optional(f, {"dout", {q.dtype}, q_dims, like_q}, dims);
  const io::TensorView* doc = io::optional(f, {"doc", {StDType::I32}, row_dims, ""}, dims);
  const io::TensorView* group = io::optional(f, {"group", {StDType::I32}, row_dims, ""}, dims);

  AttnJob job;
  AttnShape& s = job.shape;
  s.B = int_dim(dims, "B", path);
  s.Hq = int_dim(dims, "Hq", path);
  s.Hkv = int_dim(dims, "Hkv", path);
  s.Lq = s.Lk = int_dim(dims, "S", path);
  s.D = int_dim(dims, "D", path);
  RF_CHECK(s.Hq >= 1, path, ": tensor `q` has no heads (Hq = 0)");
  RF_CHECK(s.Hkv >= 1, path, ": tensors `k` and `v` have no heads (Hkv = 0)");
  RF_CHECK(s.Hq % s.Hkv == 0, path, ": Hq = ", s.Hq, " (tensor `q`) is not a multiple of Hkv = ", s.Hkv,
           " (tensors `k`, `v`)");
  RF_CHECK(s.D >= 1 && s.D <= kMaxHeadDim, path, ": head dimension D = ", s.D, " is outside 1..", kMaxHeadDim);

  const std::vector<int32_t> doc_ids = checked_ids(
      doc, s.Lq, path, [](int32_t d) { return d >= kPaddingDoc; }, "documents are numbered from 1 and 0 is padding");
  const std::vector<int32_t> group_ids = checked_ids(
      group, s.Lq, path, [](int32_t g) { return g >= kNoGroup; }, "groups are numbered from 0 and -1 is none");
  // Rows of S = 0 tokens hold no metadata; a file may still claim 2^31 - 1 of them in a few bytes, which
  // must not cost a loop over every one.
  for (int b = 0; b < (s.Lq > 0 ? s.B : 0); ++b) {
    const size_t row = static_cast<size_t>(b) * s.Lq;
    const std::vector<TokenMeta> m =
        make_row_meta(s.Lq, doc ? doc_ids.data() + row : nullptr, group ? group_ids.data() + row : nullptr);
    job.meta.insert(job.meta.end(), m.begin(), m.end());
  }

  job.dtype = *io::to_core(q.dtype);
  job.mask = mask;
  job.scale = scale.value_or(default_scale(s.D));
  job.has_dout = dout != nullptr;
  // Memory first (nothing of the tensors is read yet), then the values, then the copies.
  if (before_copying) before_copying(job);
  if (check_finite) {
    cli::check_finite(path, q, "[B, Hq, S, D]");
    cli::check_finite(path, k, "[B, Hkv, S, D]");
    cli::check_finite(path, v, "[B, Hkv, S, D]");
    if (dout) cli::check_finite(path, *dout, "[B, Hq, S, D]");
  }
  job.q = copy_bytes(q);
  job.k = copy_bytes(k);
  job.v = copy_bytes(v);
  if (dout) job.dout = copy_bytes(*dout);
  validate(job.whole_chunk());
  return job;
}

namespace {

// The job's rows as cp::cp_attention_rows takes them (tensors null in a header without them).
cp::RowsInput rows_input(const AttnJob& job) {
  const auto data = [](const std::vector<std::byte>& t) { return t.empty() ? nullptr : t.data(); };
  return {job.shape, job.dtype, data(job.q), data(job.k), data(job.v), data(job.dout), job.meta.data()};
}

cp::RowsOptions rows_options(const AttnJob& job, const CpOptions& opt) {
  cp::RowsOptions rows;
  rows.scheme = opt.shard;
  rows.params.mask = job.mask;
  rows.params.scale = job.scale;
  rows.params.algo = cp::parse_algo(opt.algo);
  rows.gather_root = 0;
  rows.collect_stats = opt.collect_stats;
  return rows;
}

bool runs_through_cp(const AttnJob& job, const CpOptions& cp, int P) {
  return (P > 1 || cp.collect_stats || cp.cp_path_on_one_rank) && job.shape.B > 0 && job.shape.Lq > 0;
}

// P > 1 (or --stats): the rows through cp::cp_attention_rows, gathered to rank 0, which writes them.
AttnResult run_attention_cp(const AttnJob& job, const CpOptions& opt, comm::Communicator& comm) {
  cp::RowsResult ran = cp::cp_attention_rows(comm, rows_input(job), rows_options(job, opt));

  AttnResult res;
  res.out = std::move(ran.out);
  res.lse = std::move(ran.lse);
  res.dq = std::move(ran.dq);
  res.dk = std::move(ran.dk);
  res.dv = std::move(ran.dv);
  res.forward_seconds = ran.forward_seconds;
  res.backward_seconds = ran.backward_seconds;
  // --stats: every rank's figures gathered in one JSON text (a collective, so every rank calls it).
  if (opt.collect_stats)
    res.stats_json = report::cp_stats_json(comm, ran.forward_stats, job.has_dout ? &ran.backward_stats : nullptr,
                                           ran.valid_tokens, cp::scheme_name(ran.map.scheme), opt.algo);
  return res;
}

}  // namespace

AttnResult run_attention(const AttnJob& job, const CpOptions& cp, comm::Communicator& comm) {
  // Every rank holds the whole job; agreeing on its shape and options first means a rank that read a different
  // file cannot send the others mismatched chunks.
  const AttnShape& s = job.shape;
  const int64_t fingerprint[] = {s.B,
                                 s.Hq,
                                 s.Hkv,
                                 s.Lq,
                                 s.D,
                                 static_cast<int64_t>(job.dtype),
                                 job.has_dout,
                                 job.mask.causal,
                                 job.mask.window,
                                 job.mask.bidirectional_groups};
  agree_equal(comm, fingerprint, "the input's shapes, dtype or mask options");
  if (runs_through_cp(job, cp, comm.size())) return run_attention_cp(job, cp, comm);

  AttnResult r;
  r.out.assign(static_cast<size_t>(s.q_elems()), 0.f);
  r.lse.assign(static_cast<size_t>(s.lse_elems()), 0.f);
  const AttnChunk c = job.whole_chunk();
  auto t0 = std::chrono::steady_clock::now();
  // One rank: the whole row is one chunk, so the kernel's partial result is already the final one.
  if (s.q_elems() > 0) cpu::attention_forward(c, r.out.data(), r.lse.data());
  r.forward_seconds = seconds_since(t0);
  if (!job.has_dout) return r;

  r.dq.assign(static_cast<size_t>(s.q_elems()), 0.f);
  r.dk.assign(static_cast<size_t>(s.kv_elems()), 0.f);
  r.dv.assign(static_cast<size_t>(s.kv_elems()), 0.f);
  std::vector<float> delta(static_cast<size_t>(s.lse_elems()));  // [B, Hq, S]
  t0 = std::chrono::steady_clock::now();
  if (s.q_elems() > 0) {
    cpu::attention_delta(s, job.dtype, job.dout.data(), r.out.data(), delta.data());
    cpu::attention_backward(c, job.dout.data(), r.lse.data(), delta.data(), r.dq.data(), r.dk.data(), r.dv.data());
  }
  r.backward_seconds = seconds_since(t0);
  return r;
}

// Terms: "input", the job's q, k, v (and dout) in its dtype (read_attn_job's copies, alive on every rank
// throughout), then the larger of two moments. Running: through CP, cp::rows_memory_at_least's peak, else
// "results", the whole rows' out [B, Hq, S, D] and lse [B, Hq, S] float32 (with the backward dq, dk, dv and delta
// [B, Hq, S]). Writing, on rank 0: the results in row order and "output copies", out (and dq, dk, dv) narrowed to
// the dtype by write_attn_result.
MemoryBreakdown attn_memory_at_least(const AttnJob& job, const CpOptions& cp, int P, int rank, bool writes_outputs) {
  const AttnShape& s = job.shape;
  const int64_t B = s.B, Hq = s.Hq, Hkv = s.Hkv, S = s.Lq, D = s.D;
  const int64_t es = static_cast<int64_t>(dtype_size(job.dtype)), f32 = sizeof(float);
  const int64_t q_tensors = job.has_dout ? 2 : 1;  // q, dout
  constexpr int64_t kKv = 2;                       // k, v (and dk, dv)
  // The whole rows' float32 results: out, lse (dq, dk, dv).
  const int64_t results =
      checked_sum({checked_bytes({B, Hq, S, D + 1, f32}), job.has_dout ? checked_bytes({B, Hq, S, D, f32}) : 0,
                   job.has_dout ? checked_bytes({B, Hkv, S, D, f32, kKv}) : 0});
  MemoryBreakdown running, writing;
  if (runs_through_cp(job, cp, P)) {
    running = cp::rows_memory_at_least(rows_input(job), job.has_dout, rows_options(job, cp), P, rank).peak();
  } else {
    running.add("results", checked_sum({results, job.has_dout ? checked_bytes({B, Hq, S, f32}) : 0}));  // + delta
  }
  if (rank == 0 && writes_outputs) {
    writing.add("results", results);
    writing.add("output copies", checked_sum({checked_bytes({B, Hq, S, D, es, q_tensors}),  // out (dq)
                                              job.has_dout ? checked_bytes({B, Hkv, S, D, es, kKv}) : 0}));
  }
  MemoryBreakdown need;
  need.add("input", checked_sum({checked_bytes({B, Hq, S, D, es, q_tensors}), checked_bytes({B, Hkv, S, D, es, kKv})}));
  const bool writing_larger = writing.total() < 0 || (running.total() >= 0 && writing.total() > running.total());
  need.add(writing_larger ? writing : running);
  return need;
}

void write_attn_result(io::AtomicFile& file, const AttnJob& job, const AttnResult& result) {
  const AttnShape& s = job.shape;
  const std::vector<int64_t> q_shape = {s.B, s.Hq, s.Lq, s.D}, kv_shape = {s.B, s.Hkv, s.Lk, s.D},
                             lse_shape = {s.B, s.Hq, s.Lq};
  const StDType out_dtype = io::to_st(job.dtype);
  // Narrowed copies live here until write() returns: the writer borrows them.
  std::vector<std::vector<std::byte>> narrowed;
  auto narrow = [&](const std::vector<float>& x) -> std::span<const std::byte> {
    std::vector<std::byte>& bytes = narrowed.emplace_back(x.size() * dtype_size(job.dtype));
    from_float(bytes.data(), x.data(), x.size(), job.dtype);
    return bytes;
  };
  io::SafetensorsWriter w;
  w.add("out", out_dtype, q_shape, narrow(result.out));
  w.add("lse", StDType::F32, lse_shape, std::span<const float>(result.lse));
  if (job.has_dout) {
    w.add("dq", out_dtype, q_shape, narrow(result.dq));
    w.add("dk", out_dtype, kv_shape, narrow(result.dk));
    w.add("dv", out_dtype, kv_shape, narrow(result.dv));
  }
  w.write(file);
}

}  // namespace rf::cli
