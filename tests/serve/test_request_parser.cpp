// The request parser of the server (src/serve/request_parser.h) alone, field by field: every
// field's bad values give a 4xx naming that field, and good values reach the engine's options.
// No model, no socket: a small byte-level tokenizer (tests/engine/tiny_tokenizer.h).
#include "serve/request_parser.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/tiny_tokenizer.h"
#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

using json = nlohmann::json;

constexpr int kCtx = 64;

const engine::Tokenizer& tokenizer() { return engine::test::tiny_tokenizer(); }

const Limits kLimits{kCtx, engine::test::kTinyTokenizerVocab, "tiny"};

ParsedRequest parse(const std::string& body, bool chat) {
  return chat ? parse_chat_request(body, tokenizer(), kLimits) : parse_completion_request(body, tokenizer(), kLimits);
}

// parse() of a request that must be accepted: a refusal fails the test with its message.
ParsedRequest good(const std::string& body, bool chat) {
  try {
    return parse(body, chat);
  } catch (const BadRequest& e) {
    ADD_FAILURE() << "refused (" << e.param << "): " << e.message << "\n  " << body;
  }
  return {};
}

// A valid request of either kind with `extra` merged in (a null value removes the field).
std::string with(const json& extra, bool chat) {
  json body = chat ? json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}} : json{{"prompt", "hi"}};
  body.merge_patch(extra);
  return body.dump();
}

struct Bad {
  bool chat;
  json extra;         // merged into a valid request (or, when a string, the whole body)
  std::string param;  // the field the error names ("" for the body as a whole)
  int status = 400;
};

TEST(RequestParser, EveryFieldsBadValuesAreRefusedByName) {
  const json long_bias = [] {
    json b = json::object();
    for (int i = 0; i < 1025; ++i) b[std::to_string(i % 260) + std::string(i / 260, ' ')] = 1;
    return b;
  }();
  const std::vector<Bad> cases = {
      {false, "{not json", ""},
      {false, "[1, 2]", ""},
      {false, "\"prompt\"", ""},
      {false, {{"model", 5}}, "model"},
      {false, {{"model", "gpt-4"}}, "model", 404},
      {true, {{"model", "gpt-4"}}, "model", 404},
      {false, {{"prompt", nullptr}}, "prompt"},
      {false, {{"prompt", 5}}, "prompt"},
      {false, {{"prompt", ""}}, "prompt"},
      {false, {{"prompt", json::array()}}, "prompt"},
      {false, {{"prompt", {1, -5}}}, "prompt"},
      {false, {{"prompt", {1, 260}}}, "prompt"},
      {false, {{"prompt", {1, "a"}}}, "prompt"},
      {false, {{"prompt", {1, 2.5}}}, "prompt"},
      {false, {{"prompt", {"a", "b"}}}, "prompt"},
      {false, {{"prompt", true}}, "prompt"},
      {false, {{"prompt", std::string(kCtx * 20, 'a')}}, "prompt"},
      {false, {{"max_tokens", "8"}}, "max_tokens"},
      {false, {{"max_tokens", 0}}, "max_tokens"},
      {false, {{"max_tokens", -1}}, "max_tokens"},
      {false, {{"max_tokens", 1.5}}, "max_tokens"},
      {false, {{"max_tokens", int64_t{1} << 31}}, "max_tokens"},
      {true, {{"max_completion_tokens", 0}}, "max_completion_tokens"},
      {true, {{"max_completion_tokens", "5"}}, "max_completion_tokens"},
      {false, {{"temperature", "hot"}}, "temperature"},
      {false, {{"temperature", -0.5}}, "temperature"},
      {false, {{"temperature", 2.01}}, "temperature"},
      {false, {{"temperature", true}}, "temperature"},
      {false, {{"top_p", 0}}, "top_p"},
      {false, {{"top_p", -0.1}}, "top_p"},
      {false, {{"top_p", 1.5}}, "top_p"},
      {false, {{"top_p", "x"}}, "top_p"},
      {false, {{"top_k", -2}}, "top_k"},
      {false, {{"top_k", 1.5}}, "top_k"},
      {false, {{"top_k", "x"}}, "top_k"},
      {false, {{"top_k", int64_t{1} << 31}}, "top_k"},
      {false, {{"seed", "1"}}, "seed"},
      {false, {{"seed", 1.5}}, "seed"},
      {false, {{"seed", true}}, "seed"},
      {false, {{"ignore_eos", "yes"}}, "ignore_eos"},
      {false, {{"ignore_eos", 1}}, "ignore_eos"},
      {false, {{"logit_bias", json::array()}}, "logit_bias"},
      {false, {{"logit_bias", "x"}}, "logit_bias"},
      {false, {{"logit_bias", {{"x", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"5x", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"-1", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"260", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"99999999999999999999", 1}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"5", 100.5}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"5", -101}}}}, "logit_bias"},
      {false, {{"logit_bias", {{"5", "a"}}}}, "logit_bias"},
      {false, {{"logit_bias", long_bias}}, "logit_bias"},
      {false, {{"presence_penalty", 2.5}}, "presence_penalty"},
      {false, {{"presence_penalty", -2.5}}, "presence_penalty"},
      {false, {{"presence_penalty", "a"}}, "presence_penalty"},
      {false, {{"frequency_penalty", 2.5}}, "frequency_penalty"},
      {false, {{"frequency_penalty", -2.5}}, "frequency_penalty"},
      {false, {{"frequency_penalty", "a"}}, "frequency_penalty"},
      {false, {{"stop", 3}}, "stop"},
      {false, {{"stop", ""}}, "stop"},
      {false, {{"stop", {"a", 3}}}, "stop"},
      {false, {{"stop", {"a", ""}}}, "stop"},
      {false, {{"stop", {"a", "b", "c", "d", "e"}}}, "stop"},
      {false, {{"stop", {{"a", 1}}}}, "stop"},
      {false, {{"stream", "yes"}}, "stream"},
      {false, {{"stream", 1}}, "stream"},
      {false, {{"stream", true}, {"stream_options", 5}}, "stream_options"},
      {false, {{"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {false, {{"stream", true}, {"stream_options", {{"include_usage", "yes"}}}}, "stream_options"},
      {false, {{"logprobs", 21}}, "logprobs"},
      {false, {{"logprobs", -1}}, "logprobs"},
      {false, {{"logprobs", "yes"}}, "logprobs"},
      {false, {{"logprobs", true}}, "logprobs"},
      {false, {{"logprobs", 1.5}}, "logprobs"},
      {true, {{"logprobs", 3}}, "logprobs"},
      {true, {{"logprobs", "yes"}}, "logprobs"},
      {true, {{"top_logprobs", 2}}, "top_logprobs"},
      {true, {{"logprobs", true}, {"top_logprobs", 21}}, "top_logprobs"},
      {true, {{"logprobs", true}, {"top_logprobs", -1}}, "top_logprobs"},
      {true, {{"logprobs", true}, {"top_logprobs", "2"}}, "top_logprobs"},
      {false, {{"n", 2}}, "n"},
      {false, {{"n", 0}}, "n"},
      {false, {{"n", "1"}}, "n"},
      {false, {{"best_of", 2}}, "best_of"},
      {false, {{"best_of", 0}}, "best_of"},
      {false, {{"suffix", "end"}}, "suffix"},
      {false, {{"suffix", 5}}, "suffix"},
      {true, {{"response_format", "text"}}, "response_format"},
      {true, {{"response_format", json::object()}}, "response_format"},
      {true, {{"response_format", {{"type", 5}}}}, "response_format"},
      {true, {{"response_format", {{"type", "json_object"}}}}, "response_format"},
      {true, {{"tools", {{{"type", "function"}}}}}, "tools"},
      {true, {{"tools", 5}}, "tools"},
      {true, {{"functions", {json::object()}}}, "functions"},
      {false, {{"echo", "yes"}}, "echo"},
      {false, {{"echo", true}, {"logprobs", 2}}, "echo"},
      {true, {{"messages", nullptr}}, "messages"},
      {true, {{"messages", json::array()}}, "messages"},
      {true, {{"messages", 5}}, "messages"},
      {true, {{"messages", {5}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}}}}}, "messages"},
      {true, {{"messages", {{{"role", 5}, {"content", "x"}}}}}, "messages"},
      {true, {{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", 5}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", nullptr}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", {5}}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}}}}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", 5}}}}}}}}, "messages"},
      {true, {{"messages", {{{"role", "user"}, {"content", std::string(kCtx * 20, 'a')}}}}}, "prompt"},
  };
  for (const Bad& c : cases) {
    const std::string body = c.extra.is_string() ? c.extra.get<std::string>() : with(c.extra, c.chat);
    SCOPED_TRACE((c.chat ? "chat: " : "completions: ") + body.substr(0, 200));
    try {
      parse(body, c.chat);
      ADD_FAILURE() << "accepted";
    } catch (const BadRequest& e) {
      EXPECT_EQ(e.status, c.status) << e.message;
      EXPECT_EQ(e.param, c.param) << e.message;
      EXPECT_FALSE(e.message.empty());
      if (c.status == 404) {
        EXPECT_EQ(e.code, "model_not_found");
      }
    }
  }
}

TEST(RequestParser, GoodValuesReachTheOptions) {
  const ParsedRequest p = good(with({{"model", "tiny"},
                                      {"prompt", {5, 6, 7}},
                                      {"max_tokens", 9},
                                      {"temperature", 0.5},
                                      {"top_p", 0.25},
                                      {"top_k", 3},
                                      {"seed", 42},
                                      {"ignore_eos", true},
                                      {"logit_bias", {{"7", -100}, {"259", 2.5}}},
                                      {"presence_penalty", 1.5},
                                      {"frequency_penalty", -0.5},
                                      {"stop", {"a", "bc"}},
                                      {"stream", true},
                                      {"stream_options", {{"include_usage", true}}},
                                      {"logprobs", 4},
                                      {"n", 1},
                                      {"best_of", 1},
                                      {"suffix", ""},
                                      {"frobnicate", {{"x", 1}}}},
                                     false),
                                false);
  EXPECT_EQ(p.prompt, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(p.opt.max_tokens, 9);
  EXPECT_EQ(p.opt.sampler.temperature, 0.5f);
  EXPECT_EQ(p.opt.sampler.top_p, 0.25f);
  EXPECT_EQ(p.opt.sampler.top_k, 3);
  EXPECT_EQ(p.opt.sampler.seed, 42u);
  EXPECT_TRUE(p.opt.ignore_eos);
  ASSERT_EQ(p.opt.logit_bias.size(), 2u);
  EXPECT_EQ(p.opt.logit_bias[0], (std::pair<int32_t, float>{259, 2.5f}));  // JSON objects are ordered by key
  EXPECT_EQ(p.opt.logit_bias[1], (std::pair<int32_t, float>{7, -100.0f}));
  EXPECT_EQ(p.opt.presence_penalty, 1.5f);
  EXPECT_EQ(p.opt.frequency_penalty, -0.5f);
  EXPECT_EQ(p.opt.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  EXPECT_EQ(p.opt.logprobs, 4);
  EXPECT_TRUE(p.echo.empty());

  // Defaults (null is absent): OpenAI's 16 tokens for completions, temperature 1, no cut.
  const ParsedRequest d = good(with({{"max_tokens", nullptr}, {"temperature", nullptr}, {"stop", "x"}}, false), false);
  EXPECT_EQ(d.opt.max_tokens, 16);
  EXPECT_EQ(d.opt.sampler.temperature, 1.0f);
  EXPECT_EQ(d.opt.sampler.top_p, 1.0f);
  EXPECT_EQ(d.opt.sampler.top_k, 0);
  EXPECT_EQ(d.opt.logprobs, -1);
  EXPECT_FALSE(d.stream);
  EXPECT_EQ(d.opt.stop, (std::vector<std::string>{"x"}));
  EXPECT_EQ(good(with({{"prompt", {"hi"}}}, false), false).prompt, good(with(json::object(), false), false).prompt);
  EXPECT_EQ(good(with({{"echo", true}}, false), false).echo, "hi");
  EXPECT_EQ(good(with({{"logprobs", false}}, false), false).opt.logprobs, -1);

  // Chat: the prompt is the rendered template; max_completion_tokens wins; logprobs + top_logprobs.
  const ParsedRequest c = good(with({{"max_completion_tokens", 5}, {"logprobs", true}, {"top_logprobs", 3}}, true), true);
  EXPECT_EQ(tokenizer().decode(c.prompt, false), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(c.opt.max_tokens, 5);
  EXPECT_EQ(c.opt.logprobs, 3);
  EXPECT_EQ(good(with(json::object(), true), true).opt.max_tokens, kCtx - static_cast<int>(c.prompt.size()));  // what is left
  const json parts = {{"messages", {{{"role", "developer"}, {"content", {{{"type", "text"}, {"text", "a"}},
                                                                          {{"type", "text"}, {"text", "b"}}}}},
                                    {{"role", "assistant"}, {"content", nullptr}},
                                    {{"role", "user"}, {"content", "hi"}}}}};
  const json plain = {{"messages", {{{"role", "system"}, {"content", "a\nb"}},
                                    {{"role", "assistant"}, {"content", ""}},
                                    {{"role", "user"}, {"content", "hi"}}}}};
  EXPECT_EQ(good(parts.dump(), true).prompt, good(plain.dump(), true).prompt);
}

// The request fuzzer's corpus (tests/serve/fuzz/fuzz_request.cpp) replayed in every build: each
// body is accepted or refused with a 4xx by both endpoints, and the seeds named for one are
// accepted by it.
TEST(RequestParser, FuzzCorpusRegression) {
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(TQKV_SERVE_FUZZ_CORPUS)) {
    if (!e.is_regular_file()) continue;
    SCOPED_TRACE(e.path().string());
    ++files;
    std::ifstream in(e.path(), std::ios::binary);
    const std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string name = e.path().stem().string();
    for (bool chat : {false, true}) {
      const bool must_pass = name.rfind(chat ? "seed_chat" : "seed_completion", 0) == 0 &&
                             name.find("refused") == std::string::npos;
      try {
        parse(body, chat);
      } catch (const BadRequest& b) {
        EXPECT_TRUE(b.status >= 400 && b.status < 500 && !b.message.empty()) << b.status << " " << b.message;
        EXPECT_FALSE(must_pass) << b.message;
      } catch (const Error& err) {
        EXPECT_FALSE(must_pass) << err.what();
      }
    }
  }
  EXPECT_GE(files, 9);
  EXPECT_LT(files, 200);  // kept small: run_fuzz.sh --grow merges only what adds coverage
}

}  // namespace
}  // namespace tqkv::serve
