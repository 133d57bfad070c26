// ringflex io: a Hugging Face checkpoint folder's tensors, across its safetensors shards.
//
// A checkpoint is either one `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` listed by
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {tensor name: shard file}}). Every shard is
// mapped and validated at open (SafetensorsFile), and the index is checked against them: each mapped tensor must
// be in the shard the index names, and no tensor may appear in two shards, so a half-copied checkpoint fails at
// open with its file named rather than midway through loading a model.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"

namespace rf::io {

class Checkpoint {
 public:
  static constexpr std::string_view kSingleFile = "model.safetensors";
  static constexpr std::string_view kIndexFile = "model.safetensors.index.json";

  // Opens `dir`: the index and its shards if the index exists, else the single file. Throws rf::Error naming
  // the file and the problem.
  static Checkpoint open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // every tensor, sorted

  // nullptr when no shard holds `name`.
  const TensorView* find(std::string_view name) const;
  // The shard holding `name` (for io::require, whose messages then name the shard); throws rf::Error
  // "<dir>: no tensor `name` in the checkpoint" when none does.
  const SafetensorsFile& shard_of(std::string_view name) const;
  // SafetensorsFile::release_pages of every shard.
  void release_pages() const;

 private:
  std::string dir_;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, size_t, std::less<>> shard_index_;  // tensor name -> position in shards_
};

}  // namespace rf::io
