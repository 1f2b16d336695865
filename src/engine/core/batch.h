// A varlen batch: the tokens of one forward step, from any number of sequences of different
// lengths, each sequence's tokens one contiguous run at consecutive positions (vLLM's flattened
// batch; llama.cpp's llama_batch). A decode step of B sequences is B runs of one token; a
// prefill chunk is one run of many; both can share a step.
//
// Everything here is host memory: a device copies what its kernels need.
#pragma once
#include <cstdint>
#include <vector>

namespace tqkv::engine {

struct Batch {
  std::vector<int32_t> tokens;     // [n] token ids
  std::vector<int64_t> positions;  // [n] absolute position of each token in its sequence
  std::vector<int64_t> seqs;       // [n] the cache's sequence id of each token
  std::vector<uint8_t> logits;     // [n] 1: return this token's logits (rows in batch order)

  int size() const { return static_cast<int>(tokens.size()); }
  int n_logits() const;

  // Appends n tokens of sequence `seq` at positions pos0 .. pos0 + n - 1; logits for all of
  // them (all_logits) or only the last.
  void add(int64_t seq, const int32_t* ids, int n, int64_t pos0, bool all_logits);

  // One run of the batch: tokens [begin, begin + count) of sequence seq from position pos0.
  struct Run {
    int64_t seq;
    int begin, count;
    int64_t pos0;
  };
  // The runs in batch order. Throws tqkv::Error(InvalidArgument) when the arrays differ in
  // length, a sequence's positions are not consecutive, or a sequence has two runs.
  std::vector<Run> runs() const;
};

}  // namespace tqkv::engine
