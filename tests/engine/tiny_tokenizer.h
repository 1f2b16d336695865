// A small byte-level tokenizer, as GGUF bytes (gguf_builder.h) and built, for tests and fuzz
// targets that need a tokenizer and no model file: GPT-2's 256 byte tokens, one merge ("Ġt"),
// and the ChatML turn markers as control tokens with a ChatML chat template. Any text encodes
// (one token per byte at worst); the vocabulary is 260 tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/gguf/tokenizer.h"
#include "gguf_builder.h"

namespace tqkv::engine::test {

constexpr int kTinyTokenizerVocab = 260;

inline std::vector<uint8_t> tiny_tokenizer_gguf() {
  // GPT-2's byte-to-character map: printable bytes stand for themselves, the others map to
  // U+0100 upwards in order.
  std::vector<std::string> tokens(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : next++;
    std::string& s = tokens[static_cast<size_t>(b)];
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  tokens.insert(tokens.end(), {"\xC4\xA0t", "<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  std::vector<int32_t> types(tokens.size(), 1);
  types[257] = types[258] = types[259] = 3;
  return GgufBuilder()
      .str("general.architecture", "llama")
      .str("tokenizer.ggml.model", "gpt2")
      .str("tokenizer.ggml.pre", "default")
      .strs("tokenizer.ggml.tokens", tokens)
      .i32s("tokenizer.ggml.token_type", types)
      .strs("tokenizer.ggml.merges", {"\xC4\xA0 t"})
      .u32("tokenizer.ggml.eos_token_id", 259)
      .str("tokenizer.chat_template",
           "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
      .build();
}

// The tokenizer of those bytes, built once.
inline const Tokenizer& tiny_tokenizer() {
  static const std::vector<uint8_t> bytes = tiny_tokenizer_gguf();
  static const GgufFile file = GgufFile::parse(bytes);
  static const Tokenizer tok = Tokenizer::from_gguf(file);
  return tok;
}

}  // namespace tqkv::engine::test
