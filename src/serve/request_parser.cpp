#include "request_parser.h"

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <random>

namespace tqkv::serve {
namespace {

using json = nlohmann::json;

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int int_field(const json& body, const char* name, int dflt, int lo, int hi) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_number_integer()) throw BadRequest{400, std::string("'") + name + "' must be an integer", name};
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi)
    throw BadRequest{400, std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                              "], got " + std::to_string(x),
                     name};
  return static_cast<int>(x);
}

double num_field(const json& body, const char* name, double dflt, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_number()) throw BadRequest{400, std::string("'") + name + "' must be a number", name};
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi))
    throw BadRequest{400, std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                     name};
  return x;
}

bool bool_field(const json& body, const char* name, bool dflt) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_boolean()) throw BadRequest{400, std::string("'") + name + "' must be a boolean", name};
  return v->get<bool>();
}

constexpr int kMaxTopLogprobs = 20;  // OpenAI's limit for chat (5 for completions; we allow 20)

[[noreturn]] void unsupported(const char* name, const std::string& why) {
  throw BadRequest{400, std::string("'") + name + "' " + why + " is not supported", name};
}

// logit_bias: {"token id": bias in [-100, 100]}.
std::vector<std::pair<int32_t, float>> logit_bias(const json& body, int n_vocab) {
  std::vector<std::pair<int32_t, float>> out;
  const json* b = field(body, "logit_bias");
  if (!b) return out;
  if (!b->is_object() || b->size() > 1024)
    throw BadRequest{400, "'logit_bias' must be an object of at most 1024 token ids", "logit_bias"};
  for (const auto& [key, v] : b->items()) {
    char* end = nullptr;
    const long id = std::strtol(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || id < 0 || id >= n_vocab)
      throw BadRequest{400, "'logit_bias' keys must be token ids in [0, " + std::to_string(n_vocab) + "), got '" + key + "'",
                       "logit_bias"};
    if (!v.is_number() || !(v.get<double>() >= -100 && v.get<double>() <= 100))
      throw BadRequest{400, "'logit_bias' values must be numbers in [-100, 100]", "logit_bias"};
    out.emplace_back(static_cast<int32_t>(id), v.get<float>());
  }
  return out;
}

// Fields whose meaning the engine cannot give: refused by name rather than ignored.
void refuse_unsupported(const json& body, bool chat, bool logprobs) {
  if (int_field(body, "n", 1, 1, 1 << 20) != 1) unsupported("n", "other than 1");
  if (int_field(body, "best_of", 1, 1, 1 << 20) != 1) unsupported("best_of", "other than 1");
  if (const json* s = field(body, "suffix"); s && !(s->is_string() && s->get<std::string>().empty()))
    unsupported("suffix", "(insertion after the answer)");
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      throw BadRequest{400, "'response_format' must be an object with a string 'type'", "response_format"};
    if ((*rf)["type"] != "text") unsupported("response_format", "type '" + (*rf)["type"].get<std::string>() + "'");
  }
  for (const char* name : {"tools", "functions"})
    if (const json* t = field(body, name); t && !(t->is_array() && t->empty())) unsupported(name, "(tool calling)");
  if (!chat && bool_field(body, "echo", false) && logprobs) unsupported("echo", "with 'logprobs' (prompt log-probabilities)");
}

// What completions and chat completions share: model, sampling, limits, stop, stream.
void parse_common(const json& body, ParsedRequest& p, const Limits& lim, bool chat) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) throw BadRequest{400, "'model' must be a string", "model"};
    if (m->get<std::string>() != lim.model)
      throw BadRequest{404, "the model '" + m->get<std::string>() + "' does not exist (this server has '" + lim.model + "')",
                       "model", "model_not_found"};
  }
  // logprobs: completions take the number of alternatives (false: none); chat takes a boolean
  // and the number in top_logprobs.
  if (const json* lp = field(body, "logprobs"); lp && !(lp->is_boolean() && !lp->get<bool>())) {
    if (chat) {
      if (!lp->is_boolean()) throw BadRequest{400, "'logprobs' must be a boolean", "logprobs"};
      p.opt.logprobs = int_field(body, "top_logprobs", 0, 0, kMaxTopLogprobs);
    } else {
      p.opt.logprobs = int_field(body, "logprobs", 0, 0, kMaxTopLogprobs);
    }
  } else if (chat && field(body, "top_logprobs")) {
    int_field(body, "top_logprobs", 0, 0, kMaxTopLogprobs);
    throw BadRequest{400, "'top_logprobs' needs 'logprobs': true", "top_logprobs"};
  }
  refuse_unsupported(body, chat, p.opt.logprobs >= 0);
  p.stream = bool_field(body, "stream", false);
  const int n = static_cast<int>(p.prompt.size());
  const int room = std::max(1, lim.max_seq_len - n);
  const char* max_name = chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  // OpenAI: 16 for completions; chat answers may fill what the context leaves (capped).
  p.opt.max_tokens = int_field(body, max_name, chat ? std::min(room, 512) : 16, 1, 1 << 30);
  p.opt.sampler.temperature = static_cast<float>(num_field(body, "temperature", 1.0, 0.0, 2.0));
  p.opt.sampler.top_p = static_cast<float>(num_field(body, "top_p", 1.0, 1e-9, 1.0));
  p.opt.sampler.top_k = int_field(body, "top_k", 0, -1, 1 << 30);
  if (const json* s = field(body, "seed")) {
    if (!s->is_number_integer()) throw BadRequest{400, "'seed' must be an integer", "seed"};
    p.opt.sampler.seed = static_cast<uint64_t>(s->get<int64_t>());
  } else {
    p.opt.sampler.seed = std::random_device{}();
  }
  p.opt.ignore_eos = bool_field(body, "ignore_eos", false);
  p.opt.logit_bias = logit_bias(body, lim.n_vocab);
  p.opt.presence_penalty = static_cast<float>(num_field(body, "presence_penalty", 0.0, -2.0, 2.0));
  p.opt.frequency_penalty = static_cast<float>(num_field(body, "frequency_penalty", 0.0, -2.0, 2.0));
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      p.opt.stop.push_back(s->get<std::string>());
    } else if (s->is_array() && s->size() <= 4) {
      for (const json& x : *s) {
        if (!x.is_string()) throw BadRequest{400, "'stop' must be a string or up to 4 strings", "stop"};
        p.opt.stop.push_back(x.get<std::string>());
      }
    } else {
      throw BadRequest{400, "'stop' must be a string or up to 4 strings", "stop"};
    }
    for (const std::string& x : p.opt.stop)
      if (x.empty()) throw BadRequest{400, "'stop' strings must not be empty", "stop"};
  }
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw BadRequest{400, "'stream_options' must be an object", "stream_options"};
    if (!p.stream) throw BadRequest{400, "'stream_options' needs 'stream': true", "stream_options"};
    const json* usage = field(*so, "include_usage");
    if (usage && !usage->is_boolean())
      throw BadRequest{400, "'stream_options.include_usage' must be a boolean", "stream_options"};
    p.include_usage = usage && usage->get<bool>();
  }
}

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw BadRequest{400, std::string("the body is not valid JSON: ") + e.what(), ""};
  }
  if (!j.is_object()) throw BadRequest{400, "the body must be a JSON object", ""};
  return j;
}

// The prompt's tokens. Text that could never fit the context (more bytes than max_seq_len
// tokens can cover) is refused before it is tokenized.
std::vector<int32_t> encode(const engine::Tokenizer& tok, const std::string& text, int max_seq_len) {
  const size_t fewest = text.size() / tok.max_token_bytes();
  if (fewest >= static_cast<size_t>(max_seq_len))
    throw BadRequest{400, "the prompt has " + std::to_string(text.size()) + " bytes, at least " + std::to_string(fewest) +
                              " tokens, but the context holds " + std::to_string(max_seq_len),
                     "prompt"};
  const bool bos_in_text = tok.bos() >= 0 && text.rfind(tok.piece(tok.bos()), 0) == 0;
  return tok.encode(text, true, tok.add_bos() && !bos_in_text);
}

// The prompt of a completions request: a string, one string in an array, or token ids.
std::vector<int32_t> completion_prompt(const engine::Tokenizer& tok, const json& body, int max_seq_len) {
  std::vector<int32_t> prompt;
  const json* pr = field(body, "prompt");
  if (!pr) throw BadRequest{400, "'prompt' is required", "prompt"};
  if (pr->is_array() && pr->size() == 1 && (*pr)[0].is_string()) pr = &(*pr)[0];
  if (pr->is_string()) {
    prompt = encode(tok, pr->get<std::string>(), max_seq_len);
  } else if (pr->is_array() && !pr->empty() && (*pr)[0].is_number_integer()) {
    for (const json& t : *pr) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.n_vocab())
        throw BadRequest{400, "'prompt' token ids must be integers in [0, " + std::to_string(tok.n_vocab()) + ")",
                         "prompt"};
      prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  } else {
    throw BadRequest{400, "'prompt' must be a string, one string in an array, or an array of token ids", "prompt"};
  }
  if (prompt.empty()) throw BadRequest{400, "the prompt is empty", "prompt"};
  return prompt;
}

// A message's text: a string, or an array of text parts (joined by newlines); an assistant's
// may be null (a turn that only called tools).
std::string message_text(const json& m, const std::string& role, const std::string& where) {
  const auto it = m.find("content");
  if (it != m.end() && it->is_string()) return it->get<std::string>();
  if (role == "assistant" && (it == m.end() || it->is_null())) return "";
  if (it == m.end() || !it->is_array())
    throw BadRequest{400, where + ".content must be a string or an array of text parts", "messages"};
  std::string text;
  for (size_t j = 0; j < it->size(); ++j) {
    const json& part = (*it)[j];
    const std::string at = where + ".content[" + std::to_string(j) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      throw BadRequest{400, at + " must be an object with a string 'type'", "messages"};
    if (part["type"] != "text") unsupported("messages", "content part type '" + part["type"].get<std::string>() + "' (" + at + ")");
    if (!part.contains("text") || !part["text"].is_string()) throw BadRequest{400, at + ".text must be a string", "messages"};
    if (j > 0) text += "\n";
    text += part["text"].get<std::string>();
  }
  return text;
}

// The messages of a chat request. "developer" (OpenAI's newer name for system) is a system turn.
std::vector<engine::ChatMessage> chat_messages(const json& body) {
  const json* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array() || msgs->empty()) throw BadRequest{400, "'messages' must be a non-empty array", "messages"};
  std::vector<engine::ChatMessage> out;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw BadRequest{400, where + " needs a string 'role'", "messages"};
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant")
      throw BadRequest{400, "unknown role '" + role + "' in " + where + " (system, developer, user, assistant)", "messages"};
    out.push_back({role, message_text(m, role, where)});
  }
  return out;
}

}  // namespace

ParsedRequest parse_completion_request(const std::string& body_text, const engine::Tokenizer& tok, const Limits& lim) {
  ParsedRequest p;
  const json body = parse_body(body_text);
  p.prompt = completion_prompt(tok, body, lim.max_seq_len);
  parse_common(body, p, lim, false);
  if (bool_field(body, "echo", false)) p.echo = tok.decode(p.prompt, /*skip_control=*/false);
  return p;
}

ParsedRequest parse_chat_request(const std::string& body_text, const engine::Tokenizer& tok, const Limits& lim) {
  ParsedRequest p;
  const json body = parse_body(body_text);
  p.prompt = encode(tok, tok.apply_chat_template(chat_messages(body), true), lim.max_seq_len);
  parse_common(body, p, lim, true);
  return p;
}

}  // namespace tqkv::serve
