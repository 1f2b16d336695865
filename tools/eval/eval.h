// Quality per bit (issue 6): every KV-cache format side by side on a real model and text.
//
// evaluate() runs the f32-cache reference once per micro-batch of each chunk and every spec in
// lockstep against it, so a chunk costs (1 + specs) forward passes; it scores the second half
// of each chunk like perplexity.h (scored_context_passes: the first half a fresh prompt, the
// scored half chunks that read the cache).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/cache/cache_spec.h"
#include "engine/model/model.h"
#include "engine/gguf/tokenizer.h"

namespace tqkv::eval {

using engine::CacheSpec;
using engine::Model;
using engine::Tokenizer;

struct EvalOptions {
  int ctx = 512;
  int max_tokens = 20480;  // text tokens used: floor(max_tokens / ctx) chunks
  int batch = 512;         // most tokens of a forward pass (scored_context_passes)
  int32_t bos = -1;        // replaces each chunk's first token when >= 0
  // Called after every forward pass: passes done of (1 + specs) * micro-batches * chunks.
  std::function<void(int64_t done, int64_t total)> on_pass;
};

struct EvalRow {
  std::string format, detail;
  int ctx = 0;
  int chunks = 0;
  int64_t tokens = 0;  // scored tokens
  double bits = 0, bits_all = 0, bytes_per_token = 0;
  double ppl = 0, nll = 0, kld = 0, kld_stderr = 0, top1 = 1;
  double seconds = 0;  // this spec's forward passes
};

// Row 0 is the f32 reference itself (KL 0); then one row per spec, in order. progress is
// called after every chunk with the rows so far.
std::vector<EvalRow> evaluate(const Model& model, const std::vector<int32_t>& tokens,
                              const std::vector<CacheSpec>& specs, const EvalOptions& opt,
                              const std::function<void(int chunk, int chunks, const std::vector<EvalRow>&)>& progress = {});

// Passkey retrieval: a random 5-digit key hidden at a relative depth of real text, the model
// asked for it through its chat template, greedy decoding.
struct PasskeyOptions {
  std::vector<int> ctx = {1024, 4096};
  std::vector<double> depths = {0.1, 0.5, 0.9};
  int trials = 4;
  uint64_t seed = 6;
  int max_new = 10;
};
struct PasskeyCell {
  std::string format;
  int ctx = 0;
  double depth = 0;
  int trials = 0, correct = 0;
  std::vector<std::string> answers;  // what the model said, per trial
};
std::vector<PasskeyCell> passkey(const Model& model, const Tokenizer& tok, const std::string& text,
                                 const std::vector<CacheSpec>& specs, const PasskeyOptions& opt,
                                 const std::function<void(const PasskeyCell&)>& on_cell = {});

}  // namespace tqkv::eval
