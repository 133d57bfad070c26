// ringflex text: tokenizers' BPE model (see bpe.h).
#include "text/bpe.h"

#include <algorithm>
#include <queue>

#include "core/error.h"
#include "text/utf8.h"

namespace rf::text {

void PairMap::reserve(size_t n) {
  size_t capacity = 16;
  while (capacity < 2 * n) capacity *= 2;
  if (capacity <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(capacity, Slot{});
  size_ = 0;
  for (const Slot& s : old)
    if (s.key != kEmpty) insert_or_assign(static_cast<uint32_t>(s.key >> 32), static_cast<uint32_t>(s.key), s.value);
}

size_t PairMap::slot_of(uint64_t key) const {
  // Fibonacci hashing: the top bits of key * 2^64/phi spread the ids' low bits over the table.
  const size_t mask = slots_.size() - 1;
  size_t i = static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask;
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask;
  return i;
}

void PairMap::insert_or_assign(uint32_t a, uint32_t b, uint64_t value) {
  if (2 * (size_ + 1) > slots_.size()) reserve(size_ + 1);
  const uint64_t key = (uint64_t{a} << 32) | b;
  Slot& s = slots_[slot_of(key)];
  if (s.key == kEmpty) ++size_;
  s.key = key;
  s.value = value;
}

const uint64_t* PairMap::find(uint32_t a, uint32_t b) const {
  if (slots_.empty()) return nullptr;
  const Slot& s = slots_[slot_of((uint64_t{a} << 32) | b)];
  return s.key == kEmpty ? nullptr : &s.value;
}

void Bpe::reserve(size_t tokens, size_t merges) {
  vocab_.reserve(tokens);
  id_to_token_.reserve(tokens);
  has_id_.reserve(tokens);
  merges_.reserve(merges);
  joins_.reserve(std::min<size_t>(merges, 1 << 16));
}

void Bpe::add_token(std::string token, int64_t id) {
  RF_CHECK(id >= 0 && id < kMaxIds, "'", token, "' has id ", id, ", outside [0, ", kMaxIds, ")");
  const auto at = static_cast<size_t>(id);
  if (at >= id_to_token_.size()) {
    id_to_token_.resize(at + 1);
    has_id_.resize(at + 1, false);
  }
  RF_CHECK(!has_id_[at], "id ", id, " is given to both '", id_to_token_[at], "' and '", token, "'");
  const auto [it, added] = vocab_.emplace(token, static_cast<int32_t>(id));
  RF_CHECK(added, "'", token, "' is listed twice");
  has_id_[at] = true;
  id_to_token_[at] = std::move(token);
}

void Bpe::add_merge(std::string_view left, std::string_view right) {
  const auto a = vocab_.find(left), b = vocab_.find(right);
  RF_CHECK(a != vocab_.end(), "'", left, "' is not in model.vocab");
  RF_CHECK(b != vocab_.end(), "'", right, "' is not in model.vocab");
  std::string merged(left);
  merged += right;
  const auto m = vocab_.find(merged);
  RF_CHECK(m != vocab_.end(), "the merged token '", merged, "' is not in model.vocab");
  merges_.insert_or_assign(static_cast<uint32_t>(a->second), static_cast<uint32_t>(b->second),
                           (uint64_t{next_rank_++} << 32) | static_cast<uint32_t>(m->second));
  // The code points either side of the join (tokens are valid UTF-8: the file is JSON).
  size_t last = left.size() - 1;
  while (last > 0 && (static_cast<unsigned char>(left[last]) & 0xC0) == 0x80) --last;
  const char32_t x = utf8_decode(left, last, left.size() - last);
  const char32_t y = utf8_decode(right, 0, utf8_length_at(right, 0));
  joins_.insert_or_assign(static_cast<uint32_t>(x), static_cast<uint32_t>(y), 0);
}

void Bpe::finish() {
  if (options_.unk_token) {
    const auto it = vocab_.find(*options_.unk_token);
    RF_CHECK(it != vocab_.end(), "unk_token '", *options_.unk_token, "' is not in model.vocab");
    unk_id_ = it->second;
  }
  bmp_ids_.assign(0x10000, -1);
  std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
  for (const auto& [token, id] : vocab_) {
    const size_t n = utf8_length_at(token, 0);
    if (n != 0 && n == token.size()) {
      const char32_t c = utf8_decode(token, 0, n);
      if (c < 0x10000)
        bmp_ids_[c] = id;
      else
        astral_ids_[c] = id;
    }
  }
  // tokenizers looks byte tokens up as format!("<{b:#04X}>"): "<0x" and two upper-case hex digits.
  for (int b = 0; b < 256; ++b) {
    static const char* kHex = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    if (const auto it = vocab_.find(name); it != vocab_.end()) byte_ids_[b] = it->second;
  }
}

std::optional<int32_t> Bpe::char_id(char32_t c) const {
  if (c < 0x10000) return bmp_ids_[c] >= 0 ? std::optional<int32_t>(bmp_ids_[c]) : std::nullopt;
  const auto it = astral_ids_.find(c);
  return it == astral_ids_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

std::optional<int32_t> Bpe::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  return it == vocab_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

const std::string* Bpe::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= has_id_.size() || !has_id_[static_cast<size_t>(id)]) return nullptr;
  return &id_to_token_[static_cast<size_t>(id)];
}

void Bpe::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  size_t start = 0;
  std::optional<int32_t> prev_id;
  char32_t prev = 0;
  for (size_t at = 0; at < word.size();) {
    const size_t n = utf8_length_at(word, at);
    RF_ASSERT(n != 0);
    const char32_t c = utf8_decode(word, at, n);
    const std::optional<int32_t> id = char_id(c);
    if (at > start && prev_id && id && !joins_.find(static_cast<uint32_t>(prev), static_cast<uint32_t>(c))) {
      encode_piece(word.substr(start, at - start), out);
      start = at;
    }
    prev = c;
    prev_id = id;
    at += n;
  }
  if (start < word.size()) encode_piece(word.substr(start), out);
}

void Bpe::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() <= 64) {  // tokenizers caches words too; a long one is rarely seen twice
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (const auto it = cache_.find(piece); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_piece(piece, out);
  if (piece.size() <= 64) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::string(piece), std::vector<int32_t>(out.begin() + static_cast<ptrdiff_t>(first), out.end()));
  }
}

// tokenizers' BPE::merge_word and Word::merge_all, step for step: the symbols of the code points (unknown ones as
// byte tokens or unk, in its order), then repeatedly the lowest-ranked merge (leftmost among equal ranks) from a
// queue whose stale entries are skipped when the pair at that place no longer makes the entry's token.
void Bpe::merge_piece(std::string_view piece, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    uint32_t len;  // bytes; 0 marks a symbol merged into its left neighbour
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  const auto add = [&](int32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, len});
  };
  bool unk_pending = false;  // an unk not yet added, and its bytes
  uint32_t unk_len = 0;
  for (size_t at = 0; at < piece.size();) {
    const size_t n = utf8_length_at(piece, at);
    const auto len = static_cast<uint32_t>(n);
    if (const auto id = char_id(utf8_decode(piece, at, n))) {
      if (unk_pending) add(*unk_id_, unk_len), unk_pending = false;
      add(*id, len);
      at += n;
      continue;
    }
    if (options_.byte_fallback &&
        std::all_of(piece.begin() + static_cast<ptrdiff_t>(at), piece.begin() + static_cast<ptrdiff_t>(at + n),
                    [&](char b) { return byte_ids_[static_cast<unsigned char>(b)] >= 0; })) {
      for (size_t i = at; i < at + n; ++i) add(byte_ids_[static_cast<unsigned char>(piece[i])], 1);
      at += n;
      continue;
    }
    if (unk_id_) {
      if (unk_pending && options_.fuse_unk) {
        unk_len += len;
      } else {
        if (unk_pending) add(*unk_id_, unk_len);
        unk_pending = true;
        unk_len = len;
      }
    }
    at += n;
  }
  if (unk_pending) add(*unk_id_, unk_len);

  struct Merge {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  const auto later = [](const Merge& x, const Merge& y) { return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos; };
  std::priority_queue<Merge, std::vector<Merge>, decltype(later)> queue(later);
  const auto push = [&](int32_t pos, int32_t left, int32_t right) {
    if (const uint64_t* m = merges_.find(static_cast<uint32_t>(left), static_cast<uint32_t>(right)))
      queue.push({static_cast<uint32_t>(*m >> 32), pos, static_cast<int32_t>(static_cast<uint32_t>(*m))});
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) push(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& s = symbols[static_cast<size_t>(top.pos)];
    if (s.len == 0 || s.next == -1) continue;
    const Symbol right = symbols[static_cast<size_t>(s.next)];
    const uint64_t* now = merges_.find(static_cast<uint32_t>(s.id), static_cast<uint32_t>(right.id));
    if (!now || static_cast<int32_t>(static_cast<uint32_t>(*now)) != top.new_id) continue;
    symbols[static_cast<size_t>(s.next)].len = 0;
    s.id = top.new_id;
    s.len += right.len;
    s.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (s.prev >= 0) push(s.prev, symbols[static_cast<size_t>(s.prev)].id, s.id);
    if (s.next >= 0) push(top.pos, s.id, symbols[static_cast<size_t>(s.next)].id);
  }
  for (const Symbol& s : symbols)
    if (s.len != 0) out.push_back(s.id);
}

}  // namespace rf::text
