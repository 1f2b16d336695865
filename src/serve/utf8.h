// Streaming generated text: tokens are bytes, and a character may be split over two of them.
#pragma once
#include <cstddef>
#include <string>

namespace tqkv::serve {

// The length of the longest prefix of s that does not end inside a UTF-8 sequence; a stream
// sends that and holds the rest back until the next token completes the character.
inline size_t complete_utf8_prefix(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

}  // namespace tqkv::serve
