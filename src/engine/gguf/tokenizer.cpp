#include "engine/gguf/tokenizer.h"

#include <locale.h>
#include <wctype.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <queue>

#include "engine/gguf/gguf.h"
#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

// The English contractions both pre-tokenizers split off after an apostrophe ('s 't 'm 'd,
// 're 've 'll): the length of the piece with the apostrophe (2 or 3), or 0. c1, c2: the next
// two characters (ASCII, as the caller folds them; 0 past the end).
size_t contraction_length(uint32_t c1, uint32_t c2) {
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// ---- UTF-8 ----------------------------------------------------------------------------

// Length of the UTF-8 sequence starting at s[i]; invalid bytes count as one (they are kept
// as raw bytes, which byte-level BPE handles and SentencePiece sends to byte fallback).
size_t utf8_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 1;
  return n;
}

uint32_t utf8_cp(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  switch (n) {
    case 2: return ((b(0) & 0x1f) << 6) | (b(1) & 0x3f);
    case 3: return ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f);
    case 4: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
    default: return b(0);
  }
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// ---- Unicode classes used by the GPT-2 pre-tokenizer ------------------------------------
// \p{L} and \p{N} beyond ASCII come from the C library's Unicode tables (C.UTF-8 locale),
// so we carry no tables of our own; without that locale non-ASCII is treated as a letter
// when alphabetic by iswalpha in the "C" locale (i.e. only ASCII), which only changes how
// exotic text is split, never what it decodes to.

locale_t utf8_locale() {
  static locale_t loc = [] {
    locale_t l = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(0));
    if (!l) l = newlocale(LC_CTYPE_MASK, "en_US.UTF-8", static_cast<locale_t>(0));
    return l;
  }();
  return loc;
}

bool is_space(uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0d) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

bool is_number(uint32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  // Common non-ASCII numerals: superscripts, vulgar fractions, Roman numerals, circled digits.
  if (c == 0xb2 || c == 0xb3 || c == 0xb9 || (c >= 0xbc && c <= 0xbe)) return true;
  if ((c >= 0x2070 && c <= 0x2079) || (c >= 0x2080 && c <= 0x2089) || (c >= 0x2150 && c <= 0x2189)) return true;
  if (c >= 0x2460 && c <= 0x249b) return true;
  if (locale_t l = utf8_locale()) return iswdigit_l(static_cast<wint_t>(c), l) != 0;
  return false;
}

bool is_letter(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (is_number(c)) return false;
  if (locale_t l = utf8_locale()) return iswalpha_l(static_cast<wint_t>(c), l) != 0;
  return false;
}

struct Cp {
  uint32_t cp;
  size_t off, len;  // byte span in the text
};

std::vector<Cp> code_points(std::string_view s) {
  std::vector<Cp> v;
  v.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_len(s, i);
    v.push_back({utf8_cp(s, i, n), i, n});
    i += n;
  }
  return v;
}

// The GPT-2 split, written out by hand instead of with a regex engine:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Appends the byte spans of the pieces of cps[b, e) to out.
void gpt2_split(std::string_view text, const std::vector<Cp>& cps, size_t b, size_t e,
                std::vector<std::string_view>& out) {
  auto emit = [&](size_t i, size_t j) {
    const size_t off = cps[i].off;
    const size_t end = cps[j - 1].off + cps[j - 1].len;
    out.push_back(text.substr(off, end - off));
  };
  auto ascii = [&](size_t i) { return i < e && cps[i].cp < 0x80 ? cps[i].cp : 0u; };
  size_t i = b;
  while (i < e) {
    const uint32_t c = cps[i].cp;
    if (c == '\'' && i + 1 < e) {
      if (const size_t len = contraction_length(ascii(i + 1), ascii(i + 2))) {  // case-sensitive, as in GPT-2
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: an optional single space, then a run
    // of one class.
    const size_t j0 = (c == ' ' && i + 1 < e && !is_space(cps[i + 1].cp)) ? i + 1 : i;
    const uint32_t d = cps[j0].cp;
    if (!is_space(d)) {
      const int cls = is_letter(d) ? 0 : is_number(d) ? 1 : 2;
      auto same = [&](uint32_t x) {
        return cls == 0 ? is_letter(x) : cls == 1 ? is_number(x) : (!is_space(x) && !is_letter(x) && !is_number(x));
      };
      size_t j = j0;
      while (j < e && same(cps[j].cp)) ++j;
      emit(i, j);
      i = j;
      continue;
    }
    // Whitespace run: all but the last char when a non-space follows (that char then joins
    // the next piece as its optional leading space), else the whole run.
    size_t j = i;
    while (j < e && is_space(cps[j].cp)) ++j;
    if (j == i) j = i + 1;  // unreachable in practice; guarantees progress
    if (j < e && j - i >= 2) --j;
    emit(i, j);
    i = j;
  }
}

// Qwen2's split (Llama 3's with single digits), by hand like gpt2_split:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// The alternatives are tried in order at each position, as the regex engine does.
void qwen2_split(std::string_view text, const std::vector<Cp>& cps, size_t b, size_t e,
                 std::vector<std::string_view>& out) {
  auto emit = [&](size_t i, size_t j) {
    const size_t off = cps[i].off;
    out.push_back(text.substr(off, cps[j - 1].off + cps[j - 1].len - off));
  };
  auto lower = [&](size_t i) { return i < e && cps[i].cp < 0x80 ? cps[i].cp | 0x20u : 0u; };
  auto letter = [&](size_t i) { return i < e && is_letter(cps[i].cp); };
  auto newline = [](uint32_t c) { return c == '\r' || c == '\n'; };
  auto other = [&](size_t i) {  // [^\s\p{L}\p{N}]
    return i < e && !is_space(cps[i].cp) && !is_letter(cps[i].cp) && !is_number(cps[i].cp);
  };
  size_t i = b;
  while (i < e) {
    const uint32_t c = cps[i].cp;
    if (c == '\'' && i + 1 < e) {  // contractions, any case
      if (const size_t len = contraction_length(lower(i + 1), lower(i + 2))) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    if (!newline(c) && !is_number(c) && (letter(i) || letter(i + 1))) {  // [^\r\n\p{L}\p{N}]?\p{L}+
      size_t j = i + 1;
      while (letter(j)) ++j;
      emit(i, j);
      i = j;
      continue;
    }
    if (is_number(c)) {  // \p{N}
      emit(i, i + 1);
      ++i;
      continue;
    }
    const size_t j0 = c == ' ' && other(i + 1) ? i + 1 : i;
    if (other(j0)) {  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
      size_t j = j0;
      while (other(j)) ++j;
      while (j < e && newline(cps[j].cp)) ++j;
      emit(i, j);
      i = j;
      continue;
    }
    // A whitespace run [i, j): through its last newline when it has one (`\s*[\r\n]+`), else
    // all but its last character when a non-space follows (`\s+(?!\S)`), else all of it.
    size_t j = i, last_nl = 0;
    while (j < e && is_space(cps[j].cp)) {
      if (newline(cps[j].cp)) last_nl = j + 1;
      ++j;
    }
    if (j == i) j = i + 1;  // unreachable: every code point is a letter, number, space or other
    else if (last_nl > 0) j = last_nl;
    else if (j < e && j - i >= 2) --j;
    emit(i, j);
    i = j;
  }
}

// GPT-2's byte <-> printable code point table: printable Latin-1 bytes map to themselves,
// the rest to 256, 257, ... in byte order, so every byte string becomes visible text.
const std::array<uint32_t, 256>& byte_to_cp() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> a{};
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      a[b] = keep ? static_cast<uint32_t>(b) : next++;
    }
    return a;
  }();
  return t;
}

int cp_to_byte(uint32_t cp) {
  static const std::vector<int> inv = [] {
    std::vector<int> v(512, -1);
    const auto& t = byte_to_cp();
    for (int b = 0; b < 256; ++b) v[t[b]] = b;
    return v;
  }();
  return cp < inv.size() ? inv[cp] : -1;
}

constexpr int kTypeNormal = 1, kTypeUnknown = 2, kTypeControl = 3, kTypeUser = 4, kTypeByte = 6;

// ---- BPE merging ------------------------------------------------------------------------
// A symbol of a word being merged: a byte span of the text, linked to its neighbours.
struct Symbol {
  uint32_t off, len;  // len 0: merged into the symbol before it
  int prev, next;     // -1 at the ends
};

// Repeatedly merges the adjacent pair of symbols that `priority` ranks first (lowest value;
// ties to the leftmost pair) until no pair is mergeable; returns the symbols left, in order.
// priority(left, right) gives the pair's rank or NaN when the pair does not merge. This is the
// same answer as scanning every pair after every merge, but each merge costs a heap push and
// pop instead of a scan of the whole word, so a long word (a megabyte of "a") is
// O(n log n), not O(n^2). Entries go stale when a neighbour merges; they are skipped when
// popped (the left symbol gone, its neighbour changed, or either one grown since).
template <typename Priority>
std::vector<std::string_view> bpe_merge(std::string_view text, std::vector<Symbol>& sym, Priority priority) {
  struct Candidate {
    double rank;
    int left, right;
    uint32_t len;  // the pair's bytes when pushed
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto span = [&](int i) { return text.substr(sym[i].off, sym[i].len); };
  auto push = [&](int l) {
    const int r = l < 0 ? -1 : sym[l].next;
    if (r < 0) return;
    const double rank = priority(span(l), span(r));
    if (rank == rank) heap.push({rank, l, r, sym[l].len + sym[r].len});
  };
  for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& l = sym[c.left];
    if (l.len == 0 || l.next != c.right || l.len + sym[c.right].len != c.len) continue;
    Symbol& r = sym[c.right];
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (l.next >= 0) sym[l.next].prev = c.left;
    push(l.prev);
    push(c.left);
  }
  std::vector<std::string_view> out;
  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) out.push_back(span(i));
  return out;
}

// One symbol per character (UTF-8 sequence, or invalid byte) of text[0, n).
void char_symbols(std::string_view text, std::vector<Symbol>& sym) {
  sym.clear();
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_len(text, i);
    const int k = static_cast<int>(sym.size());
    sym.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(n), k - 1, -1});
    if (k > 0) sym[k - 1].next = k;
    i += n;
  }
}

}  // namespace

Tokenizer::Tokenizer(Kind kind, std::vector<std::string> tokens, std::vector<int> types, std::vector<float> scores,
                     const std::vector<std::string>& merges)
    : kind_(kind), tokens_(std::move(tokens)), types_(std::move(types)), scores_(std::move(scores)) {
  if (tokens_.empty()) throw Error(ErrorCode::Format, "tokenizer: empty vocabulary");
  if (types_.empty()) types_.assign(tokens_.size(), kTypeNormal);
  if (types_.size() != tokens_.size()) throw Error(ErrorCode::Format, "tokenizer: token_type length differs from tokens");
  if (!scores_.empty() && scores_.size() != tokens_.size())
    throw Error(ErrorCode::Format, "tokenizer: scores length differs from tokens");
  for (size_t r = 0; r < merges.size(); ++r) {
    if (merges[r].find(' ') == std::string::npos)
      throw Error(ErrorCode::Format, "tokenizer: merge " + std::to_string(r) + " has no separating space");
    merge_rank_.emplace(merges[r], static_cast<int>(r));
  }
  build_index();
}

void Tokenizer::build_index() {
  index_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    index_.emplace(tokens_[i], static_cast<int32_t>(i));
    max_token_bytes_ = std::max(max_token_bytes_, tokens_[i].size());
    const int t = types_[i];
    if ((t == kTypeControl || t == kTypeUser) && !tokens_[i].empty())
      specials_[static_cast<unsigned char>(tokens_[i][0])].push_back(static_cast<int32_t>(i));
    if (t == kTypeUnknown && unk_ < 0) unk_ = static_cast<int32_t>(i);
  }
  // Longest first, so "<|im_start|>" wins over any shorter special that is its prefix.
  for (std::vector<int32_t>& v : specials_)
    std::stable_sort(v.begin(), v.end(), [&](int32_t a, int32_t b) { return tokens_[a].size() > tokens_[b].size(); });
  for (const char* s : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>"}) {
    const int32_t id = token_id(s);
    if (id >= 0) end_of_gen_.push_back(id);
  }
}

Tokenizer Tokenizer::from_gguf(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  Kind kind;
  if (model == "gpt2") kind = Kind::BytePairGpt2;
  else if (model == "llama") kind = Kind::SentencePiece;
  else throw Error(ErrorCode::Format, "tokenizer model '" + model + "' is not supported (gpt2 and llama are)");
  std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  std::vector<int> types;
  if (f.has("tokenizer.ggml.token_type"))
    for (int64_t t : f.get_int_array("tokenizer.ggml.token_type")) types.push_back(static_cast<int>(t));
  std::vector<float> scores;
  if (f.has("tokenizer.ggml.scores"))
    for (double s : f.get_float_array("tokenizer.ggml.scores")) scores.push_back(static_cast<float>(s));
  static const std::vector<std::string> no_merges;
  const std::vector<std::string>& merges =
      f.has("tokenizer.ggml.merges") ? f.get_string_array("tokenizer.ggml.merges") : no_merges;
  if (kind == Kind::BytePairGpt2 && merges.empty()) throw Error(ErrorCode::Format, "tokenizer: gpt2 model without merges");
  if (kind == Kind::SentencePiece && scores.empty()) throw Error(ErrorCode::Format, "tokenizer: llama model without scores");
  Tokenizer t(kind, std::move(tokens), std::move(types), std::move(scores), merges);
  const int64_t n = t.n_vocab();
  auto id = [&](const char* key, int64_t fallback) -> int32_t {
    const int64_t v = f.get_int(key, fallback);
    if (v < -1 || v >= n) throw Error(ErrorCode::Format, std::string("tokenizer: ") + key + " out of range");
    return static_cast<int32_t>(v);
  };
  t.bos_ = id("tokenizer.ggml.bos_token_id", -1);
  t.eos_ = id("tokenizer.ggml.eos_token_id", -1);
  const int32_t unk = id("tokenizer.ggml.unknown_token_id", -1);
  if (unk >= 0) t.unk_ = unk;
  t.add_bos_ = f.get_bool("tokenizer.ggml.add_bos_token", kind == Kind::SentencePiece);
  t.add_space_prefix_ = f.get_bool("tokenizer.ggml.add_space_prefix", kind == Kind::SentencePiece);
  const std::string pre = f.get_string("tokenizer.ggml.pre", "default");
  t.split_digits_ = pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r";
  t.llama3_split_ = pre == "qwen2";
  t.chat_template_ = f.get_string("tokenizer.chat_template", "");
  if (t.eos_ >= 0 && std::find(t.end_of_gen_.begin(), t.end_of_gen_.end(), t.eos_) == t.end_of_gen_.end())
    t.end_of_gen_.push_back(t.eos_);
  return t;
}

int32_t Tokenizer::token_id(std::string_view text) const {
  auto it = index_.find(std::string(text));
  return it == index_.end() ? -1 : it->second;
}

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && id < n_vocab() && (types_[id] == kTypeControl);
}

bool Tokenizer::is_end_of_generation(int32_t id) const {
  return std::find(end_of_gen_.begin(), end_of_gen_.end(), id) != end_of_gen_.end();
}

void Tokenizer::split_special(std::string_view text, bool control,
                              std::vector<std::pair<std::string_view, int32_t>>& parts) const {
  size_t start = 0, i = 0;
  while (i < text.size()) {
    int32_t hit = -1;
    for (int32_t id : specials_[static_cast<unsigned char>(text[i])]) {
      if ((control || types_[id] == kTypeUser) && text.compare(i, tokens_[id].size(), tokens_[id]) == 0) {
        hit = id;
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    if (i > start) parts.emplace_back(text.substr(start, i - start), -1);
    parts.emplace_back(std::string_view{}, hit);
    i += tokens_[hit].size();
    start = i;
  }
  if (start < text.size()) parts.emplace_back(text.substr(start), -1);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special, bool add_bos) const {
  std::vector<int32_t> out;
  if (add_bos && bos_ >= 0) out.push_back(bos_);
  std::vector<std::pair<std::string_view, int32_t>> parts;
  split_special(text, parse_special, parts);
  bool first = true;
  for (const auto& [s, id] : parts) {
    if (id >= 0) {
      out.push_back(id);
    } else if (kind_ == Kind::BytePairGpt2) {
      encode_gpt2(s, out);
    } else {
      encode_spm(s, out, first);
    }
    first = false;
  }
  return out;
}

void Tokenizer::encode_gpt2(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<Cp> cps = code_points(text);
  std::vector<std::string_view> words;
  if (llama3_split_) {
    qwen2_split(text, cps, 0, cps.size(), words);
  } else {
    // SmolLM-style pre-tokenizers first isolate every digit, then apply the GPT-2 split to
    // the runs in between.
    size_t b = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      const bool digit = i < cps.size() && split_digits_ && is_number(cps[i].cp);
      if (i == cps.size() || digit) {
        if (i > b) gpt2_split(text, cps, b, i, words);
        if (digit) words.push_back(text.substr(cps[i].off, cps[i].len));
        b = i + 1;
      }
    }
  }
  const auto& b2c = byte_to_cp();
  std::string mapped;  // the word's bytes as GPT-2's printable code points
  std::vector<Symbol> sym;
  std::string key;
  for (std::string_view w : words) {
    mapped.clear();
    for (unsigned char c : w) utf8_append(mapped, b2c[c]);
    char_symbols(mapped, sym);
    // Merge the adjacent pair of lowest rank until none is mergeable.
    const auto pieces = bpe_merge(mapped, sym, [&](std::string_view a, std::string_view b) {
      key.assign(a).append(" ").append(b);
      auto it = merge_rank_.find(key);
      return it == merge_rank_.end() ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(it->second);
    });
    for (std::string_view s : pieces) {
      const int32_t id = token_id(s);
      if (id >= 0) out.push_back(id);
      else if (unk_ >= 0) out.push_back(unk_);
      else throw Error(ErrorCode::Format, "tokenizer: byte piece missing from the vocabulary");
    }
  }
}

void Tokenizer::encode_spm(std::string_view text, std::vector<int32_t>& out, bool first) const {
  static const std::string kSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's visible space
  std::string norm;
  if (first && add_space_prefix_) norm = kSpace;
  for (char c : text) {
    if (c == ' ') norm += kSpace;
    else norm += c;
  }
  std::vector<Symbol> sym;
  char_symbols(norm, sym);
  // Merge the adjacent pair whose union is the highest-scoring vocabulary entry.
  std::string cat;
  const auto pieces = bpe_merge(norm, sym, [&](std::string_view a, std::string_view b) {
    cat.assign(a).append(b);
    const int32_t id = token_id(cat);
    // Scores that never beat the scan's starting -inf do not merge (NaN, -inf).
    return id >= 0 && scores_[id] > -std::numeric_limits<float>::infinity() ? -static_cast<double>(scores_[id])
                                                                            : std::numeric_limits<double>::quiet_NaN();
  });
  for (std::string_view s : pieces) {
    const int32_t id = token_id(s);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (unsigned char c : s) {  // byte fallback
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", c);
      const int32_t bid = token_id(buf);
      if (bid >= 0) out.push_back(bid);
      else if (unk_ >= 0) out.push_back(unk_);
      else throw Error(ErrorCode::Format, "tokenizer: no byte token and no unknown token for unmatched text");
    }
  }
}

std::string Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= n_vocab()) throw Error(ErrorCode::OutOfRange, "token id " + std::to_string(id) + " out of range");
  const std::string& t = tokens_[id];
  const int type = types_[id];
  if (type == kTypeControl || type == kTypeUser) return t;
  if (kind_ == Kind::BytePairGpt2) {
    std::string out;
    for (size_t i = 0; i < t.size();) {
      const size_t n = utf8_len(t, i);
      const int b = cp_to_byte(utf8_cp(t, i, n));
      if (b >= 0) out += static_cast<char>(b);
      else out.append(t, i, n);  // not a byte-mapped char: keep as is
      i += n;
    }
    return out;
  }
  if (type == kTypeByte && t.size() == 6 && t.rfind("<0x", 0) == 0) {
    return std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
  }
  std::string out;
  for (size_t i = 0; i < t.size();) {
    if (t.compare(i, 3, "\xe2\x96\x81") == 0) {
      out += ' ';
      i += 3;
    } else {
      out += t[i++];
    }
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_control) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    if (skip_control && is_control(id)) continue;
    std::string p = piece(id);
    if (first && kind_ == Kind::SentencePiece && add_space_prefix_ && !p.empty() && p[0] == ' ' && !is_control(id))
      p.erase(0, 1);
    if (!is_control(id)) first = false;
    out += p;
  }
  return out;
}

std::string Tokenizer::apply_chat_template(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  // A GGUF without a template (Gemma-3-270m's base model has none): the family whose turn
  // markers the vocabulary has, as the model's own tokenizer_config.json gives it.
  std::string fallback;
  if (chat_template_.empty()) {
    for (const char* marker : {"<start_of_turn>", "<|im_start|>", "<|start_header_id|>"})
      if (token_id(marker) >= 0 && types_[token_id(marker)] == kTypeControl) {
        fallback = marker;
        break;
      }
  }
  const std::string& t = chat_template_.empty() ? fallback : chat_template_;
  std::string out;
  const bool has_system = !messages.empty() && messages[0].role == "system";
  if (t.find("<|im_start|>") != std::string::npos) {
    // ChatML. Some templates (SmolLM2, Qwen2) insert a default system turn when the
    // conversation has none; lift its text out of the template so we insert the same.
    // Qwen2.5's sits in a Jinja string literal ('<|im_start|>system\nYou are Qwen, ...'), after
    // turns that splice in the caller's system text: take the first system turn whose text is
    // literal up to <|im_end|>, with the literal's \n escapes undone.
    if (!has_system) {
      const std::string open = "<|im_start|>system";
      for (size_t a = t.find(open); a != std::string::npos; a = t.find(open, a + open.size())) {
        size_t s = a + open.size();
        if (t.compare(s, 2, "\\n") == 0) s += 2;
        else if (s < t.size() && t[s] == '\n') s += 1;
        const size_t e = t.find("<|im_end|>", s);
        if (e == std::string::npos) break;
        const std::string sys = t.substr(s, e - s);
        if (sys.empty() || sys.find_first_of("{}'\"+") != std::string::npos) continue;
        std::string text;
        for (size_t i = 0; i < sys.size(); ++i) {
          if (sys.compare(i, 2, "\\n") == 0) {
            text += '\n';
            ++i;
          } else {
            text += sys[i];
          }
        }
        out += "<|im_start|>system\n" + text + "<|im_end|>\n";
        break;
      }
    }
    for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
  if (t.find("<|start_header_id|>") != std::string::npos) {  // Llama 3
    out += "<|begin_of_text|>";
    for (const auto& m : messages)
      out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content + "<|eot_id|>";
    if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    return out;
  }
  if (t.find("<start_of_turn>") != std::string::npos) {  // Gemma: system text joins the first user turn
    std::string pending;
    for (const auto& m : messages) {
      if (m.role == "system") {
        pending = m.content + "\n\n";
        continue;
      }
      const std::string role = m.role == "assistant" ? "model" : m.role;
      out += "<start_of_turn>" + role + "\n" + pending + m.content + "<end_of_turn>\n";
      pending.clear();
    }
    if (add_generation_prompt) out += "<start_of_turn>model\n";
    return out;
  }
  if (t.find("[INST]") != std::string::npos) {  // Llama 2
    std::string sys;
    for (const auto& m : messages) {
      if (m.role == "system") sys = "<<SYS>>\n" + m.content + "\n<</SYS>>\n\n";
      else if (m.role == "user") {
        out += "[INST] " + sys + m.content + " [/INST]";
        sys.clear();
      } else {
        out += " " + m.content + " ";
      }
    }
    return out;
  }
  throw Error(ErrorCode::InvalidArgument,
              t.empty() ? "the model has no chat template and no known turn markers; use raw prompting (--raw)"
                        : "unrecognised chat template (ChatML, Llama 2/3 and Gemma are supported); use --raw");
}

}  // namespace tqkv::engine
