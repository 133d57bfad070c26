// Tests of src/io/checkpoint: a Hugging Face checkpoint folder, single-file and sharded, and each way its index
// and shards can disagree. The oracle is the tensors the test wrote into each shard.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error_of.h"
#include "core/error.h"
#include "io/checkpoint.h"

namespace rf::io {
namespace {

using rf::testing::error_of;

namespace fs = std::filesystem;

// A fresh, empty folder under the temp directory, removed when the test ends.
class TempDir {
 public:
  explicit TempDir(const std::string& name) : path_(fs::temp_directory_path() / ("rf_io_" + name)) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

const std::vector<float> kValues = {1.f, 2.f, 3.f};

void write_shard(const std::string& path, const std::vector<std::string>& names) {
  SafetensorsWriter w;
  for (const std::string& n : names) w.add(n, StDType::F32, {3}, std::span<const float>(kValues));
  w.write(path);
}

void write_index(const std::string& path, const std::string& weight_map) {
  std::ofstream(path) << R"({"metadata": {"total_size": 36}, "weight_map": )" << weight_map << "}";
}

TEST(Checkpoint, OpensASingleFile) {
  TempDir dir("single");
  write_shard(dir.file("model.safetensors"), {"a.weight", "b.weight"});
  const Checkpoint c = Checkpoint::open(dir.str());
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a.weight", "b.weight"}));
  ASSERT_NE(c.find("b.weight"), nullptr);
  EXPECT_EQ(c.find("b.weight")->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(c.find("c.weight"), nullptr);
  EXPECT_EQ(c.shard_of("a.weight").path(), dir.file("model.safetensors"));
  EXPECT_NE(error_of([&] { c.shard_of("c.weight"); }).find(": no tensor `c.weight` in the checkpoint"),
            std::string::npos);
}

TEST(Checkpoint, OpensShardsThroughTheIndex) {
  TempDir dir("sharded");
  write_shard(dir.file("model-00001-of-00002.safetensors"), {"a", "b"});
  write_shard(dir.file("model-00002-of-00002.safetensors"), {"c"});
  write_index(dir.file("model.safetensors.index.json"),
              R"({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"})");
  const Checkpoint c = Checkpoint::open(dir.str());
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a", "b", "c"}));
  // One shard spelled two ways is one shard (transformers loads such an index).
  write_index(dir.file("model.safetensors.index.json"),
              R"({"a": "./model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"})");
  EXPECT_EQ(Checkpoint::open(dir.str()).names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(c.shard_of("c").path(), dir.file("model-00002-of-00002.safetensors"));
  const TensorView* a = c.find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->bytes.size(), kValues.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(a->bytes.data(), kValues.data(), a->bytes.size()), 0);
}

TEST(Checkpoint, RejectsInconsistentFolders) {
  TempDir dir("bad");
  EXPECT_NE(error_of([&] { Checkpoint::open(dir.str()); }).find("model.safetensors: cannot open"), std::string::npos);

  write_shard(dir.file("s1.safetensors"), {"a", "b"});
  write_shard(dir.file("s2.safetensors"), {"b"});
  const std::string index = dir.file("model.safetensors.index.json");
  struct Case {
    std::string weight_map, message;
  };
  const std::vector<Case> cases = {
      {R"({"a": "s1.safetensors", "z": "s1.safetensors"})",
       "tensor `z` is mapped to " + dir.file("s1.safetensors") + ", which does not hold it"},
      {R"({"a": "s1.safetensors", "b": "s2.safetensors"})", "tensor `b` is in two shards"},
      {R"({"a": "missing.safetensors"})", "missing.safetensors: cannot open"},
      {R"({"a": "../s1.safetensors"})", "names `../s1.safetensors`, outside the checkpoint folder"},
      {R"({"a": "/etc/passwd"})", "outside the checkpoint folder"},
      {R"({"a": 3})", "`weight_map` entry `a` is not a file name"},
      {R"([])", "no `weight_map` object"},
      // nlohmann would keep the second silently and never open s2.safetensors.
      {R"({"a": "s2.safetensors", "a": "s1.safetensors"})", "the key `a` appears twice"},
  };
  for (const Case& c : cases) {
    write_index(index, c.weight_map);
    const std::string message = error_of([&] { Checkpoint::open(dir.str()); });
    EXPECT_NE(message.find(c.message), std::string::npos) << c.weight_map << ": got \"" << message << "\"";
  }
  std::ofstream(index) << "{not json";
  EXPECT_NE(error_of([&] { Checkpoint::open(dir.str()); }).find("model.safetensors.index.json: not valid JSON"),
            std::string::npos);
}

// An index the loader cannot read is an error naming the index, never "no index" (which would send the load to a
// model.safetensors that is not there) and never a wait: a FIFO blocks a plain read forever.
TEST(Checkpoint, RejectsAnIndexThatIsNoFile) {
  TempDir dir("index_not_a_file");
  write_shard(dir.file("s1.safetensors"), {"a"});
  const std::string index = dir.file("model.safetensors.index.json");
  fs::create_symlink("loop", index);
  fs::create_symlink("model.safetensors.index.json", dir.file("loop"));
  EXPECT_NE(error_of([&] { Checkpoint::open(dir.str()); }).find(index + ": Too many levels of symbolic links"),
            std::string::npos);
  fs::remove(index);
  ASSERT_EQ(mkfifo(index.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { Checkpoint::open(dir.str()); }).find(index + ": not a regular file"), std::string::npos);
  fs::remove(index);
  fs::create_directory(index);
  EXPECT_NE(error_of([&] { Checkpoint::open(dir.str()); }).find(index + ": not a regular file"), std::string::npos);
}

}  // namespace
}  // namespace rf::io
