#include "model_runner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/core/batch.h"
#include "tqkv/error.h"

namespace tqkv::serve {
namespace {

// Bytes at the end of s that start a UTF-8 character not yet complete.
size_t incomplete_utf8_tail(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    size_t len = 1;
    if ((c & 0xE0) == 0xC0) len = 2;
    else if ((c & 0xF0) == 0xE0) len = 3;
    else if ((c & 0xF8) == 0xF0) len = 4;
    return len > back ? back : 0;
  }
  return 0;
}

}  // namespace

float token_logprobs(const float* logits, int n_vocab, int32_t token, int n, std::vector<TokenLogprob>& top) {
  const float mx = *std::max_element(logits, logits + n_vocab);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  const float log_z = mx + static_cast<float>(std::log(sum));
  top.clear();
  n = std::clamp(n, 0, n_vocab);
  if (n > 0) {
    std::vector<int32_t> idx(static_cast<size_t>(n_vocab));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int i = 0; i < n; ++i) top.push_back({idx[i], logits[idx[i]] - log_z});
  }
  return logits[token] - log_z;
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    case FinishReason::None: break;
  }
  return "";
}

ModelRunner::ModelRunner(const engine::Model& model, const engine::Tokenizer& tok, const engine::CacheSpec& spec,
                         int capacity, int max_seqs)
    : model_(model), tok_(tok), cache_(model.make_cache(spec, capacity, max_seqs)) {}

void ModelRunner::add(int64_t id, const RequestOptions& opt, int n_prompt) {
  State s;
  s.opt = opt;
  s.sampler = std::make_unique<engine::Sampler>(opt.sampler);  // checks the parameters
  s.n_prompt = n_prompt;
  reqs_[id] = std::move(s);
}

void ModelRunner::remove(int64_t id) {
  auto it = reqs_.find(id);
  if (it == reqs_.end()) return;
  if (it->second.seq >= 0) cache_->free_sequence(it->second.seq);
  reqs_.erase(it);
}

bool ModelRunner::append_text(State& s, int32_t token) {
  if (!tok_.is_control(token)) s.text += tok_.piece(token);
  // A stop string can only end in the new bytes: search from where it could have started.
  size_t longest = 0;
  for (const std::string& stop : s.opt.stop) longest = std::max(longest, stop.size());
  const size_t from = s.emitted > longest ? s.emitted - longest : 0;
  size_t cut = std::string::npos;
  for (const std::string& stop : s.opt.stop) {
    if (stop.empty()) continue;
    const size_t at = s.text.find(stop, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut == std::string::npos) return false;
  s.text.resize(std::max(cut, s.emitted));
  return true;
}

std::string ModelRunner::take_emittable(State& s, bool final) {
  size_t end = s.text.size();
  if (!final) {
    end -= incomplete_utf8_tail(s.text);
    // Hold back the longest tail that is the start of a stop string.
    size_t hold = 0;
    for (const std::string& stop : s.opt.stop)
      for (size_t k = std::min(stop.size() - (stop.empty() ? 0 : 1), end - s.emitted); k > hold; --k)
        if (s.text.compare(end - k, k, stop, 0, k) == 0) {
          hold = k;
          break;
        }
    end -= hold;
  }
  if (end <= s.emitted) return {};
  std::string out = s.text.substr(s.emitted, end - s.emitted);
  s.emitted = end;
  return out;
}

const float* ModelRunner::sampling_logits(const State& s, const float* row, int n_vocab) {
  if (!s.opt.adjusts_logits()) return row;
  adjusted_.assign(row, row + n_vocab);
  for (const auto& [token, bias] : s.opt.logit_bias)
    if (token >= 0 && token < n_vocab) adjusted_[token] += bias;
  for (const auto& [token, n] : s.counts)
    adjusted_[token] -= s.opt.presence_penalty + s.opt.frequency_penalty * static_cast<float>(n);
  return adjusted_.data();
}

std::vector<TokenEvent> ModelRunner::step(const StepPlan& plan, Scheduler& sched) {
  for (int64_t id : plan.preempted) {
    auto it = reqs_.find(id);
    if (it != reqs_.end() && it->second.seq >= 0) {
      cache_->free_sequence(it->second.seq);
      it->second.seq = -1;
    }
  }
  if (plan.empty()) return {};
  engine::Batch batch;
  std::vector<int64_t> sampled;
  for (const ScheduledChunk& c : plan.chunks) {
    State& s = reqs_.at(c.request);
    const std::vector<int32_t>& toks = sched.tokens(c.request);
    if (c.pos0 == 0 || c.copy_from >= 0) {  // admitted: a new cache sequence
      if (s.seq >= 0) cache_->free_sequence(s.seq);
      s.seq = cache_->add_sequence();
    }
    if (c.copy_from >= 0) {  // a prompt prefix another request computed: copy it, or compute it here
      const int64_t src = reqs_.at(c.copy_from).seq;
      if (src >= 0 && cache_->copy_prefix(src, s.seq, c.pos0)) {
        copied_tokens_ += c.pos0;
        batch.add(s.seq, toks.data() + c.pos0, c.count, c.pos0, false);
      } else {
        batch.add(s.seq, toks.data(), static_cast<int>(c.pos0) + c.count, 0, false);
      }
    } else {
      batch.add(s.seq, toks.data() + c.pos0, c.count, c.pos0, false);
    }
    if (c.sample) sampled.push_back(c.request);
    else batch.logits.back() = 0;
  }
  const int V = model_.config().n_vocab;
  // A step whose sampled requests are all greedy without logprobs asks the device for argmax ids
  // only: on a GPU one id per request crosses to the host instead of its row of logits.
  bool greedy_only = !sampled.empty();
  for (const int64_t id : sampled) {
    const RequestOptions& o = reqs_.at(id).opt;
    greedy_only = greedy_only && o.sampler.temperature == 0.0f && o.logprobs < 0 && !o.adjusts_logits();
  }
  std::vector<int32_t> picks(greedy_only ? sampled.size() : 0);
  if (greedy_only) {
    model_.forward(batch, *cache_, engine::LogitsOut::greedy(picks.data()));
  } else {
    logits_.resize(sampled.size() * static_cast<size_t>(V));
    model_.forward(batch, *cache_, logits_.data());
  }

  std::vector<TokenEvent> events;
  for (size_t i = 0; i < sampled.size(); ++i) {
    const int64_t id = sampled[i];
    State& s = reqs_.at(id);
    TokenEvent ev;
    ev.request = id;
    ev.n_prompt = s.n_prompt;
    const float* logits = greedy_only ? nullptr : logits_.data() + i * V;
    const int32_t token = greedy_only ? picks[i] : s.sampler->sample(sampling_logits(s, logits, V), V);
    if (!s.opt.ignore_eos && tok_.is_end_of_generation(token)) {
      ev.finish = FinishReason::Stop;
    } else {
      ev.token = token;
      if (s.opt.logprobs >= 0) ev.logprob = token_logprobs(logits, V, token, s.opt.logprobs, ev.top);
      ++s.n_generated;
      if (s.opt.presence_penalty != 0 || s.opt.frequency_penalty != 0) ++s.counts[token];
      if (append_text(s, token)) ev.finish = FinishReason::Stop;
      else if (s.n_generated >= s.opt.max_tokens) ev.finish = FinishReason::Length;
    }
    ev.text = take_emittable(s, ev.finish != FinishReason::None);
    ev.n_generated = s.n_generated;
    if (ev.finish == FinishReason::None) {
      sched.append_token(id, token);
    } else {
      sched.finish(id);
      remove(id);
    }
    events.push_back(std::move(ev));
  }
  return events;
}

}  // namespace tqkv::serve
