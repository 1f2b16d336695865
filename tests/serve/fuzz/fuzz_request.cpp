// libFuzzer target for the server's request parsing (src/serve/request_parser.h): arbitrary
// bytes as the body of POST /v1/completions and of POST /v1/chat/completions, against a small
// byte-level tokenizer (tests/engine/tiny_tokenizer.h). Only BadRequest (the client's 4xx) and
// tqkv::Error may come out; anything else (a crash, an ASan/UBSan report, a JSON library
// exception, which the server would answer with 500) is a finding, and so is an accepted
// request that breaks what the engine relies on (prompt ids in the vocabulary, every option in
// its range). Run: tests/engine/fuzz/run_fuzz.sh
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/tiny_tokenizer.h"
#include "serve/request_parser.h"
#include "tqkv/error.h"

namespace {

using namespace tqkv;

constexpr int kCtx = 64;

const engine::Tokenizer& tokenizer() { return engine::test::tiny_tokenizer(); }

void check(const serve::ParsedRequest& p, const serve::Limits& lim) {
  bool ok = !p.prompt.empty() && p.opt.max_tokens >= 1 && p.opt.sampler.temperature >= 0 &&
            p.opt.sampler.temperature <= 2 && p.opt.sampler.top_p > 0 && p.opt.sampler.top_p <= 1 &&
            p.opt.logprobs >= -1 && p.opt.logprobs <= 20 && p.opt.stop.size() <= 4 &&
            p.opt.presence_penalty >= -2 && p.opt.presence_penalty <= 2 && p.opt.frequency_penalty >= -2 &&
            p.opt.frequency_penalty <= 2 && (p.stream || !p.include_usage);
  for (int32_t id : p.prompt) ok = ok && id >= 0 && id < lim.n_vocab;
  for (const auto& [id, bias] : p.opt.logit_bias) ok = ok && id >= 0 && id < lim.n_vocab && bias >= -100 && bias <= 100;
  for (const std::string& s : p.opt.stop) ok = ok && !s.empty();
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  const serve::Limits lim{kCtx, engine::test::kTinyTokenizerVocab, "tiny"};
  for (bool chat : {false, true}) {
    try {
      check(chat ? serve::parse_chat_request(body, tokenizer(), lim)
                 : serve::parse_completion_request(body, tokenizer(), lim),
            lim);
    } catch (const serve::BadRequest& e) {
      if (e.status < 400 || e.status > 499 || e.message.empty()) std::abort();
    } catch (const Error&) {
    }
  }
  return 0;
}
