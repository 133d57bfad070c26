// The loopback communicator (threads as ranks): the shared backend cases at several P, plus what only the
// loopback can show in one process: a failing rank wakes its blocked peers instead of hanging them.
#include <gtest/gtest.h>

#include "comm/loopback_comm.h"
#include "comm_cases.h"

namespace rf::comm {
namespace {

constexpr int kRankCounts[] = {1, 2, 3, 4, 8};

TEST(Loopback, RingOfBuffers) {
  for (int P : kRankCounts) run_ranks(P, cases::ring_of_buffers);
}

TEST(Loopback, Collectives) {
  for (int P : kRankCounts) run_ranks(P, cases::collectives);
}

TEST(Loopback, FloatAllreduceInRankOrderAcrossSlices) {
  for (int P : kRankCounts) run_ranks(P, cases::float_allreduce);
}

TEST(Loopback, ReceiveDeadlineNamesThePeer) {
  for (int P : kRankCounts) run_ranks(P, cases::receive_deadline_names_the_peer);
}

TEST(Loopback, BlockedTimeCountsTheWaits) {
  for (int P : kRankCounts) run_ranks(P, cases::blocked_time_counts_the_waits);
}

TEST(Loopback, SplitFormsAGrid) {
  for (int P : kRankCounts) run_ranks(P, cases::split_forms_a_grid);
}

// The sliced collectives at every P from 1 to 8 (MPI runs them at the P of its CTest launches).
constexpr int kEveryRankCount[] = {1, 2, 3, 4, 5, 6, 7, 8};

TEST(Loopback, SlicedAllreduceKeepsRankOrderBitsAndBytes) {
  for (int P : kEveryRankCount) run_ranks(P, cases::sliced_allreduce);
}

TEST(Loopback, SlicedReduceScatter) {
  for (int P : kEveryRankCount) run_ranks(P, cases::sliced_reduce_scatter);
}

TEST(Loopback, SlicedAllgather) {
  for (int P : kEveryRankCount) run_ranks(P, cases::sliced_allgather);
}

TEST(Loopback, AllreduceOfSeveralBuffers) {
  for (int P : kEveryRankCount) run_ranks(P, cases::allreduce_of_several_buffers);
}

TEST(Loopback, PostedCollectivesOverlap) {
  for (int P : kRankCounts) run_ranks(P, cases::posted_collectives_overlap);
}

TEST(Loopback, AlltoallvPlacesByRank) {
  for (int P : kEveryRankCount) run_ranks(P, cases::alltoallv_places_by_rank);
}

TEST(Loopback, ReduceOfPartsInBoundedRounds) {
  for (int P : kEveryRankCount) run_ranks(P, cases::reduce_parts);
}

TEST(Loopback, StoppedPeerIsNamed) {
  for (int P : kRankCounts) run_ranks(P, cases::stopped_peer_is_named);
}

TEST(Loopback, BadPeerAndTagAreRejected) { run_ranks(2, cases::bad_peer_and_tag_are_rejected); }

TEST(Loopback, FailingRankWakesBlockedPeers) {
  // Rank 1 throws before sending; rank 0 would otherwise wait its full (long) deadline.
  try {
    run_ranks(2, [](Communicator& c) {
      if (c.rank() == 1) throw Error("rank 1 refuses");
      int32_t x = 0;
      const RecvBuffer rb{&x, sizeof x};
      c.irecv(1, 0, {&rb, 1}, "never sent")->wait(cases::kTestTimeout);
    });
    FAIL() << "the failure must propagate";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 1 refuses");
  }
}

TEST(Loopback, SizeMismatchIsAnError) {
  EXPECT_THROW(run_ranks(2,
                         [](Communicator& c) {
                           std::vector<int32_t> x(c.rank() == 0 ? 4 : 3);
                           const SendBuffer sb{x.data(), x.size() * 4};
                           const RecvBuffer rb{x.data(), x.size() * 4};
                           const int peer = 1 - c.rank();
                           RequestPtr s = c.isend(peer, 0, {&sb, 1}, "size test");
                           c.irecv(peer, 0, {&rb, 1}, "size test")->wait(cases::kTestTimeout);
                           s->wait(cases::kTestTimeout);
                         }),
               Error);
}

// Step names what a thread is doing for its scope; scopes nest and restore the outer name.
TEST(CommStep, NestsAndRestores) {
  EXPECT_EQ(Step::current(), "");
  {
    const Step outer("running the job");
    EXPECT_EQ(Step::current(), "running the job");
    {
      const Step inner("gathering the results");
      EXPECT_EQ(Step::current(), "gathering the results");
    }
    EXPECT_EQ(Step::current(), "running the job");
  }
  EXPECT_EQ(Step::current(), "");
}

}  // namespace
}  // namespace rf::comm
