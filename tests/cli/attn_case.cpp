// Test-only tool behind tests/cli: writes `ringflex attn` inputs (good ones, and each kind of bad one) and checks
// an output file against the scalar reference run on the same input. Inputs are generated here rather than
// committed as binary files.
//
//     attn_case make IN [--B 2 --Hq 4 --Hkv 2 --S 40 --D 16 --dtype f32|bf16 --dout --meta KIND --seed N]
//     attn_case bad-inputs DIR     (DIR/KIND.safetensors for each kind of bad input, and DIR/good.safetensors)
//     attn_case check IN OUT [the attn mask options: --window --no-causal --bidirectional-groups --scale ...]
//
// `check` exits 0 when every output is within tolerance, else prints the worst element of the first tensor that
// is not and exits 1.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>

#include "common/attention_bounds.h"
#include "common/nonfinite.h"
#include "common/random_case.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "reference/attention_ref.h"

namespace {

using rf::io::StDType;

// q, k, v, dout values are uniform in [-1, 1] (random_tensor's default amplitude).
constexpr float kValueAmplitude = 1.f;

struct CaseShape {
  int B = 2, Hq = 4, Hkv = 2, S = 40, D = 16;
};

const std::map<std::string, rf::testing::MetaKind> kMetaKinds = {{"one_doc", rf::testing::MetaKind::OneDoc},
                                                                 {"packed", rf::testing::MetaKind::Packed},
                                                                 {"packed_images", rf::testing::MetaKind::PackedImages},
                                                                 {"padded", rf::testing::MetaKind::Padded},
                                                                 {"all_padding", rf::testing::MetaKind::AllPadding}};

// Tensors being assembled into a file; owns their bytes until written.
struct FileBuilder {
  std::vector<std::vector<uint8_t>> storage;
  rf::io::SafetensorsWriter writer;

  void add(const std::string& name, StDType t, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    storage.push_back(std::move(bytes));
    writer.add(name, t, std::move(shape), std::span<const uint8_t>(storage.back()));
  }
  void add_random(const std::string& name, StDType t, std::vector<int64_t> shape, uint64_t seed) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const rf::DType core = t == StDType::BF16 ? rf::DType::BF16 : rf::DType::F32;
    add(name, t, std::move(shape), rf::testing::random_tensor(n, core, seed, kValueAmplitude));
  }
  void add_ids(const std::string& name, StDType t, std::vector<int64_t> shape, const std::vector<int32_t>& ids) {
    std::vector<uint8_t> bytes(ids.size() * rf::io::element_size(t));
    for (size_t i = 0; i < ids.size(); ++i) {
      const int64_t wide = ids[i];
      std::memcpy(bytes.data() + i * rf::io::element_size(t), &wide, rf::io::element_size(t));  // little-endian
    }
    add(name, t, std::move(shape), std::move(bytes));
  }
};

struct MakeOptions {
  CaseShape shape;
  std::string dtype = "f32";
  bool dout = false;
  std::string meta;  // empty: no doc/group tensors
  uint64_t seed = 1;
  // Non-finite inputs (docs/numerics.md). poison_unread: NaN/±inf in every element of the tokens no result may
  // depend on under `mask` (padding, keys no query reads, rows that read nothing). nan_in: one NaN in that tensor
  // (q, k, v or dout) at row 0, head 0, token S/2, d 0.
  bool poison_unread = false;
  rf::LayerMask mask;
  std::string nan_in;
};

void add_meta(FileBuilder& f, const CaseShape& s, rf::testing::MetaKind kind, uint64_t seed) {
  const std::vector<rf::TokenMeta> meta = rf::testing::random_meta(s.B, s.S, kind, seed);
  std::vector<int32_t> doc, group;
  for (const rf::TokenMeta& m : meta) {
    doc.push_back(m.doc);
    group.push_back(m.group);
  }
  f.add_ids("doc", StDType::I32, {s.B, s.S}, doc);
  f.add_ids("group", StDType::I32, {s.B, s.S}, group);
}

void make(const std::string& path, const MakeOptions& o) {
  const CaseShape& s = o.shape;
  const StDType t = o.dtype == "bf16" ? StDType::BF16 : StDType::F32;
  const rf::DType core = t == StDType::BF16 ? rf::DType::BF16 : rf::DType::F32;
  const int64_t q_elems = int64_t{s.B} * s.Hq * s.S * s.D, kv_elems = int64_t{s.B} * s.Hkv * s.S * s.D;
  std::vector<uint8_t> q = rf::testing::random_tensor(q_elems, core, o.seed * 10 + 1, kValueAmplitude);
  std::vector<uint8_t> k = rf::testing::random_tensor(kv_elems, core, o.seed * 10 + 2, kValueAmplitude);
  std::vector<uint8_t> v = rf::testing::random_tensor(kv_elems, core, o.seed * 10 + 3, kValueAmplitude);
  std::vector<uint8_t> dout =
      o.dout ? rf::testing::random_tensor(q_elems, core, o.seed * 10 + 4, kValueAmplitude) : std::vector<uint8_t>{};
  // Metadata as ringflex builds it: random kinds, or one document per row when the file has none.
  const std::vector<rf::TokenMeta> meta = o.meta.empty()
                                              ? rf::testing::random_meta(s.B, s.S, rf::testing::MetaKind::OneDoc, 0)
                                              : rf::testing::random_meta(s.B, s.S, kMetaKinds.at(o.meta), o.seed);
  if (o.poison_unread)
    rf::testing::poison_unread(o.mask, meta.data(), meta.data(), s.B, s.Hq, s.Hkv, s.S, s.S, s.D, core,
                               {&q, &k, &v, o.dout ? &dout : nullptr}, o.seed);
  if (!o.nan_in.empty()) {
    const std::map<std::string, std::pair<std::vector<uint8_t>*, int>> target = {{"q", {&q, s.Hq}},
                                                                                 {"k", {&k, s.Hkv}},
                                                                                 {"v", {&v, s.Hkv}},
                                                                                 {"dout", {&dout, s.Hq}}};
    RF_CHECK(target.count(o.nan_in) && !target.at(o.nan_in).first->empty(), "--nan-in ", o.nan_in, ": no such tensor");
    rf::testing::set_element(*target.at(o.nan_in).first, int64_t{s.S / 2} * s.D, core,
                             std::numeric_limits<float>::quiet_NaN());
  }
  FileBuilder f;
  f.add("q", t, {s.B, s.Hq, s.S, s.D}, std::move(q));
  f.add("k", t, {s.B, s.Hkv, s.S, s.D}, std::move(k));
  f.add("v", t, {s.B, s.Hkv, s.S, s.D}, std::move(v));
  if (o.dout) f.add("dout", t, {s.B, s.Hq, s.S, s.D}, std::move(dout));
  if (!o.meta.empty()) add_meta(f, s, kMetaKinds.at(o.meta), o.seed);
  f.writer.write(path);
}

const std::vector<std::string> kBadKinds = {"missing_q",        "missing_k",       "missing_v",      "kv_seq_mismatch",
                                            "v_heads_mismatch", "dout_shape",      "dtype_mismatch", "q_int",
                                            "q_rank",           "heads",           "head_dim_zero",  "head_dim_large",
                                            "doc_shape",        "doc_dtype",       "doc_negative",   "group_below_none",
                                            "truncated",        "not_safetensors", "k_nan",          "dout_inf",
                                            "q_bf16_neg_inf"};

// One input per kind of bad input docs/spec.md §7 lists (the CMake file pairs each with the message it must produce).
void make_bad(const std::string& kind, const std::string& path) {
  const CaseShape s{1, 2, 1, 8, 4};
  const std::vector<int64_t> q = {s.B, s.Hq, s.S, s.D}, kv = {s.B, s.Hkv, s.S, s.D}, row = {s.B, s.S};
  FileBuilder f;
  auto qkv = [&](bool with_q, bool with_k, bool with_v) {
    if (with_q) f.add_random("q", StDType::F32, q, 1);
    if (with_k) f.add_random("k", StDType::F32, kv, 2);
    if (with_v) f.add_random("v", StDType::F32, kv, 3);
  };
  std::vector<int32_t> ids(static_cast<size_t>(s.B * s.S), 1);
  if (kind == "missing_q")
    qkv(false, true, true);
  else if (kind == "missing_k")
    qkv(true, false, true);
  else if (kind == "missing_v")
    qkv(true, true, false);
  else if (kind == "kv_seq_mismatch") {
    qkv(true, false, true);
    f.add_random("k", StDType::F32, {s.B, s.Hkv, s.S - 1, s.D}, 2);
  } else if (kind == "v_heads_mismatch") {
    qkv(true, true, false);
    f.add_random("v", StDType::F32, {s.B, s.Hkv + 1, s.S, s.D}, 3);
  } else if (kind == "dout_shape") {
    qkv(true, true, true);
    f.add_random("dout", StDType::F32, {s.B, s.Hq, s.S, s.D + 1}, 4);
  } else if (kind == "dtype_mismatch") {
    qkv(true, false, true);
    f.add_random("k", StDType::BF16, kv, 2);
  } else if (kind == "q_int") {
    qkv(false, true, true);
    f.add_ids("q", StDType::I32, q, std::vector<int32_t>(static_cast<size_t>(s.B * s.Hq * s.S * s.D), 0));
  } else if (kind == "q_rank") {
    qkv(false, true, true);
    f.add_random("q", StDType::F32, {s.Hq, s.S, s.D}, 1);
  } else if (kind == "heads") {
    f.add_random("q", StDType::F32, {s.B, 3, s.S, s.D}, 1);
    f.add_random("k", StDType::F32, {s.B, 2, s.S, s.D}, 2);
    f.add_random("v", StDType::F32, {s.B, 2, s.S, s.D}, 3);
  } else if (kind == "head_dim_zero" || kind == "head_dim_large") {
    const int64_t D = kind == "head_dim_zero" ? 0 : rf::kMaxHeadDim + 1;
    f.add_random("q", StDType::F32, {s.B, s.Hq, s.S, D}, 1);
    f.add_random("k", StDType::F32, {s.B, s.Hkv, s.S, D}, 2);
    f.add_random("v", StDType::F32, {s.B, s.Hkv, s.S, D}, 3);
  } else if (kind == "doc_shape") {
    qkv(true, true, true);
    f.add_ids("doc", StDType::I32, {s.B, s.S + 1}, std::vector<int32_t>(static_cast<size_t>(s.B * (s.S + 1)), 1));
  } else if (kind == "doc_dtype") {
    qkv(true, true, true);
    f.add_ids("doc", StDType::I64, row, ids);
  } else if (kind == "doc_negative") {
    qkv(true, true, true);
    ids[3] = -1;
    f.add_ids("doc", StDType::I32, row, ids);
  } else if (kind == "group_below_none") {
    qkv(true, true, true);
    std::fill(ids.begin(), ids.end(), -1);
    ids[5] = -2;
    f.add_ids("group", StDType::I32, row, ids);
  } else if (kind == "k_nan" || kind == "dout_inf" || kind == "q_bf16_neg_inf") {
    // One non-finite element at a known index: [0, 0, 5, 2] of k, [0, 1, 3, 0] of dout, [0, 1, 7, 3] of q.
    const bool bf16 = kind == "q_bf16_neg_inf";
    const StDType t = bf16 ? StDType::BF16 : StDType::F32;
    const rf::DType core = bf16 ? rf::DType::BF16 : rf::DType::F32;
    std::vector<uint8_t> qb = rf::testing::random_tensor(s.B * s.Hq * s.S * s.D, core, 1, kValueAmplitude);
    std::vector<uint8_t> kb = rf::testing::random_tensor(s.B * s.Hkv * s.S * s.D, core, 2, kValueAmplitude);
    std::vector<uint8_t> db = rf::testing::random_tensor(s.B * s.Hq * s.S * s.D, core, 4, kValueAmplitude);
    if (kind == "k_nan") rf::testing::set_element(kb, (0 * s.S + 5) * s.D + 2, core, std::nanf(""));
    if (kind == "dout_inf")
      rf::testing::set_element(db, (1 * s.S + 3) * s.D + 0, core, std::numeric_limits<float>::infinity());
    if (bf16) rf::testing::set_element(qb, (1 * s.S + 7) * s.D + 3, core, -std::numeric_limits<float>::infinity());
    f.add("q", t, q, std::move(qb));
    f.add("k", t, kv, std::move(kb));
    f.add_random("v", t, kv, 3);
    f.add("dout", t, q, std::move(db));
  } else if (kind == "truncated") {
    qkv(true, true, true);
    std::vector<std::byte> image = f.writer.serialize();
    image.resize(image.size() - 5);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(image.data()), static_cast<std::streamsize>(image.size()));
    return;
  } else if (kind == "not_safetensors") {
    std::ofstream(path) << "this is a text file, not a tensor file\n";
    return;
  } else {
    rf::fail("unknown bad-input kind `", kind, "`");
  }
  f.writer.write(path);
}

// Every bad input, plus a small good one for the tests of bad options.
void make_bad_inputs(const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (const std::string& kind : kBadKinds) make_bad(kind, dir + "/" + kind + ".safetensors");
  MakeOptions small;
  small.shape = {1, 2, 1, 8, 4};
  make(dir + "/good.safetensors", small);
}

// --- check ----------------------------------------------------------------------------------------------------

struct MaskOptions {
  rf::LayerMask mask;
  std::optional<float> scale;
};

// How far an output may be from the double-precision reference, per element:
// |got - ref| <= rel*|ref| + abs + terms·magnitude[i] (magnitude: the element's Σ|terms|, or null for none).
struct Tolerance {
  double rel, abs;
  double terms = 0;
  const std::vector<double>* magnitude = nullptr;
  double at(size_t i, double ref) const {
    return rel * std::fabs(ref) + abs + (magnitude ? terms * (*magnitude)[i] : 0.0);
  }
};

// Reports the first element out of tolerance and returns false; true when every element is within it.
bool compare(const std::string& name, const std::vector<float>& got, const std::vector<double>& ref, Tolerance tol) {
  if (got.size() != ref.size()) {
    std::fprintf(stderr, "attn_case: `%s` has %zu elements, reference %zu\n", name.c_str(), got.size(), ref.size());
    return false;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    // Non-finite values (empty rows' -inf, and NaN that non-finite inputs propagate, docs/numerics.md) must be
    // exactly where the reference has them, and of the same kind.
    if (!std::isfinite(ref[i]) || !std::isfinite(got[i])) {
      const bool same = std::isnan(ref[i]) ? std::isnan(got[i]) : static_cast<double>(got[i]) == ref[i];
      if (!same) {
        std::fprintf(stderr, "attn_case: `%s`[%zu] = %.9g, reference %.9g\n", name.c_str(), i,
                     static_cast<double>(got[i]), ref[i]);
        return false;
      }
      continue;
    }
    const double err = std::fabs(got[i] - ref[i]);
    if (!(err <= tol.at(i, ref[i]))) {
      std::fprintf(stderr, "attn_case: `%s`[%zu] = %.9g, reference %.9g (|err| %.3g > %.3g)\n", name.c_str(), i,
                   static_cast<double>(got[i]), ref[i], err, tol.at(i, ref[i]));
      return false;
    }
  }
  return true;
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::isfinite(v) ? std::max(m, std::fabs(v)) : m;
  return m;
}

bool check(const std::string& in_path, const std::string& out_path, const MaskOptions& mo) {
  const rf::io::SafetensorsFile in = rf::io::SafetensorsFile::open(in_path);
  const rf::io::SafetensorsFile out = rf::io::SafetensorsFile::open(out_path);
  const rf::io::TensorView& q = in.at("q");
  rf::AttnChunk c;
  c.shape = {static_cast<int>(q.shape[0]), static_cast<int>(q.shape[1]), static_cast<int>(in.at("k").shape[1]),
             static_cast<int>(q.shape[2]), static_cast<int>(q.shape[2]), static_cast<int>(q.shape[3])};
  const rf::AttnShape& s = c.shape;
  c.dtype = q.dtype == StDType::BF16 ? rf::DType::BF16 : rf::DType::F32;
  c.mask = mo.mask;
  c.scale = mo.scale.value_or(rf::default_scale(s.D));
  const std::vector<uint8_t> qb(reinterpret_cast<const uint8_t*>(q.bytes.data()),
                                reinterpret_cast<const uint8_t*>(q.bytes.data() + q.bytes.size()));
  auto bytes = [](const rf::io::TensorView& v) {
    return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(v.bytes.data()),
                                reinterpret_cast<const uint8_t*>(v.bytes.data()) + v.bytes.size());
  };
  const std::vector<uint8_t> kb = bytes(in.at("k")), vb = bytes(in.at("v"));
  std::vector<rf::TokenMeta> meta;
  const std::vector<int32_t> doc = in.find("doc") ? rf::io::copy_as<int32_t>(in.at("doc")) : std::vector<int32_t>{};
  const std::vector<int32_t> group =
      in.find("group") ? rf::io::copy_as<int32_t>(in.at("group")) : std::vector<int32_t>{};
  for (int b = 0; b < s.B; ++b) {
    const size_t row = static_cast<size_t>(b) * s.Lq;
    const auto m =
        rf::make_row_meta(s.Lq, doc.empty() ? nullptr : doc.data() + row, group.empty() ? nullptr : group.data() + row);
    meta.insert(meta.end(), m.begin(), m.end());
  }
  c.q = qb.data();
  c.k = kb.data();
  c.v = vb.data();
  c.q_meta = c.k_meta = meta.data();

  // Tolerances. Inputs are uniform in [-1, 1]; the reference accumulates in double on the same (possibly bf16)
  // inputs, so the only differences are ringflex's float32 accumulation and, for bf16, the output rounding and
  // the weights' rounding below.
  // The float32 error of these short, well-conditioned sums is about 1e-7 of the tensor's scale (max |ref|);
  // 1e-4 of it leaves a wide margin for any summation order while staying far below a masking error (one key
  // wrongly included or excluded moves an output by ~|v - o| / (keys seen) >= ~1e-3 for rows of <= 256 keys).
  // bf16 outputs are rounded to 8 significant bits: half an ulp is 2^-9 of |ref|, doubled for the float32
  // error underneath. And with bf16 inputs on the vdpbf16ps path (src/cpu/isa.h) the kernels round the weights P
  // and dS to bf16: at most 2^-8 of each element's Σ|terms| (common/attention_bounds.h), once for out and twice
  // for the gradients (tests/cpu/attention_check.h derives both). This tool cannot see which path ringflex took
  // (another process; a tile race may decide), so bf16 always allows it: bf16 cases catch gross errors, the
  // float32 ones the fine ones.
  constexpr double kF32Scale = 1e-4, kBf16Rounding = 1.0 / 256, kBf16Weights = 1.0 / 256;
  const bool bf16 = c.dtype == rf::DType::BF16;
  auto tol_for = [&](const std::vector<double>& ref, bool rounded, int weight_roundings,
                     const std::vector<double>* magnitude) {
    Tolerance t{rounded && bf16 ? kBf16Rounding : 0.0, kF32Scale * std::max(1.0, max_abs(ref))};
    if (bf16 && weight_roundings > 0) t.terms = weight_roundings * kBf16Weights, t.magnitude = magnitude;
    return t;
  };

  const rf::RefForward f = rf::reference_forward(c);
  const rf::io::TensorView* dout = in.find("dout");
  // Magnitudes need a dout; for a forward-only case out's do not depend on it, so q stands in.
  const std::vector<uint8_t> db = dout ? bytes(*dout) : qb;
  const rf::testing::Magnitudes mag = rf::testing::attention_magnitudes(c, db.data(), f);
  bool ok = compare("out", rf::io::to_float32(out.at("out")), f.o, tol_for(f.o, true, 1, &mag.o)) &&
            compare("lse", rf::io::copy_as<float>(out.at("lse")), f.lse, tol_for(f.lse, false, 0, nullptr));
  if (out.at("out").dtype != q.dtype) {
    std::fprintf(stderr, "attn_case: `out` has dtype %s, q has %s\n",
                 std::string(rf::io::dtype_name(out.at("out").dtype)).c_str(),
                 std::string(rf::io::dtype_name(q.dtype)).c_str());
    return false;
  }
  if (!dout) {
    if (out.find("dq")) std::fprintf(stderr, "attn_case: `dq` written without dout\n");
    return ok && !out.find("dq");
  }
  const rf::RefBackward g = rf::reference_backward(c, db.data());
  ok = ok && compare("dq", rf::io::to_float32(out.at("dq")), g.dq, tol_for(g.dq, true, 2, &mag.dq)) &&
       compare("dk", rf::io::to_float32(out.at("dk")), g.dk, tol_for(g.dk, true, 2, &mag.dk)) &&
       compare("dv", rf::io::to_float32(out.at("dv")), g.dv, tol_for(g.dv, true, 2, &mag.dv));
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ringflex attn test inputs and output checks"};
  app.require_subcommand(1);
  std::string in, out;
  MakeOptions mk;
  CLI::App* make_cmd = app.add_subcommand("make", "write a random attention input");
  make_cmd->add_option("in", in)->required();
  make_cmd->add_option("--B", mk.shape.B);
  make_cmd->add_option("--Hq", mk.shape.Hq);
  make_cmd->add_option("--Hkv", mk.shape.Hkv);
  make_cmd->add_option("--S", mk.shape.S);
  make_cmd->add_option("--D", mk.shape.D);
  make_cmd->add_option("--dtype", mk.dtype)->check(CLI::IsMember({"f32", "bf16"}));
  make_cmd->add_flag("--dout", mk.dout);
  make_cmd->add_option("--meta", mk.meta)
      ->check(CLI::IsMember({"one_doc", "packed", "packed_images", "padded", "all_padding"}));
  make_cmd->add_option("--seed", mk.seed);
  bool make_no_causal = false;
  make_cmd->add_flag("--poison-unread", mk.poison_unread);
  make_cmd->add_option("--window", mk.mask.window);
  make_cmd->add_flag("--no-causal", make_no_causal);
  make_cmd->add_flag("--bidirectional-groups", mk.mask.bidirectional_groups);
  make_cmd->add_option("--nan-in", mk.nan_in)->check(CLI::IsMember({"q", "k", "v", "dout"}));
  std::string dir;
  CLI::App* bad_cmd = app.add_subcommand("bad-inputs", "write every kind of bad input into a folder");
  bad_cmd->add_option("dir", dir)->required();
  MaskOptions mo;
  std::string ignored;
  int ignored_threads = 0;
  CLI::App* check_cmd = app.add_subcommand("check", "compare an output with the reference");
  check_cmd->add_option("in", in)->required();
  check_cmd->add_option("out", out)->required();
  check_cmd->add_option("--window", mo.mask.window);
  bool no_causal = false;  // parsed as a plain flag, not with ringflex's CLI11 idiom, so the two cannot share a bug
  check_cmd->add_flag("--no-causal", no_causal);
  check_cmd->add_flag("--bidirectional-groups", mo.mask.bidirectional_groups);
  check_cmd->add_option("--scale", mo.scale);
  check_cmd->add_option("--shard", ignored);  // sharding and algorithm do not change the expected result
  check_cmd->add_option("--algo", ignored);
  check_cmd->add_option("--threads", ignored_threads);
  double ignored_timeout = 0;
  bool ignored_flag = false;
  check_cmd->add_option("--timeout", ignored_timeout);
  check_cmd->add_flag("--no-check-finite", ignored_flag);
  CLI11_PARSE(app, argc, argv);
  try {
    mk.mask.causal = !make_no_causal;
    if (*make_cmd) make(in, mk);
    if (*bad_cmd) make_bad_inputs(dir);
    mo.mask.causal = !no_causal;
    if (*check_cmd) return check(in, out, mo) ? 0 : 1;
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "attn_case: %s\n", e.what());
    return 1;
  }
  return 0;
}
