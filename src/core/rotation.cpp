#include "tqkv/rotation.h"

#include <cmath>
#include <string>

#include "tqkv/error.h"

namespace tqkv {

std::string_view rotation_name(RotationKind kind) {
  switch (kind) {
    case RotationKind::Srht: return "srht";
    case RotationKind::Hadamard: return "hadamard";
    case RotationKind::Dense: return "dense";
  }
  return "?";
}

RotationKind parse_rotation(std::string_view name) {
  if (name == "srht") return RotationKind::Srht;
  if (name == "hadamard") return RotationKind::Hadamard;
  if (name == "dense") return RotationKind::Dense;
  throw Error(ErrorCode::InvalidArgument, "unknown rotation '" + std::string(name) + "' (valid: srht, hadamard, dense)");
}

void fwht(float* x, int d) {
  for (int len = 1; len < d; len <<= 1) {
    for (int i = 0; i < d; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float u = x[j];
        const float v = x[j + len];
        x[j] = u + v;
        x[j + len] = u - v;
      }
    }
  }
}

Rotation::Rotation(RotationKind kind, int dim, uint64_t seed) : kind_(kind), dim_(dim), seed_(seed) {
  if (dim < 1) throw Error(ErrorCode::InvalidArgument, "rotation dim must be positive, got " + std::to_string(dim));
  if (kind != RotationKind::Dense && !is_power_of_two(dim))
    throw Error(ErrorCode::InvalidArgument, "rotation '" + std::string(rotation_name(kind)) +
                                "' needs a power-of-two dim, got " + std::to_string(dim));
  SplitMix64 rng(seed);
  if (kind == RotationKind::Srht) {
    signs_.resize(dim);
    for (auto& s : signs_) s = (rng.next() >> 63) ? -1.0f : 1.0f;
  } else if (kind == RotationKind::Dense) {
    // Gaussian matrix, orthonormalised row by row with two passes of modified Gram-Schmidt
    // (the second pass restores orthogonality lost to rounding).
    std::vector<double> m(static_cast<size_t>(dim) * dim);
    for (size_t i = 0; i < m.size(); i += 2) {
      const double u1 = 1.0 - rng.uniform(), u2 = rng.uniform();
      const double r = std::sqrt(-2.0 * std::log(u1));
      m[i] = r * std::cos(2 * M_PI * u2);
      if (i + 1 < m.size()) m[i + 1] = r * std::sin(2 * M_PI * u2);
    }
    for (int i = 0; i < dim; ++i) {
      double* row = &m[static_cast<size_t>(i) * dim];
      for (int pass = 0; pass < 2; ++pass) {
        for (int j = 0; j < i; ++j) {
          const double* prev = &m[static_cast<size_t>(j) * dim];
          double dot = 0;
          for (int k = 0; k < dim; ++k) dot += row[k] * prev[k];
          for (int k = 0; k < dim; ++k) row[k] -= dot * prev[k];
        }
      }
      double norm = 0;
      for (int k = 0; k < dim; ++k) norm += row[k] * row[k];
      norm = std::sqrt(norm);
      for (int k = 0; k < dim; ++k) row[k] /= norm;
    }
    matrix_.assign(m.begin(), m.end());
  }
}

void Rotation::apply(float* x) const {
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim_));
  switch (kind_) {
    case RotationKind::Srht:
      for (int i = 0; i < dim_; ++i) x[i] *= signs_[i];
      [[fallthrough]];
    case RotationKind::Hadamard:
      fwht(x, dim_);
      for (int i = 0; i < dim_; ++i) x[i] *= scale;
      return;
    case RotationKind::Dense: {
      std::vector<float> y(dim_);
      for (int i = 0; i < dim_; ++i) {
        const float* row = &matrix_[static_cast<size_t>(i) * dim_];
        double acc = 0;
        for (int k = 0; k < dim_; ++k) acc += static_cast<double>(row[k]) * x[k];
        y[i] = static_cast<float>(acc);
      }
      std::copy(y.begin(), y.end(), x);
      return;
    }
  }
}

void Rotation::inverse(float* x) const {
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim_));
  switch (kind_) {
    case RotationKind::Srht:
    case RotationKind::Hadamard:
      fwht(x, dim_);
      for (int i = 0; i < dim_; ++i) x[i] *= scale;
      if (kind_ == RotationKind::Srht)
        for (int i = 0; i < dim_; ++i) x[i] *= signs_[i];
      return;
    case RotationKind::Dense: {
      std::vector<double> y(dim_, 0.0);
      for (int k = 0; k < dim_; ++k) {
        const float* row = &matrix_[static_cast<size_t>(k) * dim_];
        for (int i = 0; i < dim_; ++i) y[i] += static_cast<double>(row[i]) * x[k];
      }
      for (int i = 0; i < dim_; ++i) x[i] = static_cast<float>(y[i]);
      return;
    }
  }
}

Rotation make_rotation(RotationKind preferred, int dim, uint64_t seed) {
  if (preferred != RotationKind::Dense && !is_power_of_two(dim)) preferred = RotationKind::Dense;
  return Rotation(preferred, dim, seed);
}

}  // namespace tqkv
