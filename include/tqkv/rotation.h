// Orthogonal rotations applied to keys (and rotated values) before scalar quantization.
//
//   Srht      R x = H (D x) / sqrt(d): random +-1 signs D, then the Sylvester Walsh-Hadamard H.
//   Hadamard  R x = H x / sqrt(d) (no signs; vLLM's choice, symmetric and self-inverse).
//   Dense     a seeded random orthogonal matrix (Gaussian entries, Gram-Schmidt), for any d.
// Srht and Hadamard need d to be a power of two; make_rotation() falls back to Dense otherwise.
//
// The signs come from SplitMix64 seeded with `seed`: sign[i] = -1 if bit 63 of the i-th
// output is set, else +1. The dense matrix takes pairs of SplitMix64 outputs through
// Box-Muller; it is identical across runs of one build, but use the power-of-two dims for
// bit-exact agreement with other backends (CUDA implements only Srht and Hadamard).
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace tqkv {

enum class RotationKind : uint8_t { Srht, Hadamard, Dense };

std::string_view rotation_name(RotationKind kind);
RotationKind parse_rotation(std::string_view name);  // "srht" | "hadamard" | "dense"

inline constexpr uint64_t kDefaultSeed = 0x7471'6b76'2026'0001ull;  // "tqkv"

constexpr bool is_power_of_two(int d) { return d > 0 && (d & (d - 1)) == 0; }

// SplitMix64: the documented generator behind every seeded choice in tqkv.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0,1)
};

// In-place unnormalised fast Walsh-Hadamard transform; d must be a power of two.
void fwht(float* x, int d);

class Rotation {
 public:
  Rotation(RotationKind kind, int dim, uint64_t seed = kDefaultSeed);

  RotationKind kind() const { return kind_; }
  int dim() const { return dim_; }
  uint64_t seed() const { return seed_; }
  // x <- R x  /  x <- R^T x   (x: [dim] floats, in place)
  void apply(float* x) const;
  void inverse(float* x) const;
  // Srht: the +-1 signs [dim]; empty otherwise.
  const std::vector<float>& signs() const { return signs_; }
  // Dense: the row-major matrix R [dim * dim]; empty otherwise.
  const std::vector<float>& matrix() const { return matrix_; }

 private:
  RotationKind kind_;
  int dim_;
  uint64_t seed_;
  std::vector<float> signs_;
  std::vector<float> matrix_;
};

// Srht/Hadamard for power-of-two dims, Dense otherwise.
Rotation make_rotation(RotationKind preferred, int dim, uint64_t seed = kDefaultSeed);

}  // namespace tqkv
