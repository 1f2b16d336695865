// One request body of the OpenAI-style endpoints (completions, chat completions) parsed and
// checked: the JSON, each field's type and range, the fields the engine cannot honour (refused
// by name, never ignored), and the prompt's tokens. Apart from the HTTP server so that it is
// tested field by field and fuzzed without a socket (tests/serve/test_request_parser.cpp,
// tests/serve/fuzz/fuzz_request.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/gguf/tokenizer.h"
#include "model_runner.h"

namespace tqkv::serve {

// A checked generation request: prompt tokens and what the engine needs.
struct ParsedRequest {
  std::vector<int32_t> prompt;
  RequestOptions opt;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with usage alone
  std::string echo;            // completions' echo: the prompt's text, before the answer
};

// What a request is checked against.
struct Limits {
  int max_seq_len;
  int n_vocab;
  std::string model;  // the one model served
};

// A request the client got wrong: OpenAI's error object with a 4xx status; param names the
// field (empty when the body as a whole is wrong).
struct BadRequest {
  int status;
  std::string message;
  std::string param;
  std::string code = "";
};

// POST /v1/completions. Throws BadRequest.
ParsedRequest parse_completion_request(const std::string& body, const engine::Tokenizer& tok, const Limits& lim);
// POST /v1/chat/completions. Throws BadRequest, or tqkv::Error(InvalidArgument) when the
// model's chat template cannot be rendered.
ParsedRequest parse_chat_request(const std::string& body, const engine::Tokenizer& tok, const Limits& lim);

}  // namespace tqkv::serve
