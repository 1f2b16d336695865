// libFuzzer target for the GGUF reader: parse arbitrary bytes, then do what a loader does
// with a file that parses (dequantize every tensor, build the tokenizer, render the chat
// template, tokenize a little). Only tqkv::Error may come out; anything else (a crash, an
// ASan/UBSan report, another exception type) is a finding. Run: tests/engine/fuzz/run_fuzz.sh
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/weights/dequant.h"
#include "engine/gguf/gguf.h"
#include "engine/gguf/tokenizer.h"
#include "tqkv/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tqkv::engine;
  try {
    GgufFile f = GgufFile::parse(std::span<const uint8_t>(data, size));
    std::vector<float> buf;
    for (const GgufTensor& t : f.tensors()) {
      if (t.n_elements() > (1 << 22)) continue;  // valid but too big to expand quickly
      buf.resize(static_cast<size_t>(t.n_elements()));
      dequantize_tensor(t, buf.data());
    }
    Tokenizer tok = Tokenizer::from_gguf(f);
    const auto ids = tok.encode("ab a<|im_end|> h\xc3\xa9 12", true, true);
    tok.decode(ids);
    try {
      tok.apply_chat_template({{"user", "a"}});
    } catch (const tqkv::Error&) {
    }
  } catch (const tqkv::Error&) {
  }
  return 0;
}
