// Cases every communicator backend must pass, written once against the interface and run by the loopback test
// (threads) and the MPI test (processes under mpirun). The oracle is arithmetic on rank numbers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm/blocked_time.h"
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

// blocked_seconds (the trainer's comm_wait_s) counts the time a wait blocks: rank 0 sends to rank 1 only after
// sleeping kDelay, so rank 1's wait, posted at once, blocks for about that long; the bound is a fifth of it, leaving
// the rest for rank 1 to reach its wait late (8 ranks on 2 loaded cores). A wait for a message already there adds
// less than the bound (it blocks for nothing: microseconds, measured).
inline void blocked_time_counts_the_waits(Communicator& c) {
  constexpr std::chrono::milliseconds kDelay{500};
  constexpr double kAtLeastS = 0.1;
  const int r = c.rank();
  int32_t x = 7;
  if (c.size() >= 2 && r <= 1) {
    if (r == 0) {
      std::this_thread::sleep_for(kDelay);
      const SendBuffer sb{&x, sizeof x};
      c.isend(1, 5, {&sb, 1}, "late")->wait(kTestTimeout);
      c.isend(1, 6, {&sb, 1}, "early")->wait(kTestTimeout);
    } else {
      const RecvBuffer rb{&x, sizeof x};
      const double before = blocked_seconds();
      c.irecv(0, 5, {&rb, 1}, "late")->wait(kTestTimeout);
      const double blocked = blocked_seconds() - before;
      EXPECT_GE(blocked, kAtLeastS) << "a wait of about " << kDelay.count() << " ms";
      RequestPtr early = c.irecv(0, 6, {&rb, 1}, "early");
      while (!early->test()) std::this_thread::yield();
      const double at = blocked_seconds();
      early->wait(kTestTimeout);
      EXPECT_LT(blocked_seconds() - at, kAtLeastS) << "a wait for a message already received";
    }
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

// --- The sliced collectives (collectives.cpp) ----------------------------------------------------------------

// Rank p's value of element i: rank 0's is in [1, 2) and differs per element (a misplaced chunk shows); the others
// add a few float32 ulps of 1 (2^-23) scaled by 3/4 .. 7/4, so a float32 running sum rounds at each step and differs
// from the double sum rounded once: only the rank-order double sum matches the oracle everywhere.
inline float sliced_value(int p, size_t i) {
  constexpr size_t kDistinct = 1024;
  constexpr size_t kSteps = 5;
  constexpr float kStep = 0x1p-10f, kUlpQuarter = 0x1p-25f;  // powers of two: the products are exact
  if (p == 0) return 1.0f + static_cast<float>(i % kDistinct) * kStep;
  return static_cast<float>(3 + (i * 7 + static_cast<size_t>(p)) % kSteps) * kUlpQuarter;
}

// The oracle: what the allgather-then-sum all-reduce gave, each element's P values combined in rank order 0..P-1 in
// double and rounded once.
inline float rank_order(int P, size_t i, ReduceOp op) {
  double acc = sliced_value(0, i);
  for (int p = 1; p < P; ++p) {
    const double x = sliced_value(p, i);
    acc = op == ReduceOp::Sum ? acc + x : op == ReduceOp::Min ? std::min(acc, x) : std::max(acc, x);
  }
  return static_cast<float>(acc);
}

// The sizes every sliced case runs: nothing, one element, fewer elements than ranks, not a multiple of P, and
// enough for every slice to span three chunks (so chunks in flight, the short last chunk and the gather of summed
// chunks are exercised).
inline std::vector<size_t> sliced_sizes(int P) {
  const size_t Pz = static_cast<size_t>(P);
  return {0, 1, Pz > 1 ? Pz - 1 : 2, 3 * Pz + 2, Pz * (2 * Communicator::reduce_chunk(P) + 3) + 5};
}

inline Communicator::Traffic traffic_since(const Communicator& c, Communicator::Traffic before) {
  const Communicator::Traffic now = c.traffic();
  return {now.bytes_sent - before.bytes_sent, now.bytes_received - before.bytes_received};
}

// float all-reduce: the rank-order bits, and the bytes each rank sent and received measured by the backend. Exactly:
// the reduce-scatter sends the other owners their slices (n - L_r elements) and receives P - 1 contributions to its
// own (L_r each); the gather sends its slice P - 1 times and receives the rest: n + (P - 2) L_r each way. With
// L_r <= ceil(n / P) < n / P + 1 that is within the bandwidth-optimal 2 (P - 1)/P n plus P - 2 elements of padding
// (the slices' rounding up), the bound the issue asks for.
inline void sliced_allreduce(Communicator& c) {
  const int P = c.size(), r = c.rank();
  for (const size_t n : sliced_sizes(P)) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = sliced_value(r, i);
    const Communicator::Traffic before = c.traffic();
    c.allreduce(v.data(), n, ReduceOp::Sum, kTestTimeout);
    const Communicator::Traffic moved = traffic_since(c, before);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], rank_order(P, i, ReduceOp::Sum)) << "n = " << n << ", element " << i;

    const uint64_t own = slice_of(n, P, r).size(), f32 = sizeof(float);
    const uint64_t exact = (n + static_cast<uint64_t>(P - 2) * own) * f32;
    EXPECT_EQ(moved.bytes_sent, P == 1 ? 0 : exact) << "n = " << n;
    EXPECT_EQ(moved.bytes_received, P == 1 ? 0 : exact) << "n = " << n;
    const double bound = 2.0 * (P - 1) / P * static_cast<double>(n * f32) + static_cast<double>((P - 2) * f32);
    EXPECT_LE(static_cast<double>(moved.bytes_sent), std::max(bound, 0.0)) << "n = " << n;
    EXPECT_LE(static_cast<double>(moved.bytes_received), std::max(bound, 0.0)) << "n = " << n;
  }
  // Min and Max take the same path; one size spanning chunks.
  const size_t n = sliced_sizes(P).back();
  std::vector<float> hi(n), lo(n);
  for (size_t i = 0; i < n; ++i) hi[i] = lo[i] = sliced_value(r, i);
  c.allreduce(hi.data(), n, ReduceOp::Max, kTestTimeout);
  c.allreduce(lo.data(), n, ReduceOp::Min, kTestTimeout);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(hi[i], rank_order(P, i, ReduceOp::Max)) << "element " << i;
    ASSERT_EQ(lo[i], rank_order(P, i, ReduceOp::Min)) << "element " << i;
  }
}

// reduce_scatter: this rank's slice holds the rank-order sums, the rest is untouched. Sent: the other slices,
// n - L_r elements <= (P - 1)/P n + ... ; received: P - 1 contributions to its slice, (P - 1) L_r < (P - 1)(n/P + 1).
inline void sliced_reduce_scatter(Communicator& c) {
  const int P = c.size(), r = c.rank();
  for (const size_t n : sliced_sizes(P)) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = sliced_value(r, i);
    const Communicator::Traffic before = c.traffic();
    c.reduce_scatter(v.data(), n, ReduceOp::Sum, kTestTimeout);
    const Communicator::Traffic moved = traffic_since(c, before);
    const Slice own = slice_of(n, P, r);
    for (size_t i = 0; i < n; ++i) {
      const bool mine = i >= own.begin && i < own.end;
      ASSERT_EQ(v[i], mine ? rank_order(P, i, ReduceOp::Sum) : sliced_value(r, i)) << "n = " << n << ", element " << i;
    }
    const uint64_t f32 = sizeof(float);
    EXPECT_EQ(moved.bytes_sent, P == 1 ? 0 : (n - own.size()) * f32) << "n = " << n;
    EXPECT_EQ(moved.bytes_received, (P - 1) * own.size() * f32) << "n = " << n;
    const double bound =
        static_cast<double>(P - 1) / P * static_cast<double>(n * f32) + static_cast<double>((P - 1) * f32);
    EXPECT_LE(static_cast<double>(moved.bytes_sent), bound) << "n = " << n;
    EXPECT_LE(static_cast<double>(moved.bytes_received), bound) << "n = " << n;
  }
}

// allgather_slices, as float32 and as 2-byte elements (bf16 working weights): each rank fills only its slice (the
// rest holds garbage that must be overwritten), and ends with the whole. Sent: its slice to P - 1 ranks; received:
// the other slices: each at most (P - 1)/P of the buffer plus P - 1 elements of padding.
inline void sliced_allgather(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const auto bf16_bits = [](size_t i) { return static_cast<uint16_t>((i * 40503u) >> 3); };
  for (const size_t n : sliced_sizes(P)) {
    const Slice own = slice_of(n, P, r);
    std::vector<float> f(n, -1.0f);
    std::vector<uint16_t> h(n, 0xFFFF);
    for (size_t i = own.begin; i < own.end; ++i) {
      f[i] = sliced_value(0, i);
      h[i] = bf16_bits(i);
    }
    Communicator::Traffic before = c.traffic();
    c.allgather_slices(f.data(), n, sizeof(float), kTestTimeout);
    const Communicator::Traffic moved = traffic_since(c, before);
    c.allgather_slices(h.data(), n, sizeof(uint16_t), kTestTimeout);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f[i], sliced_value(0, i)) << "n = " << n << ", element " << i;
      ASSERT_EQ(h[i], bf16_bits(i)) << "n = " << n << ", element " << i;
    }
    const uint64_t f32 = sizeof(float);
    EXPECT_EQ(moved.bytes_sent, static_cast<uint64_t>(P - 1) * own.size() * f32) << "n = " << n;
    EXPECT_EQ(moved.bytes_received, P == 1 ? 0 : (n - own.size()) * f32) << "n = " << n;
    const double bound =
        static_cast<double>(P - 1) / P * static_cast<double>(n * f32) + static_cast<double>((P - 1) * f32);
    EXPECT_LE(static_cast<double>(moved.bytes_sent), bound) << "n = " << n;
    EXPECT_LE(static_cast<double>(moved.bytes_received), bound) << "n = " << n;
  }
  // allgatherv with parts of any size (rank p: 5p + 1 bytes, so ranks differ and none is a multiple of another).
  std::vector<size_t> parts(static_cast<size_t>(P));
  size_t total = 0;
  for (int p = 0; p < P; ++p) total += parts[static_cast<size_t>(p)] = 5 * static_cast<size_t>(p) + 1;
  std::vector<uint8_t> all(total, 0);
  size_t at = 0;
  for (int p = 0; p < P; ++p) {
    for (size_t b = 0; b < parts[static_cast<size_t>(p)]; ++b)
      all[at + b] = p == r ? static_cast<uint8_t>(16 * p + b) : uint8_t{0};
    at += parts[static_cast<size_t>(p)];
  }
  c.allgatherv(all.data(), parts, kTestTimeout);
  at = 0;
  for (int p = 0; p < P; ++p) {
    for (size_t b = 0; b < parts[static_cast<size_t>(p)]; ++b)
      ASSERT_EQ(all[at + b], static_cast<uint8_t>(16 * p + b)) << "rank " << p << "'s byte " << b;
    at += parts[static_cast<size_t>(p)];
  }
}

// Several buffers (a model's gradient tensors, one of them empty) reduce as their concatenation: the bits of the flat
// all-reduce of the concatenation, slices and chunks crossing the buffers' edges.
inline void allreduce_of_several_buffers(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const size_t n = sliced_sizes(P).back();
  const std::vector<size_t> sizes{3, 0, 1, n / 3, 7, n - n / 3 - 11};  // sums to n
  std::vector<std::vector<float>> parts;
  std::vector<std::span<float>> views;
  size_t at = 0;
  for (const size_t len : sizes) {
    parts.emplace_back(len);
    for (size_t i = 0; i < len; ++i) parts.back()[i] = sliced_value(r, at + i);
    at += len;
  }
  ASSERT_EQ(at, n);
  for (std::vector<float>& p : parts) views.emplace_back(p);
  c.allreduce(views, ReduceOp::Sum, kTestTimeout);
  at = 0;
  for (const std::vector<float>& p : parts) {
    for (size_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i], rank_order(P, at + i, ReduceOp::Sum)) << "element " << at + i;
    at += p.size();
  }
}

// Posted collectives: two in flight at once (an all-reduce and an all-gather, as a layer's gradient reduction and
// the next layer's weights would be), advanced by progress() between stretches of "compute", completed in the
// opposite order to their posting; the results are those of the blocking calls.
inline void posted_collectives_overlap(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const size_t n = sliced_sizes(P).back();
  std::vector<float> grads(n), weights(n, -1.0f);
  for (size_t i = 0; i < n; ++i) grads[i] = sliced_value(r, i);
  const Slice own = slice_of(n, P, r);
  for (size_t i = own.begin; i < own.end; ++i) weights[i] = sliced_value(0, i);
  const std::span<float> g(grads);
  PostedPtr reduce = c.post_allreduce({&g, 1}, ReduceOp::Sum);
  std::vector<size_t> parts(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) parts[static_cast<size_t>(p)] = slice_of(n, P, p).size() * sizeof(float);
  PostedPtr gather = c.post_allgatherv(weights.data(), parts);
  volatile double busy = 0;  // the "layer" computing meanwhile
  const auto deadline = std::chrono::steady_clock::now() + kTestTimeout;
  while (!reduce->progress()) {
    for (int i = 0; i < 1000; ++i) busy = busy + 1.0;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "progress() never completed the all-reduce";
  }
  gather->wait(kTestTimeout);
  reduce->wait(kTestTimeout);  // complete already: returns at once
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(grads[i], rank_order(P, i, ReduceOp::Sum)) << "element " << i;
    ASSERT_EQ(weights[i], sliced_value(0, i)) << "element " << i;
  }
}

// alltoallv with counts exchanged first: rank s sends (3 s + 2 d) % 7 bytes to rank d (some zero, itself included),
// byte b of it = 31 s + 7 d + b; each rank's receive buffer holds the parts in source-rank order. Sent and received
// bytes are exactly the counts to and from the other ranks.
inline void alltoallv_places_by_rank(Communicator& c) {
  const int P = c.size(), r = c.rank();
  const auto count = [](int s, int d) { return static_cast<size_t>(3 * s + 2 * d) % 7; };
  const auto byte = [](int s, int d, size_t b) { return static_cast<uint8_t>(31 * s + 7 * d + static_cast<int>(b)); };
  std::vector<size_t> send_bytes(static_cast<size_t>(P));
  std::vector<uint8_t> send;
  uint64_t to_others = 0, from_others = 0;
  for (int d = 0; d < P; ++d) {
    send_bytes[static_cast<size_t>(d)] = count(r, d);
    for (size_t b = 0; b < count(r, d); ++b) send.push_back(byte(r, d, b));
    if (d != r) {
      to_others += count(r, d);
      from_others += count(d, r);
    }
  }
  const std::vector<size_t> recv_bytes = c.alltoall_counts(send_bytes, kTestTimeout);
  for (int s = 0; s < P; ++s) ASSERT_EQ(recv_bytes[static_cast<size_t>(s)], count(s, r)) << "from rank " << s;
  std::vector<uint8_t> recv(from_others + count(r, r), 0);
  const Communicator::Traffic before = c.traffic();
  c.alltoallv(send.data(), send_bytes, recv.data(), recv_bytes, kTestTimeout);
  const Communicator::Traffic moved = traffic_since(c, before);
  size_t at = 0;
  for (int s = 0; s < P; ++s)
    for (size_t b = 0; b < count(s, r); ++b, ++at)
      ASSERT_EQ(recv[at], byte(s, r, b)) << "from rank " << s << ", byte " << b;
  EXPECT_EQ(moved.bytes_sent, to_others);
  EXPECT_EQ(moved.bytes_received, from_others);
}

// post_reduce_parts: owners' parts of different sizes (rank 0's spans many chunks, the last rank's is empty at P > 1)
// and contributions with gaps (rank p skips the elements i of owner q's part with (i + p + q) % 5 == 2, but for rank
// 0; `dense`: none skipped). Each owner gets, element by element and once, the rank-order double sum of the values
// there (+0 for a gap) rounded once; the bytes sent and received are exactly the values to and from the other ranks;
// the receive buffers (reduce_parts_bytes) stay within the budget while rank 0's part is many times it.
inline void reduce_parts(Communicator& c) {
  const int P = c.size(), r = c.rank();
  constexpr size_t kChunk = 7;  // elements a round: a part of 10 chunks and more takes several rounds in flight
  const size_t budget = 2 * static_cast<size_t>(P) * kChunk * sizeof(float);  // two rounds of [P, kChunk] floats
  ASSERT_EQ(Communicator::reduce_parts_chunk(P, budget), kChunk);
  for (const bool dense : {true, false}) {
    const std::string what = dense ? "dense" : "with gaps";
    std::vector<size_t> parts(static_cast<size_t>(P));
    for (int q = 0; q < P; ++q)
      parts[static_cast<size_t>(q)] = q == 0 ? 10 * kChunk + 3 : (q == P - 1 ? 0 : 2 * static_cast<size_t>(q) + 1);
    const auto has = [&](int p, int q, size_t i) {
      return dense || p == 0 || (i + static_cast<size_t>(p + q)) % 5 != 2;
    };
    const auto value = [&](int p, int q, size_t i) { return sliced_value(p, 1000 * static_cast<size_t>(q) + i); };
    const auto runs_of = [&](int p, int q) {
      std::vector<Slice> runs;
      for (size_t i = 0; i < parts[static_cast<size_t>(q)]; ++i) {
        if (!has(p, q, i)) continue;
        if (!runs.empty() && runs.back().end == i)
          ++runs.back().end;
        else
          runs.push_back({i, i + 1});
      }
      return runs;
    };
    std::vector<float> send;
    std::vector<std::vector<Slice>> to(static_cast<size_t>(P)), from(static_cast<size_t>(P));
    uint64_t to_others = 0, from_others = 0;
    for (int q = 0; q < P; ++q) {
      to[static_cast<size_t>(q)] = runs_of(r, q);
      from[static_cast<size_t>(q)] = runs_of(q, r);
      for (size_t i = 0; i < parts[static_cast<size_t>(q)]; ++i) {
        if (has(r, q, i)) send.push_back(value(r, q, i));
        if (q != r && has(r, q, i)) to_others += sizeof(float);
      }
      for (size_t i = 0; i < parts[static_cast<size_t>(r)]; ++i)
        if (q != r && has(q, r, i)) from_others += sizeof(float);
    }
    const size_t mine = parts[static_cast<size_t>(r)];
    std::vector<float> got(mine, -1.0f);
    std::vector<int> times(mine, 0);
    size_t next = 0;  // chunks arrive in element order
    const Communicator::Traffic before = c.traffic();
    PostedPtr posted = c.post_reduce_parts(
        send.data(), parts, to, from,
        [&](size_t begin, std::span<const float> sums) {
          EXPECT_EQ(begin, next) << what;
          next = begin + sums.size();
          EXPECT_LE(sums.size(), kChunk) << what;
          for (size_t i = 0; i < sums.size(); ++i) {
            got[begin + i] = sums[i];
            ++times[begin + i];
          }
        },
        budget);
    posted->wait(kTestTimeout);
    const Communicator::Traffic moved = traffic_since(c, before);
    for (size_t i = 0; i < mine; ++i) {
      double want = has(0, r, i) ? value(0, r, i) : 0.0;
      for (int p = 1; p < P; ++p) want += has(p, r, i) ? value(p, r, i) : 0.0;
      ASSERT_EQ(got[i], static_cast<float>(want)) << what << ", element " << i;
      ASSERT_EQ(times[i], 1) << what << ", element " << i;
    }
    EXPECT_EQ(moved.bytes_sent, to_others) << what;
    EXPECT_EQ(moved.bytes_received, from_others) << what;
    const size_t held = Communicator::reduce_parts_bytes(P, mine, budget);
    EXPECT_LE(held, budget) << what;
    // Rank 0 receives 10 x the budget's worth of contributions (at P > 1) through buffers of the budget.
    if (r == 0 && P > 1) {
      EXPECT_EQ(held, 2 * static_cast<size_t>(P) * kChunk * sizeof(float)) << what;
    }
    if (P == 1) {
      EXPECT_EQ(held, 0u) << what;  // alone with its part: its values are its sums
    }
  }
}

// A rank that never joins an all-reduce (stopped, hung) is named by every rank waiting for it, within the deadline.
// Run on a split copy of the world, last: the stopped rank's mailbox keeps the others' unmatched contributions, which
// must not meet a later collective.
inline void stopped_peer_is_named(Communicator& c) {
  const int P = c.size(), r = c.rank(), stopped = P - 1;
  if (P == 1) return;  // nobody to wait for
  std::unique_ptr<Communicator> copy = c.split(0, r, kTestTimeout);
  if (r != stopped) {
    std::vector<float> v(4 * static_cast<size_t>(P), 1.0f);
    const Step step("summing the gradients");
    try {
      copy->allreduce(v.data(), v.size(), ReduceOp::Sum, Timeout{300});
      ADD_FAILURE() << "an all-reduce missing a rank must time out";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank " + std::to_string(r) + ": timed out"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(stopped)), std::string::npos) << msg;
      EXPECT_NE(msg.find("allreduce"), std::string::npos) << msg;
      EXPECT_NE(msg.find("while summing the gradients"), std::string::npos) << msg;
    }
  }
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
