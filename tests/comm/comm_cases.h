// Cases every communicator backend must pass, written once against the interface and run by the loopback test
// (threads) and the MPI test (processes under mpirun). The oracle is arithmetic on rank numbers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"

namespace rf::comm::cases {

constexpr Timeout kTestTimeout{20000};  // far above any honest transfer here; only a hang reaches it

// Several buffers of different sizes (one empty) travel one step around the ring, twice with one tag: the
// second message must not overtake the first.
inline void ring_of_buffers(Communicator& c) {
  const int P = c.size(), r = c.rank(), next = (r + 1) % P, prev = (r + P - 1) % P;
  for (int round = 0; round < 2; ++round) {
    std::vector<float> a(1000 + 7 * r, static_cast<float>(r + round));
    std::vector<int32_t> b(3, r * 10 + round);
    std::vector<float> ra(1000 + 7 * prev), empty_r;
    std::vector<int32_t> rb(3);
    const std::array<SendBuffer, 3> s{{{a.data(), a.size() * 4}, {nullptr, 0}, {b.data(), b.size() * 4}}};
    const std::array<RecvBuffer, 3> rv{{{ra.data(), ra.size() * 4}, {nullptr, 0}, {rb.data(), rb.size() * 4}}};
    RequestPtr recv = c.irecv(prev, 5, rv, "ring test");
    RequestPtr send = c.isend(next, 5, s, "ring test");
    recv->wait(kTestTimeout);
    send->wait(kTestTimeout);
    for (float x : ra) ASSERT_EQ(x, static_cast<float>(prev + round));
    for (int32_t x : rb) ASSERT_EQ(x, prev * 10 + round);
  }
}

inline void collectives(Communicator& c) {
  const int P = c.size(), r = c.rank();
  std::vector<int32_t> all(static_cast<size_t>(P));
  const int32_t mine = 100 + r;
  c.allgather(&mine, all.data(), sizeof mine, kTestTimeout);
  for (int p = 0; p < P; ++p) EXPECT_EQ(all[p], 100 + p);

  std::array<int64_t, 3> v{r, r, r};
  c.allreduce(v.data(), 1, ReduceOp::Sum, kTestTimeout);
  c.allreduce(v.data() + 1, 1, ReduceOp::Max, kTestTimeout);
  c.allreduce(v.data() + 2, 1, ReduceOp::Min, kTestTimeout);
  EXPECT_EQ(v[0], int64_t{P} * (P - 1) / 2);
  EXPECT_EQ(v[1], P - 1);
  EXPECT_EQ(v[2], 0);

  double d = 0.5 * r;
  c.allreduce(&d, 1, ReduceOp::Sum, kTestTimeout);
  EXPECT_EQ(d, 0.25 * P * (P - 1));  // exact: halves of small integers

  const int root = P - 1;
  std::array<char, 6> word{};
  if (r == root) word = {'r', 'i', 'n', 'g', '!', 0};
  c.broadcast(word.data(), word.size(), root, kTestTimeout);
  EXPECT_EQ(std::string(word.data()), "ring!");
  c.barrier(kTestTimeout);
}

// float32 all-reduce (parameter gradients): more elements than one slice (so the slicing and each slice's placement
// are exercised, the last slice short), values whose float32 sum depends on the order, and the oracle computed on
// every rank from the formula: each element summed in double in rank order 0..P-1, rounded once.
inline void float_allreduce(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const size_t slice = Communicator::kReduceSliceBytes / (static_cast<size_t>(P) * sizeof(float));
  const size_t n = 2 * slice + 3;
  // Rank 0's element i is in [1, 2) (float32 ulp 2^-23) and differs per element, so a misplaced slice shows;
  // every other rank adds 3/4 of that ulp, so a float32 running sum rounds up at each step and differs from the
  // double sum rounded once (at P = 4: 1 + 3 ulp against 1 + 2 ulp).
  constexpr size_t kDistinct = 1024;
  const auto value = [](int p, size_t i) {
    return p == 0 ? 1.0f + std::ldexp(static_cast<float>(i % kDistinct), -10) : std::ldexp(3.0f, -25);
  };
  std::vector<float> v(n), hi(n), lo(n);
  for (size_t i = 0; i < n; ++i) v[i] = hi[i] = lo[i] = value(r, i);
  c.allreduce(v.data(), n, ReduceOp::Sum, kTestTimeout);
  c.allreduce(hi.data(), n, ReduceOp::Max, kTestTimeout);
  c.allreduce(lo.data(), n, ReduceOp::Min, kTestTimeout);
  for (size_t i = 0; i < n; ++i) {
    double sum = 0, mx = value(0, i), mn = value(0, i);
    for (int p = 0; p < P; ++p) {
      sum += value(p, i);
      mx = std::max<double>(mx, value(p, i));
      mn = std::min<double>(mn, value(p, i));
    }
    ASSERT_EQ(v[i], static_cast<float>(sum)) << "element " << i;
    ASSERT_EQ(hi[i], static_cast<float>(mx)) << "element " << i;
    ASSERT_EQ(lo[i], static_cast<float>(mn)) << "element " << i;
  }
}

// A receive nobody answers fails by its deadline with a message naming the rank, the peer, the tag and label.
inline void receive_deadline_names_the_peer(Communicator& c) {
  const int P = c.size(), r = c.rank(), prev = (r + P - 1) % P;
  int32_t x = 0;
  const RecvBuffer rb{&x, sizeof x};
  RequestPtr recv = c.irecv(prev, 77, {&rb, 1}, "K/V of step 3");
  try {
    recv->wait(Timeout{50});
    ADD_FAILURE() << "a receive nobody sends must time out";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank " + std::to_string(r)), std::string::npos) << msg;
    EXPECT_NE(msg.find("from rank " + std::to_string(prev)), std::string::npos) << msg;
    EXPECT_NE(msg.find("tag 77"), std::string::npos) << msg;
    EXPECT_NE(msg.find("K/V of step 3"), std::string::npos) << msg;
  }
  c.barrier(kTestTimeout);
}

// The trainer's grid: rank r = dp_index * cp + cp_index. Splitting by dp_index gives the CP groups (ranked by
// cp_index), splitting by cp_index the DP groups. Each sub-communicator's collectives see only its members, and a
// reversed key reverses the ranking (MPI_Comm_split's order).
inline void split_forms_a_grid(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const int cp = P % 2 == 0 ? 2 : 1, cp_index = r % cp, dp_index = r / cp;
  std::unique_ptr<Communicator> cp_group = c.split(dp_index, cp_index, kTestTimeout);
  std::unique_ptr<Communicator> dp_group = c.split(cp_index, -dp_index, kTestTimeout);
  ASSERT_EQ(cp_group->size(), cp);
  ASSERT_EQ(cp_group->rank(), cp_index);
  ASSERT_EQ(dp_group->size(), P / cp);
  ASSERT_EQ(dp_group->rank(), P / cp - 1 - dp_index);  // reversed keys

  // Sum of world ranks within each group: oracle from the grid arithmetic.
  int64_t cp_sum = r, dp_sum = r;
  cp_group->allreduce(&cp_sum, 1, ReduceOp::Sum, kTestTimeout);
  dp_group->allreduce(&dp_sum, 1, ReduceOp::Sum, kTestTimeout);
  int64_t cp_expect = 0, dp_expect = 0;
  for (int i = 0; i < cp; ++i) cp_expect += dp_index * cp + i;
  for (int d = 0; d < P / cp; ++d) dp_expect += d * cp + cp_index;
  EXPECT_EQ(cp_sum, cp_expect);
  EXPECT_EQ(dp_sum, dp_expect);

  // Point-to-point inside a group: messages with the same tag in the parent do not interfere.
  const int n = cp_group->size(), me = cp_group->rank();
  int32_t out = 1000 * dp_index + me, in = -1;
  const SendBuffer sb{&out, sizeof out};
  const RecvBuffer rb{&in, sizeof in};
  RequestPtr recv = cp_group->irecv((me + n - 1) % n, 3, {&rb, 1}, "split ring");
  RequestPtr send = cp_group->isend((me + 1) % n, 3, {&sb, 1}, "split ring");
  recv->wait(kTestTimeout);
  send->wait(kTestTimeout);
  EXPECT_EQ(in, 1000 * dp_index + (me + n - 1) % n);
  EXPECT_THROW(c.split(-1, 0, kTestTimeout), Error);  // every rank throws before any collective: no hang
  c.barrier(kTestTimeout);
}

inline void bad_peer_and_tag_are_rejected(Communicator& c) {
  int32_t x = 0;
  const SendBuffer sb{&x, sizeof x};
  EXPECT_THROW(c.isend(c.size(), 0, {&sb, 1}, "bad peer"), Error);
  EXPECT_THROW(c.isend(0, Communicator::kMaxTag, {&sb, 1}, "bad tag"), Error);
  EXPECT_THROW(c.isend(0, -1, {&sb, 1}, "bad tag"), Error);
}

}  // namespace rf::comm::cases
