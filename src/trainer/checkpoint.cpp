// ringflex trainer: checkpoint directories (see checkpoint.h).
#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/memory.h"
#include "io/atomic_file.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/expert_store.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kStatePrefix = "step-";
constexpr int kStepDigits = 8;
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
// Sharded moments: the layout and one file a rank (checkpoint.h).
constexpr const char* kMomentLayoutFile = "optimizer.json";
constexpr const char* kMomentFormat = "ringflex-moments-1";
constexpr const char* kExpAvg = "exp_avg";
constexpr const char* kExpAvgSq = "exp_avg_sq";

std::string moment_file_name(int rank, int ranks) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "optimizer-%05d-of-%05d.safetensors", rank + 1, ranks);
  return buf;
}

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY | O_CLOEXEC : O_RDONLY | O_CLOEXEC);
  RF_CHECK(fd >= 0, p.string(), ": cannot open to sync: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  RF_CHECK(rc == 0, p.string(), ": write failed (fsync): ", std::strerror(err));
}

// What a save leaves behind when the process is killed part way: its hidden temporary directory
// (".step-NNNNNNNN.tmp"), the previous copy of a step saved again (".step-NNNNNNNN.old") and io::AtomicFile's
// temporaries (".<name>.tmp.<pid>.<n>", the loss picture's). Never a checkpoint (those are not hidden).
bool is_leftover(const std::string& name) {
  const bool step_dir = name.rfind(".step-", 0) == 0 && (name.ends_with(".tmp") || name.ends_with(".old"));
  return step_dir || (name.rfind(".", 0) == 0 && name.find(".tmp.") != std::string::npos);
}

// ".<name><suffix>": a hidden sibling that is never taken for a checkpoint. Built by appending (GCC 12 warns
// falsely, -Wrestrict, on the operator+ chain).
std::string hidden_name(const std::string& name, const char* suffix) {
  std::string out = ".";
  out.append(name);
  out.append(suffix);
  return out;
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%0*lld", kStatePrefix, kStepDigits, static_cast<long long>(step));
  return buf;
}

// Checkpoint directories under root, oldest first (the zero-padded step sorts by name). Hidden entries (a save's
// temporaries) are never checkpoints.
std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  fs::directory_iterator it(root, ec), end;
  RF_CHECK(!ec, root.string(), ": cannot list the checkpoints: ", ec.message());
  for (; it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code ec_entry;
    if (name.rfind(kStatePrefix, 0) == 0 && it->is_directory(ec_entry) && fs::exists(it->path() / kStateFile, ec_entry))
      out.push_back(it->path());
  }
  RF_CHECK(!ec, root.string(), ": cannot list the checkpoints: ", ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_text(const fs::path& p) {
  std::error_code ec;  // a FIFO or a directory by that name would hang or fail the read: neither is a state file
  RF_CHECK(fs::is_regular_file(p, ec), p.string(), ": not a regular file");
  std::ifstream in(p);
  RF_CHECK(in.good(), p.string(), ": cannot open");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A trainer state is the one file a user may edit by hand, so every number is checked before it reaches the loop's
// arithmetic. The optimizer step is at most train.steps (an int); the data position advances by train.global_batch
// (an int) per step, so starting below 2^62 it stays below int64's limit for any run: 2^31 steps of 2^31 rows add
// less than 2^62.
constexpr int64_t kMaxStateStep = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxDataPosition = std::numeric_limits<int64_t>::max() / 2;

// `name` of `where`, an integer (not 0.5, which json would truncate to 0) in [lo, hi]. json keeps a non-negative
// integer as unsigned, so that case is compared as unsigned (a value above int64's range must not wrap).
int64_t integer_in(const json& v, const std::string& where, const std::string& name, int64_t lo, int64_t hi) {
  const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() >= static_cast<uint64_t>(std::max<int64_t>(lo, 0)) &&
                                                 v.get<uint64_t>() <= static_cast<uint64_t>(hi)
                                           : v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  RF_CHECK(fits, where, ": `", name, "` = ", v.dump(), " must be an integer in [", lo, ", ", hi, "]");
  return v.get<int64_t>();
}

// The steps of a loss history: each one an optimizer step already done, in [1, step].
std::vector<int> history_steps(const json& a, const std::string& where, const std::string& name, int64_t step) {
  RF_CHECK(a.is_array(), where, ": `", name, "` must be an array of steps");
  std::vector<int> out;
  for (const json& v : a)
    out.push_back(static_cast<int>(integer_in(v, where, rf::concat(name, "[", out.size(), "]"), 1, step)));
  return out;
}

}  // namespace

void check_loaded_tensor(const std::string& where, const std::string& name, std::span<const float> values,
                         const std::vector<int64_t>& shape, bool non_negative) {
  for (size_t i = 0; i < values.size(); ++i) {
    const float x = values[i];
    if (std::isfinite(x) && (!non_negative || x >= 0)) continue;
    rf::fail(where, ": tensor `", name, "` has ", x, " at ", io::index_string(static_cast<int64_t>(i), shape),
             std::isfinite(x) ? " (a second moment is never negative)" : "");
  }
}

void remove_leftovers(const std::string& root) {
  std::error_code ec;
  std::vector<fs::path> found;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    if (is_leftover(it->path().filename().string())) found.push_back(it->path());
  for (const fs::path& p : found) {
    fs::remove_all(p, ec);
    RF_CHECK(!ec, p.string(), ": cannot remove what an interrupted save left: ", ec.message());
  }
}

int64_t checkpoint_bytes(const model::Checkpoint& weights, const model::ParamStore& store) {
  constexpr int64_t kMoments = 2;  // exp_avg, exp_avg_sq
  constexpr auto kF32 = static_cast<int64_t>(sizeof(float));
  const model::Gemma4Multimodal& m = *weights.model;
  int64_t bytes = checked_sum({checked_bytes({store.total_elements(), kF32}), m.buffers().total_bytes(),
                               checked_bytes({kMoments, store.trainable_elements(), kF32})});
  for (const io::Passthrough::Entry& e : weights.model->kept().entries())
    bytes = checked_sum({bytes, static_cast<int64_t>(e.bytes.size())});
  return bytes;
}

std::string checkpoint_temp_path(const std::string& root, int64_t step) {
  return (fs::path(root) / hidden_name(step_name(step), ".tmp")).string();
}

PendingCheckpoint::PendingCheckpoint(const std::string& root, int64_t step)
    : root_(root), name_(step_name(step)), temp_(checkpoint_temp_path(root, step)) {
  std::error_code ec;
  fs::create_directories(root_, ec);
  RF_CHECK(!ec, root_, ": cannot create the checkpoint directory: ", ec.message());
  remove_leftovers(root_);  // of a save a hard kill interrupted
  fs::create_directory(temp_, ec);
  RF_CHECK(!ec, temp_, ": cannot create the checkpoint's temporary directory: ", ec.message());
}

PendingCheckpoint::~PendingCheckpoint() {
  std::error_code ec;
  if (!renamed_) fs::remove_all(temp_, ec);
}

void write_moments_whole(const std::string& dir, const model::ParamStore& store) {
  RF_CHECK(store.moment_range().size() == store.trainable_elements(),
           "save: the optimizer's moments are sharded; each rank writes its own (write_moments_shard)");
  const auto copy = [&store](model::Role role, size_t slot, std::span<float> out) {
    std::copy_n(store.moment(role, slot), out.size(), out.data());
  };
  write_moments_streamed(dir, store, copy, true);
}

void write_moments_streamed(const std::string& dir, const model::ParamStore& layout, const MomentReader& read,
                            bool write) {
  io::SafetensorsWriter w;
  for (size_t i = 0; i < layout.size(); ++i) {
    const model::ParamInfo& p = layout.info(i);
    if (!p.trainable) continue;  // a frozen tensor has no moments (a resume must freeze the same)
    for (const auto& entry : {std::pair{"exp_avg.", model::Role::ExpAvg}, {"exp_avg_sq.", model::Role::ExpAvgSq}}) {
      const model::Role role = entry.second;
      w.add_fill(entry.first + p.name, io::StDType::F32, p.whole_shape(), [&read, role, i](std::span<std::byte> out) {
        read(role, i, std::span<float>(reinterpret_cast<float*>(out.data()), out.size() / sizeof(float)));
      });
    }
  }
  if (!write) {
    w.run_fills();
    return;
  }
  w.write((fs::path(dir) / kOptimizerFile).string());
}

void write_moments_shard(const std::string& dir, const model::ParamStore& store, int rank, int ranks) {
  const model::Shard range = store.moment_range();
  const std::vector<int64_t> shape = {range.size()};
  io::SafetensorsWriter w;
  // optimizer.json holds the ranges; the file's own copy tells a reader of the file alone what it holds.
  w.set_metadata("begin", std::to_string(range.begin));
  w.set_metadata("end", std::to_string(range.end));
  w.add(kExpAvg, io::StDType::F32, shape, store.flat(model::Role::ExpAvg));
  w.add(kExpAvgSq, io::StDType::F32, shape, store.flat(model::Role::ExpAvgSq));
  w.write((fs::path(dir) / moment_file_name(rank, ranks)).string());
}

std::string PendingCheckpoint::finish(const model::ParamStore& store, const TrainState& state,
                                      const MomentLayout& moments, int keep,
                                      const std::function<void(const std::string&)>& before_rename) {
  const fs::path base(root_), tmp(temp_);
  std::error_code ec;
  if (!moments.ranges.empty()) {
    json params = json::array();
    for (const model::ParamInfo& p : store.infos())
      if (p.trainable) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.train_offset}});
    json files = json::array();
    const int ranks = static_cast<int>(moments.ranges.size());
    for (int r = 0; r < ranks; ++r)
      files.push_back({{"file", moment_file_name(r, ranks)},
                       {"begin", moments.ranges[r].first},
                       {"end", moments.ranges[r].second}});
    const json layout = {{"format", kMomentFormat},
                         {"shard", moments.shard_mode},
                         {"ranks", ranks},
                         {"trainable_elements", store.trainable_elements()},
                         {"parameters", std::move(params)},
                         {"files", std::move(files)}};
    io::write_file_atomically((tmp / kMomentLayoutFile).string(), layout.dump(1) + "\n");
  }
  const json j = {{"step", state.step},
                  {"data_position", state.data_position},
                  {"seed", state.seed},
                  {"history",
                   {{"steps", state.history.steps},
                    {"loss", state.history.loss},
                    {"val_steps", state.history.val_steps},
                    {"val_loss", state.history.val_loss}}},
                  {"config", state.config_yaml}};
  io::write_file_atomically((tmp / kStateFile).string(), j.dump(2) + "\n");
  std::vector<fs::path> files;
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) files.push_back(it->path());
  RF_CHECK(!ec, tmp.string(), ": cannot list: ", ec.message());
  for (const fs::path& f : files) fsync_path(f, false);
  fsync_path(tmp, true);
  if (before_rename) before_rename(tmp.string());

  const fs::path final_dir = base / name_;
  const auto rename = [&](const fs::path& from, const fs::path& to) {
    fs::rename(from, to, ec);
    RF_CHECK(!ec, "cannot rename ", from.string(), " to ", to.string(), ": ", ec.message());
  };
  if (fs::exists(final_dir, ec)) {  // the same step saved by an earlier run: replace it as a whole
    const fs::path old = base / hidden_name(name_, ".old");
    rename(final_dir, old);
    rename(tmp, final_dir);
    renamed_ = true;
    fs::remove_all(old, ec);
    RF_CHECK(!ec, old.string(), ": cannot remove the replaced checkpoint: ", ec.message());
  } else {
    rename(tmp, final_dir);
    renamed_ = true;
  }
  fsync_path(base, true);

  const std::vector<fs::path> all = list_checkpoints(base);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    fs::remove_all(all[i], ec);
    RF_CHECK(!ec, all[i].string(), ": cannot remove (checkpoint.keep = ", keep, "): ", ec.message());
  }
  return final_dir.string();
}

std::string save_train_checkpoint(const std::string& root, const model::Checkpoint& weights, model::ParamStore& store,
                                  const TrainState& state, int keep,
                                  const std::function<void(const std::string&)>& before_rename,
                                  const model::SaveOptions& options) {
  RF_CHECK(!store.maps_frozen_weights(), "save_train_checkpoint: a LoRA store's files are PEFT's adapters, which its ",
           "training state writes (trainer/state/lora.cpp)");
  PendingCheckpoint pending(root, state.step);
  model::save_checkpoint(weights, store, pending.temp_dir(), options);
  write_moments_whole(pending.temp_dir(), store);  // one process: it holds them all
  return pending.finish(store, state, {}, keep, before_rename);
}

std::string checkpoint_path(const std::string& root, int64_t step) {
  return (fs::path(root) / step_name(step)).string();
}

std::string resolve_checkpoint(const std::string& dir_or_root) {
  const fs::path p(dir_or_root);
  std::error_code ec;
  if (fs::exists(p / kStateFile, ec)) return p.string();
  RF_CHECK(fs::is_directory(p, ec), "--resume ", dir_or_root, ": no such directory");
  const std::vector<fs::path> all = list_checkpoints(p);
  RF_CHECK(!all.empty(), "--resume ", dir_or_root, ": neither a checkpoint (no ", kStateFile,
           ") nor a directory holding any");
  return all.back().string();
}

LoadedCheckpoint load_train_checkpoint(const std::string& dir, const model::BeforeAllocating& before_allocating,
                                       bool train_vision, std::unique_ptr<model::ParamStore> store,
                                       const model::PlaceParams& place) {
  LoadedCheckpoint out;
  out.weights = model::load_checkpoint(dir, before_allocating, std::move(store), train_vision, place);
  out.state = load_train_state(dir);
  return out;
}

TrainState load_train_state(const std::string& dir) {
  TrainState out;
  const fs::path state_path = fs::path(dir) / kStateFile;
  const std::string where = state_path.string();
  const std::string text = read_text(state_path);
  io::check_json_text(text, where + ": ");
  json j;
  try {
    std::string duplicate;  // nlohmann would keep the last of two `step`s silently
    j = io::parse_tracking_duplicates(text, &duplicate);
    RF_CHECK(duplicate.empty(), where, ": the key `", duplicate, "` appears twice");
    TrainState& st = out;
    st.step = integer_in(j.at("step"), where, "step", 0, kMaxStateStep);
    st.data_position = integer_in(j.at("data_position"), where, "data_position", 0, kMaxDataPosition);
    const json& seed = j.at("seed");
    // json holds a number above int64's range as unsigned; the whole uint64 range is a seed.
    RF_CHECK(seed.is_number_unsigned() || (seed.is_number_integer() && seed.get<int64_t>() >= 0), where,
             ": `seed` = ", seed.dump(), " must be an integer in [0, ", std::numeric_limits<uint64_t>::max(), "]");
    st.seed = seed.get<uint64_t>();
    const json& h = j.at("history");
    st.history.steps = history_steps(h.at("steps"), where, "history.steps", st.step);
    st.history.loss = h.at("loss").get<std::vector<double>>();
    st.history.val_steps = history_steps(h.at("val_steps"), where, "history.val_steps", st.step);
    st.history.val_loss = h.at("val_loss").get<std::vector<double>>();
    // The loss picture reads the steps and the losses pairwise.
    RF_CHECK(st.history.loss.size() == st.history.steps.size(), where, ": `history.loss` has ", st.history.loss.size(),
             " entries but `history.steps` has ", st.history.steps.size());
    RF_CHECK(st.history.val_loss.size() == st.history.val_steps.size(), where, ": `history.val_loss` has ",
             st.history.val_loss.size(), " entries but `history.val_steps` has ", st.history.val_steps.size());
    st.config_yaml = j.at("config").get<std::string>();
  } catch (const json::exception& e) {
    rf::fail(where, ": not a valid trainer state: ", io::json_error_text(e.what()));
  }
  return out;
}

namespace {

// The sharded moments' layout (optimizer.json), checked against the store: the same trainable parameters in the same
// order and whole shapes (the same model.freeze), and files whose ranges tile [0, trainable_elements) in order. The
// files' layout is the whole tensors' (every expert's rows); a store holding a tensor's expert rows apart
// (ParamInfo::rows_begin: LoRA's placed adapters, model/lora_store.h) reads its rows of it.
struct MomentFile {
  std::string path;
  int64_t begin = 0, end = 0;
};
struct MomentFiles {
  std::vector<MomentFile> files;
  // [slots]: the files' index of the first element the store holds of a trainable slot (its train_offset when it
  // holds the whole tensor); -1 for a frozen one.
  std::vector<int64_t> whole_first;
};
MomentFiles read_moment_layout(const fs::path& dir, const model::ParamStore& store) {
  const fs::path path = dir / kMomentLayoutFile;
  const std::string where = path.string();
  const std::string text = read_text(path);
  io::check_json_text(text, where + ": ");
  MomentFiles out;
  out.whole_first.assign(store.size(), -1);
  try {
    std::string duplicate;
    const json j = io::parse_tracking_duplicates(text, &duplicate);
    RF_CHECK(duplicate.empty(), where, ": the key `", duplicate, "` appears twice");
    RF_CHECK(j.at("format") == kMomentFormat, where, ": `format` is ", j.at("format").dump(), ", not \"", kMomentFormat,
             "\"");
    const int64_t total =
        integer_in(j.at("trainable_elements"), where, "trainable_elements", 0, std::numeric_limits<int64_t>::max());
    const json& params = j.at("parameters");
    RF_CHECK(params.is_array(), where, ": `parameters` must be an array");
    size_t k = 0;
    int64_t whole_at = 0;  // the files' index of the parameter's first element
    for (size_t slot = 0; slot < store.size(); ++slot) {
      const model::ParamInfo& p = store.info(slot);
      if (!p.trainable) continue;
      const std::vector<int64_t> whole = p.whole_shape();
      RF_CHECK(k < params.size() && params[k].at("name") == p.name &&
                   params[k].at("shape").get<std::vector<int64_t>>() == whole &&
                   params[k].at("offset").get<int64_t>() == whole_at,
               where, ": the trainable parameters differ from this run's at `", p.name,
               "` (another model or model.freeze)");
      out.whole_first[slot] = whole_at + p.rows_begin * model::row_elements(p);
      whole_at += p.holds_part() ? p.rows_total * model::row_elements(p) : p.numel;
      ++k;
    }
    RF_CHECK(k == params.size() && total == whole_at, where, ": ", params.size(), " trainable parameters of ", total,
             " elements, this run trains ", k, " of ", whole_at);
    const json& files = j.at("files");
    RF_CHECK(files.is_array() && !files.empty(), where, ": `files` must be a non-empty array");
    int64_t at = 0;
    for (const json& f : files) {
      const std::string name = f.at("file").get<std::string>();
      // Files sit beside the layout; a path that leaves the folder is a corrupt or hostile layout.
      RF_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", where,
               ": `files` names `", name, "`, not a file of the checkpoint folder");
      const int64_t begin = integer_in(f.at("begin"), where, "files.begin", 0, total);
      const int64_t end = integer_in(f.at("end"), where, "files.end", begin, total);
      RF_CHECK(begin == at, where, ": `", name, "` begins at ", begin, ", the files before it end at ", at);
      out.files.push_back({(dir / name).string(), begin, end});
      at = end;
    }
    RF_CHECK(at == total, where, ": the files end at ", at, " of ", total, " elements");
  } catch (const json::exception& e) {
    rf::fail(where, ": not a valid optimizer layout: ", io::json_error_text(e.what()));
  }
  return out;
}

// One sharded moment file, opened and checked to hold the range the layout gives it: the file's own `begin` and `end`
// (write_moments_shard) must be the layout's, or two files of equal length swapped or copied over each other would
// load each other's moments without a word.
io::SafetensorsFile open_moment_file(const MomentFile& file) {
  io::SafetensorsFile f = io::SafetensorsFile::open(file.path);
  const auto& meta = f.metadata();
  const auto at = [&](const char* key) {
    const auto it = meta.find(key);
    return it == meta.end() ? std::string("none") : it->second;
  };
  RF_CHECK(at("begin") == std::to_string(file.begin) && at("end") == std::to_string(file.end), file.path,
           ": holds elements ", at("begin"), " to ", at("end"), " of the trainable layout, optimizer.json gives it ",
           file.begin, " to ", file.end);
  return f;
}

// The part of the store's moment range that one sharded moment file holds, read into the store (the file opened only
// when it holds some), checked finite (and the second moments non-negative) with the parameter and index named.
void read_moment_file(const MomentFile& file, const MomentFiles& layout, model::ParamStore& store) {
  const model::Shard range = store.moment_range();
  std::optional<io::SafetensorsFile> f;
  for (const model::ParamStore::Segment& seg : store.trainable_segments(range.begin, range.end)) {
    const int64_t at = layout.whole_first[seg.slot] + seg.first;  // the files' index of the segment's first element
    const int64_t lo = std::max(at, file.begin), hi = std::min(at + seg.n, file.end);
    if (lo >= hi) continue;
    if (!f) f.emplace(open_moment_file(file));
    const model::ParamInfo& p = store.info(seg.slot);
    for (auto [name, role] : {std::pair{kExpAvg, model::Role::ExpAvg}, {kExpAvgSq, model::Role::ExpAvgSq}}) {
      const io::TensorView& v = f->at(name);
      RF_CHECK(v.dtype == io::StDType::F32 && v.shape == std::vector<int64_t>{file.end - file.begin}, file.path, ": `",
               name, "` is not float32 [", file.end - file.begin, "] (elements ", file.begin, " to ", file.end,
               " of the trainable layout, optimizer.json)");
      // Unaligned bytes in general (tensor_access.h): copied out one segment at a time.
      std::vector<float> values(static_cast<size_t>(hi - lo));
      std::memcpy(values.data(), v.bytes.data() + (lo - file.begin) * int64_t{sizeof(float)},
                  values.size() * sizeof(float));
      for (size_t i = 0; i < values.size(); ++i) {
        const float x = values[i];
        // AdamW divides by sqrt(exp_avg_sq) + eps: a negative one is NaN in the first update.
        if (std::isfinite(x) && (role == model::Role::ExpAvg || x >= 0)) continue;
        rf::fail(file.path, ": `", name, "` of `", p.name, "` has ", x, " at ",
                 io::index_string(seg.first + (lo - at) + static_cast<int64_t>(i), p.shape),
                 std::isfinite(x) ? " (a second moment is never negative)" : "");
      }
      std::copy(values.begin(), values.end(),
                store.mutable_flat(role).data() + (seg.train_index + (lo - at) - range.begin));
    }
  }
}

}  // namespace

void load_moments_into(const std::string& dir, const model::ParamStore& layout, std::span<const MomentTarget> targets) {
  std::error_code ec;
  // `what` names the values as the files do; `first`: their first element in the parameter's whole tensor.
  const auto check = [](const std::string& file, const std::string& what, const model::ParamInfo& p, int64_t first,
                        std::span<const float> values, bool second) {
    for (size_t i = 0; i < values.size(); ++i) {
      const float x = values[i];
      // AdamW divides by sqrt(exp_avg_sq) + eps: a negative one is NaN in the first update.
      if (std::isfinite(x) && (!second || x >= 0)) continue;
      rf::fail(file, ": ", what, " has ", x, " at ", io::index_string(first + static_cast<int64_t>(i), p.whole_shape()),
               std::isfinite(x) ? " (a second moment is never negative)" : "");
    }
  };
  if (fs::exists(fs::path(dir) / kMomentLayoutFile, ec)) {
    const std::vector<MomentFile> files = read_moment_layout(dir, layout).files;
    std::vector<std::optional<io::SafetensorsFile>> opened(files.size());  // each opened when first needed
    for (const MomentTarget& t : targets) {
      const model::ParamInfo& p = layout.info(t.slot);
      RF_CHECK(p.trainable && t.first >= 0 && t.first + t.n <= p.numel, "load_moments_into: elements [", t.first, ", ",
               t.first + t.n, ") of ", p.name, " (", p.numel, " elements, trainable: ", p.trainable, ")");
      const int64_t begin = p.train_offset + t.first, end = begin + t.n;  // in the files' trainable layout
      for (size_t k = 0; k < files.size(); ++k) {
        const MomentFile& file = files[k];
        const int64_t lo = std::max(begin, file.begin), hi = std::min(end, file.end);
        if (lo >= hi) continue;
        if (!opened[k]) opened[k].emplace(open_moment_file(file));
        for (const auto& [name, dst, second] :
             {std::tuple{kExpAvg, t.exp_avg, false}, {kExpAvgSq, t.exp_avg_sq, true}}) {
          const io::TensorView& v = opened[k]->at(name);
          RF_CHECK(v.dtype == io::StDType::F32 && v.shape == std::vector<int64_t>{file.end - file.begin}, file.path,
                   ": `", name, "` is not float32 [", file.end - file.begin, "] (elements ", file.begin, " to ",
                   file.end, " of the trainable layout, optimizer.json)");
          float* out = dst + (lo - begin);
          std::memcpy(out, v.bytes.data() + (lo - file.begin) * int64_t{sizeof(float)},
                      static_cast<size_t>(hi - lo) * sizeof(float));
          check(file.path, rf::concat("`", name, "` of `", p.name, "`"), p, lo - p.train_offset,
                {out, static_cast<size_t>(hi - lo)}, second);
        }
      }
    }
    return;
  }
  const std::string path = (fs::path(dir) / kOptimizerFile).string();
  const io::SafetensorsFile f = io::SafetensorsFile::open(path);
  for (const MomentTarget& t : targets) {
    const model::ParamInfo& p = layout.info(t.slot);
    RF_CHECK(p.trainable && t.first >= 0 && t.first + t.n <= p.numel, "load_moments_into: elements [", t.first, ", ",
             t.first + t.n, ") of ", p.name, " (", p.numel, " elements, trainable: ", p.trainable, ")");
    for (const auto& [prefix, dst, second] :
         {std::tuple{"exp_avg.", t.exp_avg, false}, {"exp_avg_sq.", t.exp_avg_sq, true}}) {
      const std::string name = prefix + p.name;
      const io::TensorView& v = f.at(name);
      RF_CHECK(v.dtype == io::StDType::F32 && v.shape == p.whole_shape(), path, ": `", name,
               "` is not float32 of the parameter's shape ", io::shape_string(p.whole_shape()));
      std::memcpy(dst, v.bytes.data() + t.first * int64_t{sizeof(float)}, static_cast<size_t>(t.n) * sizeof(float));
      check(path, rf::concat("tensor `", name, "`"), p, t.first, {dst, static_cast<size_t>(t.n)}, second);
    }
  }
}

void load_optimizer_state(const std::string& dir, model::ParamStore& store) {
  std::error_code ec;
  const bool holds_rows =
      std::any_of(store.infos().begin(), store.infos().end(), [](const model::ParamInfo& p) { return p.holds_part(); });
  if (holds_rows) {
    // Expert rows held apart: the files hold whole tensors in the whole trainable layout; each of this store's
    // moment elements is read from where its rows lie there.
    const std::unique_ptr<model::ParamStore> layout = model::whole_registry(store);
    store.allocate_moments();
    const model::Shard range = store.moment_range();
    float* const m = store.mutable_flat(model::Role::ExpAvg).data();
    float* const v = store.mutable_flat(model::Role::ExpAvgSq).data();
    std::vector<MomentTarget> targets;
    for (const model::ParamStore::Segment& seg : store.trainable_segments(range.begin, range.end)) {
      const model::ParamInfo& p = store.info(seg.slot);
      const int64_t at = seg.train_index - range.begin;
      targets.push_back({seg.slot, p.rows_begin * model::row_elements(p) + seg.first, seg.n, m + at, v + at});
    }
    load_moments_into(dir, *layout, targets);
    return;
  }
  if (fs::exists(fs::path(dir) / kMomentLayoutFile, ec)) {
    const MomentFiles layout = read_moment_layout(dir, store);
    store.allocate_moments();
    for (const MomentFile& file : layout.files) read_moment_file(file, layout, store);
    return;
  }
  const std::string path = (fs::path(dir) / kOptimizerFile).string();
  const io::SafetensorsFile f = io::SafetensorsFile::open(path);
  store.allocate_moments();
  for (auto [prefix, role] : {std::pair{"exp_avg.", model::Role::ExpAvg}, {"exp_avg_sq.", model::Role::ExpAvgSq}}) {
    for (size_t i = 0; i < store.size(); ++i) {
      const model::ParamInfo& p = store.info(i);
      if (!p.trainable) continue;  // frozen: no moments (older checkpoints stored zeros; ignored)
      const model::Shard range = store.moment_range();
      const int64_t lo = std::max(range.begin, p.train_offset), hi = std::min(range.end, p.train_offset + p.numel);
      if (lo >= hi) continue;  // none of it in this rank's range: not even read
      const io::TensorView& v = f.at(prefix + p.name);
      // The file holds the whole tensor; a store holding expert rows apart (model/expert_store.h) keeps its rows.
      const std::vector<int64_t> whole = p.whole_shape();
      RF_CHECK(v.dtype == io::StDType::F32 && v.shape == whole, path, ": `", prefix, p.name,
               "` is not float32 of the parameter's shape ", io::shape_string(whole));
      const std::vector<float> values = io::copy_as<float>(v);
      // AdamW divides by sqrt(exp_avg_sq) + eps: a negative one is NaN in the first update.
      check_loaded_tensor(path, prefix + p.name, values, whole, role == model::Role::ExpAvgSq);
      // The part of the tensor inside the store's moment range (all of it, or this rank's shard: a checkpoint
      // written at any rank count and shard mode resumes at any other).
      const int64_t held_at = p.rows_begin * model::row_elements(p);
      std::copy_n(values.data() + held_at + (lo - p.train_offset), hi - lo,
                  store.mutable_flat(role).data() + (lo - range.begin));
    }
  }
}

}  // namespace rf::trainer
