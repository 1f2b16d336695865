// The model runner of `tqkv serve`: executes a scheduler's step plan (scheduler.h) on the
// engine — one Model::forward over a varlen Batch of every planned chunk, on one KvCache of
// max_seqs sequences — then samples a token for every chunk that asks for one, with each
// request's own Sampler, and decides what the request does next: continue (the token goes
// back to the scheduler), or finish at end of generation, a stop string or max_tokens.
//
// Text: each new token's bytes are appended to the request's text; what is emitted holds back
// an incomplete UTF-8 character and any tail that could still become a stop string, so a
// streamed answer never shows a stop string or half a character.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/cache/kv_cache.h"
#include "engine/model/model.h"
#include "engine/core/sampler.h"
#include "engine/gguf/tokenizer.h"
#include "scheduler.h"

namespace tqkv::serve {

struct RequestOptions {
  int max_tokens = 16;
  engine::SamplerParams sampler;  // temperature 0: greedy
  std::vector<std::string> stop;  // stop strings (not part of the answer)
  bool ignore_eos = false;
  // Log-probabilities of each generated token and of the `logprobs` most likely ones (OpenAI's
  // completions `logprobs` N, chat `top_logprobs` N), from the model's distribution (the
  // log-softmax of the logits, before temperature, top-k and top-p); -1: none.
  int logprobs = -1;
  // Added to the logits before sampling (OpenAI's logit_bias: token id -> bias).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // OpenAI's penalties over the tokens generated so far: a token's logit loses presence once
  // it has appeared and frequency for every time it has.
  float presence_penalty = 0, frequency_penalty = 0;
  bool adjusts_logits() const { return !logit_bias.empty() || presence_penalty != 0 || frequency_penalty != 0; }
};

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
};

enum class FinishReason { None, Stop, Length, Abort };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", ""

// What one step produced for one request.
struct TokenEvent {
  int64_t request = 0;
  int32_t token = -1;  // the sampled token; -1 when the request ended without one (end of generation)
  std::string text;    // new text to show (may be empty while a stop string could be forming)
  FinishReason finish = FinishReason::None;
  int n_prompt = 0;     // usage: prompt tokens
  int n_generated = 0;  // usage: tokens generated so far (end-of-generation and stop tokens excluded)
  // With RequestOptions::logprobs >= 0 and a token: its log-probability, and the most likely
  // tokens (most likely first).
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

// log p(token) over logits [n_vocab] and the `n` most likely tokens (most likely first).
float token_logprobs(const float* logits, int n_vocab, int32_t token, int n, std::vector<TokenLogprob>& top);

class ModelRunner {
 public:
  // A cache of max_seqs sequences of `capacity` positions on the model's device.
  ModelRunner(const engine::Model& model, const engine::Tokenizer& tok, const engine::CacheSpec& spec, int capacity,
              int max_seqs);

  engine::KvCache& cache() { return *cache_; }
  const engine::Tokenizer& tokenizer() const { return tok_; }

  // Registers a request before its first step. Throws tqkv::Error(InvalidArgument) for bad
  // sampling parameters.
  void add(int64_t id, const RequestOptions& opt, int n_prompt);
  // Forgets a request and frees its cache sequence (finished, aborted); unknown ids are ignored.
  void remove(int64_t id);

  // Runs one step: frees the cache sequences of preempted requests, runs every chunk in one
  // forward pass, samples, and reports tokens and finishes to the scheduler (append_token,
  // finish). Returns one event per sampled request, in plan order.
  std::vector<TokenEvent> step(const StepPlan& plan, Scheduler& sched);

  // Prompt positions copied from another request's cache sequence instead of computed.
  int64_t copied_tokens() const { return copied_tokens_; }

 private:
  struct State {
    RequestOptions opt;
    std::unique_ptr<engine::Sampler> sampler;
    int64_t seq = -1;  // cache sequence; -1 when it holds none (not started, preempted)
    int n_prompt = 0;
    int n_generated = 0;
    std::string text;     // the whole answer so far
    size_t emitted = 0;   // bytes of text already reported
    std::unordered_map<int32_t, int> counts;  // generated tokens (for the penalties)
  };
  // The logits a request samples from: its row with logit_bias and the penalties applied
  // (in adjusted_), or the row itself when it asks for neither.
  const float* sampling_logits(const State& s, const float* row, int n_vocab);
  // Appends a token's text; returns true when a stop string ended the answer (text cut there).
  bool append_text(State& s, int32_t token);
  std::string take_emittable(State& s, bool final);

  const engine::Model& model_;
  const engine::Tokenizer& tok_;
  std::unique_ptr<engine::KvCache> cache_;
  std::unordered_map<int64_t, State> reqs_;
  std::vector<float> logits_, adjusted_;
  int64_t copied_tokens_ = 0;
};

}  // namespace tqkv::serve
