#include "engine/core/batch.h"

#include <string>
#include <unordered_set>

#include "tqkv/error.h"

namespace tqkv::engine {

int Batch::n_logits() const {
  int n = 0;
  for (uint8_t l : logits) n += l != 0;
  return n;
}

void Batch::add(int64_t seq, const int32_t* ids, int n, int64_t pos0, bool all_logits) {
  for (int i = 0; i < n; ++i) {
    tokens.push_back(ids[i]);
    positions.push_back(pos0 + i);
    seqs.push_back(seq);
    logits.push_back(all_logits || i + 1 == n ? 1 : 0);
  }
}

std::vector<Batch::Run> Batch::runs() const {
  const size_t n = tokens.size();
  if (positions.size() != n || seqs.size() != n || logits.size() != n)
    throw Error(ErrorCode::InvalidArgument, "batch: tokens, positions, seqs and logits differ in length");
  std::vector<Run> out;
  std::unordered_set<int64_t> seen;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && seqs[i] == seqs[i - 1]) {
      if (positions[i] != positions[i - 1] + 1)
        throw Error(ErrorCode::InvalidArgument, "batch: positions of sequence " + std::to_string(seqs[i]) +
                                                    " are not consecutive at token " + std::to_string(i));
      ++out.back().count;
      continue;
    }
    if (!seen.insert(seqs[i]).second)
      throw Error(ErrorCode::InvalidArgument,
                  "batch: sequence " + std::to_string(seqs[i]) + " has two separate runs of tokens");
    if (positions[i] < 0) throw Error(ErrorCode::OutOfRange, "batch: negative position");
    out.push_back({seqs[i], static_cast<int>(i), 1, positions[i]});
  }
  return out;
}

}  // namespace tqkv::engine
