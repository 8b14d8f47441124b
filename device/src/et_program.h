// A bundle's ExecuTorch training program, loaded by the ExecuTorch runtime (the
// libraries the executorch wheel ships, as edge_runtime/native/orchard_et.cpp uses
// them) and checked against its manifest: the gradient and parameter indices the
// export recorded, the inputs' shapes, and every trained tensor's shape.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bundle.h"

namespace orchard {

class TrainingProgram {
 public:
  // Throws Failure(ORCHARD_ERR_PROGRAM) naming the file for anything that does not load
  // or does not match the manifest.
  explicit TrainingProgram(const Manifest& manifest);
  ~TrainingProgram();

  const Manifest& manifest() const { return manifest_; }
  int micro_batch() const { return manifest_.micro_batch; }
  int seq_len() const { return manifest_.seq_len; }
  uint64_t planned_bytes() const;

  // The trained tensor j: the program's own storage (write it to set the adapter).
  float* parameter(size_t j);
  size_t parameter_size(size_t j) const;

  // One micro-batch of n rows (1 <= n <= micro_batch; the rest padded with weight 0):
  // runs the method, returns (loss, correct); gradients are then gradient(j), valid
  // until the next step.
  std::pair<double, int64_t> step(const int64_t* idx, const int64_t* targets, const float* row_weight, size_t n);
  const float* gradient(size_t j) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  Manifest manifest_;
};

}  // namespace orchard
