// ringflex cp: the header every CP call agrees on before moving any data (see agree_header in cp_internal.h).
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "core/error.h"
#include "cp/cp_internal.h"

namespace rf::cp::detail {
namespace {

constexpr size_t kErrorChars = 240;  // one error line travels in the header; longer ones are cut

// Plain data only: it is allgathered as bytes.
struct Header {
  int32_t fields[14];
  char error[kErrorChars];
};

constexpr std::array<const char*, 14> kFieldNames = {
    "B",      "Hq",   "Hkv",  "L",           "D", "dtype", "causal", "window", "bidirectional_groups", "scale (bits)",
    "scheme", "algo", "pass", "ring traffic"};

}  // namespace

float agree_header(comm::Communicator& comm, const CpShard& x, const CpParams& p, Pass pass, bool outputs_ok) {
  Header h{};
  const float scale = p.scale.value_or(default_scale(x.shape.D));
  try {
    RF_CHECK(outputs_ok, "CP attention ", pass == Pass::Forward ? "forward" : "backward",
             " is missing an input or output buffer");
    RF_CHECK(x.shape.Lq == x.shape.Lk, "a CP shard has one length L for queries and keys, got Lq = ", x.shape.Lq,
             " and Lk = ", x.shape.Lk);
    RF_CHECK(x.shape.Lq >= 1, "a CP shard needs L >= 1 tokens, got ", x.shape.Lq);
    RF_CHECK(x.meta != nullptr, "the shard's token metadata is missing");
    AttnChunk c{x.shape, x.dtype, x.q, x.k, x.v, x.meta, x.meta, p.mask, scale};
    validate(c);
  } catch (const Error& e) {
    std::strncpy(h.error, e.what(), kErrorChars - 1);
  }
  const std::array<int32_t, 14> f = {x.shape.B,
                                     x.shape.Hq,
                                     x.shape.Hkv,
                                     x.shape.Lq,
                                     x.shape.D,
                                     static_cast<int32_t>(x.dtype),
                                     p.mask.causal,
                                     p.mask.window,
                                     p.mask.bidirectional_groups,
                                     std::bit_cast<int32_t>(scale),
                                     static_cast<int32_t>(p.scheme),
                                     static_cast<int32_t>(p.algo),
                                     static_cast<int32_t>(pass),
                                     static_cast<int32_t>(p.traffic)};
  std::copy(f.begin(), f.end(), h.fields);

  const int P = comm.size();
  std::vector<Header> all(static_cast<size_t>(P));
  comm.allgather(&h, all.data(), sizeof(Header), p.timeout);
  for (int r = 0; r < P; ++r) RF_CHECK(all[r].error[0] == 0, "rank ", r, ": ", std::string(all[r].error));
  for (int r = 1; r < P; ++r)
    for (size_t i = 0; i < kFieldNames.size(); ++i)
      RF_CHECK(all[r].fields[i] == all[0].fields[i], "ranks disagree on ", kFieldNames[i], ": rank 0 has ",
               all[0].fields[i], ", rank ", r, " has ", all[r].fields[i]);
  return scale;
}

}  // namespace rf::cp::detail
