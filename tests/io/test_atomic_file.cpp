// io::AtomicFile and friends: a file is replaced only by a complete, synced new one; a failed or abandoned write
// leaves the previous file (or nothing) and no temporary; outputs are checked before any work.
// Failures are real ones: a file size limit (RLIMIT_FSIZE, the "size limit" of the issue) makes write() fail with
// EFBIG part way, exactly like a full disk does with ENOSPC.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/error_of.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"

namespace rf::io {
namespace {

using rf::testing::error_of;

namespace fs = std::filesystem;

// A fresh empty directory per test, removed afterwards.
class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "rf_atomic_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string at(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Limits the size of files this process writes for the scope; SIGXFSZ is ignored so write() fails with EFBIG
// instead of the process being killed.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit r = saved_;
    r.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &r);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_{};
  void (*old_handler_)(int) = nullptr;
};

constexpr rlim_t kLimit = 4096;
const std::string kBig(3 * kLimit, 'x');  // a write that crosses the limit part way

TEST_F(AtomicFileTest, CommitWritesTheWholeFileAndNoTemporaryRemains) {
  write_file_atomically(at("a.json"), "{\"ranks\": []}\n");
  EXPECT_EQ(read_all(at("a.json")), "{\"ranks\": []}\n");
  EXPECT_EQ(entries(), std::vector<std::string>{"a.json"});
}

TEST_F(AtomicFileTest, AbandonedWriteLeavesThePreviousFileAndNoTemporary) {
  write_file_atomically(at("out"), "good");
  {
    AtomicFile f(at("out"));
    f.write(std::string_view("partial"));
    EXPECT_EQ(read_all(at("out")), "good") << "the destination changes only at commit";
  }
  EXPECT_EQ(read_all(at("out")), "good");
  EXPECT_EQ(entries(), std::vector<std::string>{"out"});
}

TEST_F(AtomicFileTest, AFailedWriteKeepsThePreviousFile) {
  write_file_atomically(at("out.safetensors"), "previous good output");
  std::string message;
  {
    const FileSizeLimit limit(kLimit);
    message = error_of([&] { write_file_atomically(at("out.safetensors"), kBig); });
  }
  EXPECT_NE(message.find("out.safetensors: write failed: File too large"), std::string::npos) << message;
  EXPECT_EQ(read_all(at("out.safetensors")), "previous good output");
  EXPECT_EQ(entries(), std::vector<std::string>{"out.safetensors"});
}

TEST_F(AtomicFileTest, SafetensorsWriterIsAtomic) {
  write_file_atomically(at("t.safetensors"), "previous");
  const std::vector<float> values(4 * kLimit, 1.f);
  SafetensorsWriter w;
  w.add("x", StDType::F32, {static_cast<int64_t>(values.size())}, std::span<const float>(values));
  {
    const FileSizeLimit limit(kLimit);
    EXPECT_NE(error_of([&] { w.write(at("t.safetensors")); }).find("write failed"), std::string::npos);
  }
  EXPECT_EQ(read_all(at("t.safetensors")), "previous");
  w.write(at("t.safetensors"));
  EXPECT_EQ(SafetensorsFile::open(at("t.safetensors")).at("x").bytes.size(), values.size() * sizeof(float));
  EXPECT_EQ(entries(), std::vector<std::string>{"t.safetensors"});
}

// One job, all or nothing: the second file fails, so the first (already complete) is not committed either.
TEST_F(AtomicFileTest, CommitAllRenamesNothingWhenOneFileFails) {
  std::string message;
  {
    AtomicFile out(at("out.safetensors")), stats(at("stats.json"));
    out.write(std::string_view("small main output"));
    const FileSizeLimit limit(kLimit);
    message = error_of([&] {
      stats.write(std::string_view(kBig));
      AtomicFile* files[] = {&out, &stats};
      commit_all(files);
    });
  }
  EXPECT_NE(message.find("stats.json: write failed"), std::string::npos) << message;
  EXPECT_TRUE(entries().empty()) << "left behind: " << entries().front();
}

TEST_F(AtomicFileTest, KeepsTheReplacedFilesPermissions) {
  write_file_atomically(at("f"), "1");
  ASSERT_EQ(::chmod(at("f").c_str(), 0640), 0);
  write_file_atomically(at("f"), "2");
  struct stat st {};
  ASSERT_EQ(::stat(at("f").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
}

TEST_F(AtomicFileTest, ASymbolicLinkIsFollowed) {
  write_file_atomically(at("real"), "old");
  fs::create_symlink(at("real"), at("link"));
  write_file_atomically(at("link"), "new");
  EXPECT_TRUE(fs::is_symlink(at("link")));
  EXPECT_EQ(read_all(at("real")), "new");
}

TEST_F(AtomicFileTest, CheckWritableNamesTheProblemAndCreatesNothing) {
  check_writable(at("new.safetensors"));
  EXPECT_TRUE(entries().empty());
  fs::create_directory(at("sub"));
  EXPECT_NE(error_of([&] { check_writable(at("sub")); }).find("sub: cannot write: it is a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_writable(at("missing/out")); }).find("No such file or directory"), std::string::npos);
  write_file_atomically(at("plain"), "x");
  EXPECT_NE(error_of([&] { check_writable(at("plain/out")); }).find("Not a directory"), std::string::npos);
  ASSERT_EQ(::mkfifo(at("fifo").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { check_writable(at("fifo")); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([&] { AtomicFile f(at("fifo")); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([&] { check_writable(""); }).find("empty"), std::string::npos);
}

TEST_F(AtomicFileTest, SameDestination) {
  fs::create_directory(at("d"));
  EXPECT_TRUE(same_destination(at("d/x.json"), at("d/./x.json")));
  EXPECT_TRUE(same_destination(at("d/x.json"), at("d/../d/x.json")));
  EXPECT_FALSE(same_destination(at("d/x.json"), at("d/y.json")));
  write_file_atomically(at("d/x.json"), "1");
  fs::create_symlink(at("d/x.json"), at("alias"));
  EXPECT_TRUE(same_destination(at("alias"), at("d/x.json")));
}

}  // namespace
}  // namespace rf::io
