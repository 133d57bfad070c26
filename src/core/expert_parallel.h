// ringflex core: the experts' dispatch, the parallel context's second member (core/attention_backend.h). Expert
// parallelism (EP) divides the experts of every MoE layer over the ranks of an EP group: rank r of P holds experts
// [r * E / P, (r + 1) * E / P). Each rank routes its own tokens; the rows routed to an expert travel to the rank
// holding it, are run there, and the expert outputs travel back, so each token's combine (ascending expert index)
// runs on the token's rank with the same rows, in the same order, as with every expert local.
//
// Layouts. A rank's sent rows lie by expert (expert 0's rows first, each expert's rows in the model's order); its
// received rows lie by source rank, then by its own experts in order ([P][E / P] blocks). dispatch moves sent rows
// into received rows; combine moves them back. Every call is collective over the EP group, in the same sequence
// on every rank. Implementations: LocalExperts below (P = 1: every expert here, the rows copied) and
// rf::cp::EpExperts (cp/ep_experts.h, over a communicator).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace rf {

// One MoE layer's traffic on one rank: rows it sends to each expert, rows it receives per (source, own expert).
struct ExpertRouting {
  int64_t experts = 0;            // E, the layer's experts
  int ranks = 1;                  // P of the EP group
  int rank = 0;                   // this rank in it
  std::vector<int64_t> sent;      // [E] rows this rank routes to each expert
  std::vector<int64_t> received;  // [P][E / P] rows each source routes to each of this rank's experts

  // Places the routing on an EP group of P ranks, this one `r`: `sent` must hold [E] counts and the experts divide
  // over the group; `received` becomes [P][E / P] zeros for the exchange to fill.
  void place_on(int P, int r) {
    RF_CHECK(static_cast<int64_t>(sent.size()) == experts, "expert routing: sent holds one count per expert");
    RF_CHECK(experts % P == 0, "expert parallelism: ", experts, " experts do not divide over ", P, " EP ranks");
    ranks = P;
    rank = r;
    received.assign(static_cast<size_t>(experts), 0);  // P * (E / P)
  }
  int64_t experts_here() const { return experts / ranks; }
  int64_t first_expert() const { return experts_here() * rank; }
  int64_t sent_rows() const { return std::accumulate(sent.begin(), sent.end(), int64_t{0}); }
  int64_t received_rows() const { return std::accumulate(received.begin(), received.end(), int64_t{0}); }
  // Rows this rank sends to EP rank p: its experts' rows, one contiguous run of the sent layout.
  int64_t sent_to(int p) const {
    const int64_t n = experts_here();
    return std::accumulate(sent.begin() + p * n, sent.begin() + (p + 1) * n, int64_t{0});
  }
  // Rows received from source rank s: one contiguous run of the received layout.
  int64_t received_from(int s) const {
    const int64_t n = experts_here();
    return std::accumulate(received.begin() + s * n, received.begin() + (s + 1) * n, int64_t{0});
  }
};

// Totals of a run, for --stats and the memory check.
struct ExpertTraffic {
  int64_t rows_sent = 0;      // routed rows this rank's tokens sent to other ranks' experts
  int64_t rows_received = 0;  // routed rows other ranks' tokens sent to this rank's experts
  int64_t bytes_sent = 0;     // every dispatch and combine, forward and backward
  // Seconds this rank spent waiting in dispatch and combine (and route's count exchange): the exposed time. A started
  // dispatch counts its finish's wait only.
  double seconds = 0.0;
};

class ExpertParallel {
 public:
  virtual ~ExpertParallel() = default;
  virtual int rank() const = 0;   // in the EP group
  virtual int ranks() const = 0;  // EP

  // Fills routing.received from every rank's routing.sent (collective). sent: [E], E divisible by ranks().
  virtual void route(ExpertRouting& routing) = 0;
  // sent: [sent_rows, width] float32 in the sent layout -> received: [received_rows, width] (collective).
  virtual void dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) = 0;
  // received: [received_rows, width] -> sent: [sent_rows, width], each row back where dispatch took it (collective).
  virtual void combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) = 0;

  // dispatch in two halves, so that a rank runs the rows it routed to its own experts (read from `sent`, where
  // they lie as the received layout's block of this rank) while the other ranks' rows travel: start_dispatch
  // begins it, finish_dispatch ends it (then `received` holds every row, this rank's too). Between the two the
  // caller only reads `sent` and does not touch `received`; progress_dispatch (the calling thread of the start
  // only) lets the transfers advance. One started dispatch at a time. Here: the whole dispatch at the start.
  virtual void start_dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) {
    dispatch(routing, sent, received, width);
  }
  virtual void progress_dispatch() {}
  virtual void finish_dispatch() {}
  // combine in two halves likewise, so that work that does not read `sent` (the backward's weight gradients) runs
  // while the rows travel back: between start_combine and finish_combine the caller does not touch `sent` or write
  // `received`; progress_combine (the calling thread of the start only) lets the transfers advance. One started
  // dispatch or combine at a time. Here: the whole combine at the start.
  virtual void start_combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) {
    combine(routing, received, sent, width);
  }
  virtual void progress_combine() {}
  virtual void finish_combine() {}

  virtual ExpertTraffic traffic() const { return {}; }
};

// EP = 1: every expert on this rank; the received layout is the sent one, copied.
class LocalExperts final : public ExpertParallel {
 public:
  int rank() const override { return 0; }
  int ranks() const override { return 1; }
  void route(ExpertRouting& routing) override {
    routing.place_on(1, 0);
    routing.received = routing.sent;
  }
  void dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) override {
    std::copy_n(sent, routing.sent_rows() * width, received);
  }
  void combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) override {
    std::copy_n(received, routing.received_rows() * width, sent);
  }
};

}  // namespace rf
