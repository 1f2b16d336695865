// Lloyd-Max scalar quantizers for one coordinate of a randomly rotated unit vector.
//
// After a random rotation, each coordinate of a unit vector in R^d follows
//   Law::Sphere  the exact marginal, density proportional to (1 - t^2)^((d-3)/2) on [-1, 1]
//   Law::Gauss   its Gaussian approximation N(0, 1/d) (what vLLM uses)
// A codebook holds 2^bits reconstruction levels (ascending, symmetric about 0) and the
// 2^bits - 1 decision thresholds (midpoints of adjacent levels). Codebooks are solved
// numerically (Lloyd's algorithm with closed-form interval moments) to ~1e-12 and cached.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace tqkv {

enum class Law : uint8_t { Sphere, Gauss };

std::string_view law_name(Law law);
Law parse_law(std::string_view name);  // "sphere" | "gauss"; throws tqkv::Error(InvalidArgument)

struct Codebook {
  Law law;
  int dim;   // vector dimension d (sets the coordinate variance, 1/d)
  int bits;  // 1..8
  std::vector<double> levels;      // [2^bits], ascending
  std::vector<double> thresholds;  // [2^bits - 1], thresholds[i] = (levels[i] + levels[i+1]) / 2
  std::vector<float> levels_f32;   // the same values rounded to float, as kernels use them
  std::vector<float> thresholds_f32;
  // Expected squared error E||u - u_hat||^2 for a random unit vector u under this law when
  // every coordinate is quantized with this codebook (= d * per-coordinate MSE).
  double mse;
  int iterations;  // Lloyd iterations the solver ran

  int size() const { return static_cast<int>(levels.size()); }
  // Code of x: the number of thresholds t with x >= t (ties go up). NaN maps to 0.
  uint8_t quantize(float x) const;
};

// Solves a codebook from scratch (no cache). dim >= 2, 1 <= bits <= 8; throws tqkv::Error(InvalidArgument).
Codebook solve_codebook(Law law, int dim, int bits);

// Cached, thread-safe access: solved once per (law, dim, bits) per process.
const Codebook& get_codebook(Law law, int dim, int bits);

}  // namespace tqkv
