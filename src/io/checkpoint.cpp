// ringflex io: opening a Hugging Face checkpoint folder (see checkpoint.h).
#include "io/checkpoint.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_text.h"

namespace rf::io {

namespace {

using nlohmann::json;

// The index's weight_map: tensor name -> shard file name, validated.
std::map<std::string, std::string> read_weight_map(const std::string& path) {
  // A FIFO or device would block the read forever, a huge file would be read whole: an index is a small regular file.
  const std::string body = read_config_file(path, "a checkpoint index");
  check_json_text(body, path + ": ");
  std::string duplicate;  // a tensor mapped twice, to two shards maybe, is refused
  json index;
  try {
    index = parse_tracking_duplicates(body, &duplicate);
  } catch (const json::parse_error& e) {
    fail(path, ": not valid JSON (at byte ", e.byte, ")");
  }
  RF_CHECK(duplicate.empty(), path, ": the key `", duplicate, "` appears twice");
  RF_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), path,
           ": no `weight_map` object");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    RF_CHECK(file.is_string(), path, ": `weight_map` entry `", name, "` is not a file name");
    const std::string shard = file.get<std::string>();
    // Shards sit beside the index; a path that leaves the folder is a corrupt or hostile index.
    const std::filesystem::path p(shard);
    RF_CHECK(!shard.empty() && p.is_relative() && p.lexically_normal().string().rfind("..", 0) != 0, path,
             ": `weight_map` entry `", name, "` names `", shard, "`, outside the checkpoint folder");
    // One file, one spelling: `./a.safetensors` and `a.safetensors` must open the same shard once.
    map.emplace(name, p.lexically_normal().string());
  }
  return map;
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint c;
  c.dir_ = dir;
  const fs::path index_path = fs::path(dir) / kIndexFile;
  std::error_code ec;
  const bool indexed = fs::exists(index_path, ec);
  // A symlink loop or an unreadable folder must not pass for "no index" and send the load to a single file.
  RF_CHECK(!ec, index_path.string(), ": ", ec.message());
  if (!indexed) {
    c.shards_.push_back(SafetensorsFile::open((fs::path(dir) / kSingleFile).string()));
  } else {
    const std::map<std::string, std::string> weight_map = read_weight_map(index_path.string());
    std::map<std::string, size_t> shard_of_file;
    for (const auto& [name, file] : weight_map) {
      if (shard_of_file.contains(file)) continue;
      shard_of_file.emplace(file, c.shards_.size());
      c.shards_.push_back(SafetensorsFile::open((fs::path(dir) / file).string()));
    }
    for (const auto& [name, file] : weight_map) {
      const SafetensorsFile& shard = c.shards_[shard_of_file.at(file)];
      RF_CHECK(shard.find(name), index_path.string(), ": tensor `", name, "` is mapped to ", shard.path(),
               ", which does not hold it");
    }
  }
  for (size_t s = 0; s < c.shards_.size(); ++s) {
    for (const TensorView& v : c.shards_[s].tensors()) {
      const auto [it, inserted] = c.shard_index_.emplace(v.name, s);
      RF_CHECK(inserted, dir, ": tensor `", v.name, "` is in two shards, ", c.shards_[it->second].path(), " and ",
               c.shards_[s].path());
    }
  }
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, shard] : shard_index_) out.push_back(name);
  return out;
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const auto it = shard_index_.find(name);
  return it == shard_index_.end() ? nullptr : shards_[it->second].find(name);
}

const SafetensorsFile& Checkpoint::shard_of(std::string_view name) const {
  const auto it = shard_index_.find(name);
  RF_CHECK(it != shard_index_.end(), dir_, ": no tensor `", name, "` in the checkpoint");
  return shards_[it->second];
}

void Checkpoint::release_pages() const {
  for (const SafetensorsFile& f : shards_) f.release_pages();
}

}  // namespace rf::io
