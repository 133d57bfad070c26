// CP attention under a real `mpirun -n P` (CTest runs it at P = 1, 2, 3, 4, 8): the mask sweep (small rows and
// rows of several tiles per rank) against the reference, schemes and algorithms against each other, MPI against
// loopback bits for both rings, packed parity, and ranks that disagree or hold bad input failing together with
// one line.
#include <gtest/gtest.h>

#include "common/mpi_world.h"
#include "core/error.h"
#include "cp_cases.h"

namespace rf::cp {
namespace {

comm::Communicator& world() { return testing::mpi_world(); }

TEST(CpMpi, MaskSweep) {
  for (const cases::Case& c : cases::sweep_cases()) cases::check_case(world(), c, /*compare_loopback=*/true);
}

// Rows of several 64-key tiles per rank, S not a multiple of 64: every ring step moves and computes whole and
// partial tiles; MPI must give the loopback backend's bits for the planned and the chunk ring.
TEST(CpMpi, LongRowsSweep) {
  for (const cases::Case& c : cases::long_row_cases(world().size()))
    cases::check_case(world(), c, /*compare_loopback=*/true);
}

TEST(CpMpi, PackedParity) {
  cases::check_packed_parity(world(), LayerMask{true, 7, true}, DType::F32);
  cases::check_packed_parity(world(), LayerMask{true, 0, false}, DType::BF16);
}

// A rank whose head dimension differs: every rank throws the same line naming the field and the ranks.
TEST(CpMpi, HeaderMismatchFailsOnEveryRank) {
  comm::Communicator& c = world();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int D = c.rank() == c.size() - 1 ? 8 : 16, L = 4;
  std::vector<float> q(2 * L * D, 0.1f), kv(L * D, 0.1f), o(q.size()), lse(2 * L);
  std::vector<TokenMeta> meta;
  for (int i = 0; i < L; ++i) meta.push_back({c.rank() * L + i, 1, -1});
  const CpShard x{AttnShape{1, 2, 1, L, L, D}, DType::F32, q.data(), kv.data(), kv.data(), meta.data()};
  CpParams p;
  p.scale = 1.f;
  p.timeout = cases::kCaseTimeout;
  try {
    cp_attention_forward(c, x, p, o.data(), lse.data());
    ADD_FAILURE() << "mismatched D must fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "ranks disagree on D: rank 0 has 16, rank " + std::to_string(c.size() - 1) + " has 8");
  }
}

// One rank's bad input (Hq not a multiple of Hkv) is reported by every rank, naming that rank.
TEST(CpMpi, InvalidInputFailsOnEveryRank) {
  comm::Communicator& c = world();
  const int bad = c.size() / 2, Hq = c.rank() == bad ? 3 : 2, L = 4, D = 8;
  std::vector<float> q(Hq * L * D, 0.1f), kv(2 * L * D, 0.1f), o(q.size()), lse(Hq * L);
  std::vector<TokenMeta> meta;
  for (int i = 0; i < L; ++i) meta.push_back({c.rank() * L + i, 1, -1});
  const CpShard x{AttnShape{1, Hq, 2, L, L, D}, DType::F32, q.data(), kv.data(), kv.data(), meta.data()};
  CpParams p;
  p.timeout = cases::kCaseTimeout;
  try {
    cp_attention_forward(c, x, p, o.data(), lse.data());
    ADD_FAILURE() << "Hq % Hkv != 0 must fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(bad) + ": Hq = 3 is not a multiple of Hkv = 2");
  }
}

}  // namespace
}  // namespace rf::cp

int main(int argc, char** argv) { return rf::testing::run_mpi_tests(argc, argv); }
