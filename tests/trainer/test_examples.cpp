// Every shipped example config parses; the two tiny ones also pass validation at the rank count they name (the
// templates name model files that only exist on the machines they describe).
#include <gtest/gtest.h>

#include <filesystem>

#include "trainer/config.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;

TEST(Examples, ParseAndTheTinyOnesValidate) {
  const fs::path dir = fs::path(RINGFLEX_SOURCE_DIR) / "examples";
  // The examples name their data relative to the repository's root, where their comments run them.
  const fs::path was = fs::current_path();
  fs::current_path(RINGFLEX_SOURCE_DIR);
  int seen = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".yaml") continue;
    ++seen;
    const TrainConfig c = load_config(e.path().string());
    if (e.path().filename().string().find("tiny") != std::string::npos) {
      EXPECT_NO_THROW(validate(c, c.parallelism.cp * c.parallelism.dp)) << e.path();
    }
  }
  fs::current_path(was);
  EXPECT_EQ(seen, 10);  // every example parsed: a new one is counted here
}

}  // namespace
}  // namespace rf::trainer
