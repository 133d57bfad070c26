// The MPI communicator under a real `mpirun -n P` (CTest runs it for several P): the shared backend cases.
// Every rank runs every test; a failed assertion on any rank makes mpirun exit non-zero.
#include <gtest/gtest.h>

#include "comm_cases.h"
#include "common/mpi_world.h"

namespace rf::comm {
namespace {

Communicator& world() { return testing::mpi_world(); }

TEST(Mpi, RingOfBuffers) { cases::ring_of_buffers(world()); }
TEST(Mpi, Collectives) { cases::collectives(world()); }
TEST(Mpi, FloatAllreduceInRankOrderAcrossSlices) { cases::float_allreduce(world()); }
TEST(Mpi, ReceiveDeadlineNamesThePeer) { cases::receive_deadline_names_the_peer(world()); }
TEST(Mpi, BlockedTimeCountsTheWaits) { cases::blocked_time_counts_the_waits(world()); }
TEST(Mpi, SplitFormsAGrid) { cases::split_forms_a_grid(world()); }
TEST(Mpi, BadPeerAndTagAreRejected) { cases::bad_peer_and_tag_are_rejected(world()); }
TEST(Mpi, SlicedAllreduceKeepsRankOrderBitsAndBytes) { cases::sliced_allreduce(world()); }
TEST(Mpi, SlicedReduceScatter) { cases::sliced_reduce_scatter(world()); }
TEST(Mpi, SlicedAllgather) { cases::sliced_allgather(world()); }
TEST(Mpi, AllreduceOfSeveralBuffers) { cases::allreduce_of_several_buffers(world()); }
TEST(Mpi, PostedCollectivesOverlap) { cases::posted_collectives_overlap(world()); }
TEST(Mpi, AlltoallvPlacesByRank) { cases::alltoallv_places_by_rank(world()); }
TEST(Mpi, ReduceOfPartsInBoundedRounds) { cases::reduce_parts(world()); }
// A timeout inside a split communicator (the trainer's CP and DP groups) names the job's ranks, not the group's: the
// even and the odd ranks form two groups (group rank r / 2), each rank waits on its group's next rank, which never
// sends, and the line must carry both world numbers (the oracle: r and 2 * ((r / 2 + 1) % group size) + r % 2).
TEST(Mpi, SplitTimeoutsNameTheJobsRanks) {
  Communicator& c = world();
  const int P = c.size(), r = c.rank(), color = r % 2;
  const std::unique_ptr<Communicator> group = c.split(color, r, cases::kTestTimeout);
  const int next = 2 * ((group->rank() + 1) % group->size()) + color;
  int32_t x = 0;
  const RecvBuffer rb{&x, sizeof x};
  try {
    group->irecv((group->rank() + 1) % group->size(), 9, {&rb, 1}, "K/V")->wait(Timeout{50});
    ADD_FAILURE() << "a receive nobody sends must time out";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("rank " + std::to_string(r) + ":", 0), 0u) << msg;
    EXPECT_NE(msg.find("from rank " + std::to_string(next) + " "), std::string::npos) << msg << " (P " << P << ")";
  }
  c.barrier(cases::kTestTimeout);
}
// Last: it leaves unmatched messages behind on the stopped rank (see the case).
TEST(Mpi, StoppedPeerIsNamed) { cases::stopped_peer_is_named(world()); }

}  // namespace
}  // namespace rf::comm

int main(int argc, char** argv) { return rf::testing::run_mpi_tests(argc, argv); }
