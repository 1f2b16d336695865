// Perplexity of a model on a token stream with a given KV-cache format, and how far its
// next-token distributions move from those of an uncompressed (f32) cache: mean KL divergence
// KL(p_f32 || p_format) and top-1 agreement, over the same scored positions.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/model/model.h"

namespace tqkv::eval {

using engine::Model;

struct PerplexityOptions {
  int ctx = 512;            // tokens per chunk; chunks do not overlap and start with an empty cache
  int max_chunks = 0;       // 0: every full chunk of the text
  std::string format = "f32";  // a cache spec (cache_spec.h): a format name, a recipe, options
  int skip_layers = -1;     // uncompressed boundary layers (the spec's +skip<N>); < 0: the spec's
  bool compare_to_f32 = true;
  int batch = 512;          // most tokens of a forward pass (scored_context_passes)
  int32_t bos = -1;         // when >= 0, each chunk's first token is replaced by it (models that want BOS)
  // When set: receives the first chunk's raw logits [ctx, n_vocab] (other implementations of
  // the same model and cache, e.g. tqkv.transformers, are compared with them).
  std::vector<float>* first_chunk_logits = nullptr;
};

struct PerplexityResult {
  double ppl = 0;
  double kld = 0;    // mean KL(f32 || format), nats per token; 0 when format is f32
  double top1 = 1;   // fraction of scored positions whose argmax matches the f32 run
  int64_t tokens = 0;  // scored tokens
  int chunks = 0;
  double kv_bytes_per_token = 0;  // a full chunk's bytes per position, copies included
  double seconds = 0;
};

// Shared with eval.h. log_softmax: one row of logits, in place (sums in double).
// kl_divergence: KL(p_ref || p) of two log-softmax rows, nats.
void log_softmax(float* v, int n);
double kl_divergence(const float* logp_ref, const float* logp, int n);

// The forward passes [begin, end) of one context of ctx tokens whose second half [ctx / 2, ctx)
// is scored: the first half as a fresh prompt, then the scored half as continuation chunks that
// read the (compressed) history as decode does, each pass at most `batch` tokens. (A fresh
// prompt's queries attend to their own keys and values, not to the cache: scoring them would
// measure nothing of the cache.)
std::vector<std::pair<int, int>> scored_context_passes(int ctx, int batch);

// Scores the second half of each chunk (positions ctx/2 .. ctx-2 predicting the next token),
// so that every scored token has at least ctx/2 tokens of context, as llama.cpp's
// perplexity tool does. Throws tqkv::Error(InvalidArgument) when the text is shorter than
// one chunk. progress(chunks_done, chunks_total, ppl_so_far) is called after each chunk.
PerplexityResult perplexity(const Model& model, const std::vector<int32_t>& tokens, const PerplexityOptions& opt,
                            const std::function<void(int, int, double)>& progress = {});

}  // namespace tqkv::eval
