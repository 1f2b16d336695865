// Streamed text never cuts a UTF-8 character: the bytes of an unfinished one wait for the next
// token (a split character was an HTTP 500 before: the JSON writer refused the bytes).
#include <gtest/gtest.h>

#include "serve/utf8.h"

namespace tqkv::serve {
namespace {

// a + b, appended (GCC 12 warns falsely, -Wrestrict, on "literal" + std::string).
std::string cat(const char* a, const std::string& b) {
  std::string s(a);
  s.append(b);
  return s;
}

TEST(Utf8, CompletePrefixHoldsBackAnUnfinishedCharacter) {
  EXPECT_EQ(complete_utf8_prefix(""), 0u);
  EXPECT_EQ(complete_utf8_prefix("abc"), 3u);
  const std::string e_acute = "\xC3\xA9", euro = "\xE2\x82\xAC", emoji = "\xF0\x9F\x98\x80";
  EXPECT_EQ(complete_utf8_prefix(cat("a", e_acute)), 3u);
  EXPECT_EQ(complete_utf8_prefix(cat("a", e_acute.substr(0, 1))), 1u);
  EXPECT_EQ(complete_utf8_prefix(cat("a", euro)), 4u);
  EXPECT_EQ(complete_utf8_prefix(cat("a", euro.substr(0, 2))), 1u);
  EXPECT_EQ(complete_utf8_prefix(cat("a", emoji)), 5u);
  for (size_t k = 1; k < 4; ++k) EXPECT_EQ(complete_utf8_prefix(cat("ab", emoji.substr(0, k))), 2u) << k;
  // Stray continuation bytes are not a character that can complete: they pass (and become
  // U+FFFD in the JSON).
  EXPECT_EQ(complete_utf8_prefix("a\x80\x80\x80\x80"), 5u);
}

}  // namespace
}  // namespace tqkv::serve
