#include "engine/model/generate.h"

#include <time.h>

#include <algorithm>
#include <chrono>

#include "tqkv/error.h"

namespace tqkv::engine {
namespace {

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

GenerateStats generate(const Model& model, const Tokenizer& tok, KvCache& cache, int64_t seq,
                       const std::vector<int32_t>& prompt, const GenerateOptions& opt,
                       const std::function<void(int32_t)>& on_token) {
  using clock = std::chrono::steady_clock;
  const int n_prompt = static_cast<int>(prompt.size());
  if (n_prompt == 0) throw Error(ErrorCode::InvalidArgument, "the prompt is empty");
  if (n_prompt >= cache.capacity())
    throw Error(ErrorCode::InvalidArgument, "the prompt has " + std::to_string(n_prompt) +
                                                " tokens but the context holds " + std::to_string(cache.capacity()) +
                                                "; shorten it or raise --ctx");
  if (cache.seq_len(seq) != 0) throw Error(ErrorCode::InvalidArgument, "generate needs an empty cache");
  GenerateStats st;
  st.n_prompt = n_prompt;
  const int V = model.config().n_vocab;
  std::vector<float> logits(V);
  Sampler sampler(opt.sampler);
  // Greedy decoding asks the device for each step's argmax (one id, not the logits, leaves a GPU).
  const bool greedy = opt.sampler.temperature == 0.0f;
  int32_t picked = 0;
  const LogitsOut out = greedy ? LogitsOut::greedy(&picked) : LogitsOut(logits.data());

  auto t0 = clock::now();
  double c0 = cpu_seconds();
  model.forward(seq, prompt.data(), n_prompt, cache, out, false);
  st.prompt_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  st.prompt_cpu_seconds = cpu_seconds() - c0;

  int64_t pos = n_prompt;
  for (int i = 0; i < opt.n_predict; ++i) {
    const int32_t id = greedy ? picked : sampler.sample(logits.data(), V);
    if (opt.stop_at_end_of_generation && tok.is_end_of_generation(id)) break;
    ++st.n_decoded;
    on_token(id);
    if (i + 1 == opt.n_predict || pos >= cache.capacity()) break;  // no need to run the last token
    t0 = clock::now();
    c0 = cpu_seconds();
    model.forward(seq, &id, 1, cache, out, false);
    st.decode_seconds += std::chrono::duration<double>(clock::now() - t0).count();
    st.decode_cpu_seconds += cpu_seconds() - c0;
    ++pos;
  }
  st.kv = cache.bytes(seq);
  return st;
}

}  // namespace tqkv::engine
