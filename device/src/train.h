// Local training through the ExecuTorch program (edge_runtime/et_trainer.py): batches,
// their split into the program's micro-batches (each row weighs 1 / (T * rows), so the
// micro-batch gradients add up to the batch's mean token cross-entropy), FedProx's term
// and the SGD step on plain float arrays, in numpy's float32 arithmetic and order, the
// governor asked before every step, partial work reported as the Python trainer does.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "et_program.h"
#include "policy.h"

namespace orchard {

// orchard.seeds.derive_seed: BLAKE2b-64 (person "orchard-seed") of the parts, packed
// as little-endian u64, shifted to `bits` bits.
uint64_t derive_seed(const std::vector<uint64_t>& parts, int bits = 63);

// np.random.default_rng(seed).permutation(n).
std::vector<int64_t> numpy_permutation(uint64_t seed, int64_t n);

// A device's windows: x and y are (n, seq_len) int64, row-major.
struct DeviceData {
  std::vector<int64_t> x, y;
  size_t rows = 0, seq_len = 0;
};

// The device's text cut as the Python runtime cuts it (et_trainer.load_device_data):
// encoded with the bundle's character vocabulary, the first 1 - test_fraction of the
// ids into non-overlapping windows. Throws Failure(ORCHARD_ERR_ARGUMENT) for a
// character outside the vocabulary.
DeviceData text_windows(const std::string& text, const std::vector<std::string>& vocab, size_t seq_len,
                        double test_fraction = 0.2);

struct TrainConfig {
  int64_t epochs = 1;
  std::optional<int64_t> steps;
  int64_t batch_size = 32;
  double learning_rate = 0.05;
  std::string optimizer = "sgd";
  double momentum = 0, weight_decay = 0, proximal_mu = 0;
  uint64_t seed = 0;
  static TrainConfig from_json(const nlohmann::json& run_config);  // RunConfig.train
};

struct TrainResult {
  std::map<std::string, std::vector<float>> arrays;  // by the program's parameter names
  double weight = 0;
  int64_t num_examples = 0, num_steps = 0;
  double train_loss = 0, train_accuracy = 0;  // NaN when no step ran
  bool stopped = false;
  double planned_weight = 0;
};

// Train from `global` (by parameter name; the tensors the program trains) on `data`.
// `trainer_seed` is the trainer's own seed (et_trainer's `seed`). `gate`, if given,
// is asked before every step (after_step gets the batch's rows).
TrainResult train(TrainingProgram& program, const DeviceData& data,
                  const std::map<std::string, std::vector<float>>& global, const TrainConfig& config,
                  uint64_t trainer_seed, StepGate* gate);

}  // namespace orchard
