// ringflex text: the BPE model of Hugging Face `tokenizers` (tokenizer.json's "model": {"type": "BPE"}), merges
// applied by rank over code points, with byte fallback and unk as tokenizers' BPE::merge_word does them.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace rf::text {

struct BpeOptions {
  std::optional<std::string> unk_token;  // the token of a code point with no token (and no byte tokens)
  bool fuse_unk = false;                 // consecutive unknown code points become one unk
  bool byte_fallback = false;            // a code point with no token becomes its bytes' <0xXX> tokens
};

// An open-addressing map from a pair of 32-bit keys to a 64-bit value: the merge table is probed once per pair of
// neighbouring symbols, and std::unordered_map's node per entry costs ~4x the memory and a cache miss more.
class PairMap {
 public:
  void reserve(size_t n);
  void insert_or_assign(uint32_t a, uint32_t b, uint64_t value);
  const uint64_t* find(uint32_t a, uint32_t b) const;
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t key = kEmpty;
    uint64_t value = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  size_t slot_of(uint64_t key) const;
  void grow();
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

class Bpe {
 public:
  explicit Bpe(BpeOptions options) : options_(std::move(options)) {}
  // Building, in the file's order. Each throws rf::Error saying what is wrong, for the caller to prefix with the
  // file and field: an id out of [0, kMaxIds), an id given twice, a merge of tokens not in the vocabulary.
  static constexpr int32_t kMaxIds = 1 << 24;  // 64x Gemma 4's 262,144: a larger claim is a broken file
  void reserve(size_t tokens, size_t merges);  // the tables sized once (rehashing 262,144 strings costs ~0.1 s)
  void add_token(std::string token, int64_t id);
  void add_merge(std::string_view left, std::string_view right);  // rank = the order of the calls
  void finish();  // after the last add_*: checks unk_token, builds the per-character tables

  // Appends the ids of one pre-tokenized word (valid UTF-8) to `out`, as tokenizers' BPE::tokenize does.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // null for an id the vocabulary does not have
  int64_t size() const { return static_cast<int64_t>(id_to_token_.size()); }  // one past the largest id

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::optional<int32_t> char_id(char32_t c) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void merge_piece(std::string_view piece, std::vector<int32_t>& out) const;

  BpeOptions options_;
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  PairMap merges_;  // (left id, right id) -> rank << 32 | merged id; a later duplicate replaces an earlier one
  // (last code point of a merge's left token, first of its right token), for every merge: a word is cut between
  // two code points that both have tokens and that no merge joins (no symbol can ever span that place), so the
  // pieces are short and cached, the ids exactly those of the whole word.
  PairMap joins_;
  std::vector<int32_t> bmp_ids_;                      // code point < 0x10000 -> its one-character token, or -1
  std::unordered_map<char32_t, int32_t> astral_ids_;  // the rest
  int32_t byte_ids_[256];                             // <0xXX> tokens, -1 where absent
  std::optional<int32_t> unk_id_;
  uint32_t next_rank_ = 0;

  static constexpr size_t kCacheEntries = 1 << 16;  // cleared when full: bounded memory on any text
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> cache_;
};

}  // namespace rf::text
