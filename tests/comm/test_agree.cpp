// Tests of rank agreement (src/comm/agree.h) on the loopback communicator, P ranks as threads: whichever ranks
// fail, every rank throws the lowest failing rank's message, and nobody is left waiting. The oracle is the
// rank numbers each case makes fail.
#include <gtest/gtest.h>

#include <mutex>
#include <stdexcept>
#include <vector>

#include "comm/agree.h"
#include "comm/loopback_comm.h"

namespace rf::comm {
namespace {

// Runs agree() on P ranks, `fails(rank)` deciding which throw; returns what each rank caught ("" for none).
std::vector<std::string> agree_on(int P, const std::function<bool(int)>& fails) {
  std::vector<std::string> caught(static_cast<size_t>(P), "unset");
  std::mutex m;
  comm::run_ranks(P, [&](comm::Communicator& c) {
    std::string what;
    try {
      agree(c, [&] { RF_CHECK(!fails(c.rank()), "rank ", c.rank(), " cannot read in.safetensors"); });
    } catch (const AgreedError& e) {
      what = e.what();
    }
    std::lock_guard lock(m);
    caught[static_cast<size_t>(c.rank())] = what;
  });
  return caught;
}

TEST(Agree, NoFailureThrowsNowhere) {
  for (int P : {1, 2, 5}) EXPECT_EQ(agree_on(P, [](int) { return false; }), std::vector<std::string>(P, "")) << P;
}

TEST(Agree, EveryRankReportsTheLowestFailingRank) {
  for (int P : {1, 3, 8}) {
    const int last = P - 1;
    // Some ranks failing: the line names the rank; every rank failing: the job's line, without a rank.
    const std::string where = P > 1 ? "rank " + std::to_string(last) + ": " : "";
    EXPECT_EQ(agree_on(P, [&](int r) { return r == last; }),
              std::vector<std::string>(P, where + "rank " + std::to_string(last) + " cannot read in.safetensors"))
        << P;
    EXPECT_EQ(agree_on(P, [](int r) { return r % 2 == 1 || r == 0; }),
              std::vector<std::string>(P, (P > 1 ? "rank 0: " : "") + std::string("rank 0 cannot read in.safetensors")))
        << P;
    EXPECT_EQ(agree_on(P, [](int) { return true; }), std::vector<std::string>(P, "rank 0 cannot read in.safetensors"))
        << P;
  }
}

// Any library's exception, not only rf::Error, fails every rank alike (yaml-cpp, json and std::filesystem throw
// their own; a bad_alloc on one rank must not leave the others waiting).
TEST(Agree, AnyStdExceptionIsAgreed) {
  std::vector<std::string> caught(3);
  std::mutex m;
  comm::run_ranks(3, [&](comm::Communicator& c) {
    std::string what;
    try {
      agree(c, [&] {
        if (c.rank() == 1) throw std::runtime_error("yaml-cpp: bad conversion");
      });
    } catch (const AgreedError& e) {
      what = e.what();
    }
    std::lock_guard lock(m);
    caught[static_cast<size_t>(c.rank())] = what;
  });
  EXPECT_EQ(caught, std::vector<std::string>(3, "rank 1: yaml-cpp: bad conversion"));
}

TEST(Agree, EqualValuesPassAndDifferentOnesFailEverywhere) {
  std::vector<std::string> caught(4);
  std::mutex m;
  comm::run_ranks(4, [&](comm::Communicator& c) {
    const int64_t same[] = {2, 8, 1024};
    agree_equal(c, same, "the input's shapes");
    std::string what;
    const int64_t differs[] = {2, c.rank() == 2 ? 9 : 8, 1024};
    try {
      agree_equal(c, differs, "the input's shapes");
    } catch (const AgreedError& e) {
      what = e.what();
    }
    std::lock_guard lock(m);
    caught[static_cast<size_t>(c.rank())] = what;
  });
  EXPECT_EQ(caught, std::vector<std::string>(4, "ranks disagree on the input's shapes"));
}

// The command line: identical ones pass; one option more on one rank (and command lines of different lengths,
// which an allgather of unequal sizes would truncate) is the same AgreedError on every rank, quoting both.
TEST(Agree, CommandLinesMustBeIdentical) {
  const std::vector<std::string> base = {"attn", "--in", "in.st", "--out", "out.st"};
  std::vector<std::string> with_stats = base;
  with_stats.insert(with_stats.end(), {"--stats", "s.json"});
  std::vector<std::string> caught(3, "unset");
  std::mutex m;
  comm::run_ranks(3, [&](comm::Communicator& c) {
    agree_command_line(c, base);
    std::string what;
    try {
      agree_command_line(c, c.rank() == 2 ? with_stats : base);
    } catch (const AgreedError& e) {
      what = e.what();
    }
    std::lock_guard lock(m);
    caught[static_cast<size_t>(c.rank())] = what;
  });
  const std::string want =
      "ranks were started with different options (every rank needs the same command line): rank 0 has `attn --in "
      "in.st --out out.st`, rank 2 has `attn --in in.st --out out.st --stats s.json`";
  EXPECT_EQ(caught, std::vector<std::string>(3, want));
}

}  // namespace
}  // namespace rf::comm
