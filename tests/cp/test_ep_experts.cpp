// Expert parallelism's dispatch (cp/ep_experts.h) on the loopback backend (ranks as threads), at P = 1..4 over 12
// experts: rows whose values name their source rank, expert, row and column arrive in the received layout (by
// source, then the owner's experts in order, each expert's rows in the sender's order), and combine returns each
// row, as the owner changed it, to the slot it left; the counts of every rank/expert pair vary, zeros included,
// and one routing sends every row of every rank to expert 0. Oracle: the layouts computed by hand from the counts.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/loopback_comm.h"
#include "core/error.h"
#include "cp/ep_experts.h"

namespace rf::cp {
namespace {

constexpr int64_t kExperts = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int64_t kWidth = 3;

// A row's values: distinct for every (source, expert, row, column), exact in float32.
float value(int64_t source, int64_t expert, int64_t row, int64_t col) {
  return static_cast<float>(((source * kExperts + expert) * 64 + row) * kWidth + col);
}

using Counts = int64_t (*)(int64_t source, int64_t expert);

void check_round_trip(int P, Counts counts) {
  comm::run_ranks(P, [&](comm::Communicator& w) {
    EpExperts ep(w);
    const int64_t r = w.rank();
    ExpertRouting routing;
    routing.experts = kExperts;
    std::vector<float> sent;
    for (int64_t e = 0; e < kExperts; ++e) {
      routing.sent.push_back(counts(r, e));
      for (int64_t i = 0; i < counts(r, e); ++i)
        for (int64_t c = 0; c < kWidth; ++c) sent.push_back(value(r, e, i, c));
    }
    ep.route(routing);
    const int64_t here = kExperts / P, first = r * here;
    ASSERT_EQ(routing.received.size(), static_cast<size_t>(P * here));
    std::vector<float> expected;
    for (int64_t s = 0; s < P; ++s)
      for (int64_t le = 0; le < here; ++le) {
        EXPECT_EQ(routing.received[static_cast<size_t>(s * here + le)], counts(s, first + le));
        for (int64_t i = 0; i < counts(s, first + le); ++i)
          for (int64_t c = 0; c < kWidth; ++c) expected.push_back(value(s, first + le, i, c));
      }
    std::vector<float> received(static_cast<size_t>(routing.received_rows() * kWidth));
    ep.dispatch(routing, sent.data(), received.data(), kWidth);
    EXPECT_EQ(received, expected) << "rank " << r;
    for (float& x : received) x = -x;  // the owner's work: each row changed where it lies
    std::vector<float> back(sent.size());
    ep.combine(routing, received.data(), back.data(), kWidth);
    for (size_t i = 0; i < sent.size(); ++i) ASSERT_EQ(back[i], -sent[i]) << "rank " << r << ", element " << i;
    // The posted halves place the same bytes: a dispatch and a combine started, progressed and finished.
    std::vector<float> posted(received.size()), posted_back(sent.size());
    ep.start_dispatch(routing, sent.data(), posted.data(), kWidth);
    ep.progress_dispatch();
    ep.finish_dispatch();
    EXPECT_EQ(posted, expected) << "rank " << r;
    ep.start_combine(routing, received.data(), posted_back.data(), kWidth);
    ep.progress_combine();
    ep.finish_combine();
    EXPECT_EQ(posted_back, back) << "rank " << r;
    int64_t leaving = 0;
    for (int64_t e = 0; e < kExperts; ++e)
      if (e / here != r) leaving += counts(r, e);
    EXPECT_EQ(ep.traffic().rows_sent, leaving);
  });
}

TEST(EpExperts, RowsArriveByTheCountsAndReturnWhereTheyLeft) {
  for (int P = 1; P <= 4; ++P) {
    SCOPED_TRACE("P = " + std::to_string(P));
    check_round_trip(P, [](int64_t s, int64_t e) { return (s * 7 + e * 3) % 4; });  // zeros among them
  }
}

TEST(EpExperts, EveryRowToOneExpert) {
  for (int P = 2; P <= 4; ++P) {
    SCOPED_TRACE("P = " + std::to_string(P));
    check_round_trip(P, [](int64_t s, int64_t e) { return e == 0 ? 5 + s : int64_t{0}; });
  }
}

TEST(EpExperts, ExpertsNotDividingFailOnEveryRank) {
  comm::run_ranks(4, [](comm::Communicator& w) {
    EpExperts ep(w);
    ExpertRouting routing;
    routing.experts = 6;
    routing.sent.assign(6, 0);
    try {
      ep.route(routing);
      ADD_FAILURE() << "6 experts over 4 ranks must fail";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "expert parallelism: 6 experts do not divide over 4 EP ranks");
    }
  });
}

}  // namespace
}  // namespace rf::cp
