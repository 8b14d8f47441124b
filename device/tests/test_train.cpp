// Training through the ExecuTorch program against the Python device trainer
// (edge_runtime/et_trainer.py) on the same bundle, data, model and config
// (device_vectors.py training_vectors: train.json): the same trained tensors, steps,
// weight and metrics. Also derive_seed and numpy's permutation, which pick the batches.
#include <cmath>
#include <cstring>

#include "bundle.h"
#include "check.h"
#include "et_program.h"
#include "failure.h"
#include "train.h"
#include "vectors.h"

using namespace orchard;

TEST(seeds_and_permutations) {
  auto v = vectors::load("train.json");
  for (auto& c : v["derive_seed"])
    CHECK_MSG(derive_seed(c["parts"].get<std::vector<uint64_t>>(), c["bits"]) == c["seed"].get<uint64_t>(), c.dump());
  for (auto& c : v["permutations"])
    CHECK_MSG(numpy_permutation(c["seed"], c["n"]) == c["perm"].get<std::vector<int64_t>>(), c["seed"].dump());
}

TEST(training_equals_the_python_trainer) {
  auto v = vectors::load("train.json");
  CHECK(!v["runs"].empty());
  for (auto& c : v["runs"]) {
    Bundle b = read_bundle(c["bundle"]);
    TrainingProgram program(b.manifest);
    DeviceData data;
    data.rows = c["rows"];
    data.seq_len = c["seq_len"];
    data.x = c["x"].get<std::vector<int64_t>>();
    data.y = c["y"].get<std::vector<int64_t>>();
    std::map<std::string, std::vector<float>> global;
    for (auto& [name, hex] : c["global"].items()) global[name] = vectors::floats(hex);
    TrainConfig cfg = TrainConfig::from_json(c["run_config"]);
    TrainResult r = train(program, data, global, cfg, c["trainer_seed"], nullptr);
    auto& w = c["result"];
    const std::string where = c["case"];
    CHECK_MSG(r.num_steps == w["num_steps"].get<int64_t>() && r.num_examples == w["num_examples"].get<int64_t>() &&
                  r.weight == w["weight"].get<double>(),
              where);
    CHECK_MSG(std::fabs(r.train_loss - w["train_loss"].get<double>()) <= 1e-6 * std::fabs(w["train_loss"].get<double>()),
              where + ": loss " + std::to_string(r.train_loss) + " vs " + w["train_loss"].dump());
    CHECK_MSG(r.train_accuracy == w["train_accuracy"].get<double>(), where);
    for (auto& [name, hex] : w["arrays"].items()) {
      const std::vector<float> want = vectors::floats(hex);
      const std::vector<float>& got = r.arrays[name];
      CHECK_MSG(got.size() == want.size(), where + " " + name);
      double worst = 0, scale = 0;
      for (size_t k = 0; k < got.size() && k < want.size(); ++k) {
        worst = std::max(worst, static_cast<double>(std::fabs(got[k] - want[k])));
        scale = std::max(scale, static_cast<double>(std::fabs(want[k])));
      }
      // The same runtime and kernels run the program; the step around it is the same
      // float32 arithmetic. Equal up to the kernels' own thread scheduling.
      CHECK_MSG(worst <= 1e-6 * std::max(scale, 1.0), where + " " + name + ": max |diff| " + std::to_string(worst));
    }
  }
}

TEST(a_program_that_does_not_load_is_refused) {
  auto v = vectors::load("train.json");
  Bundle b = read_bundle(v["runs"][0]["bundle"]);
  Manifest m = b.manifest;
  m.program_path = b.dir + "/client.json";  // not an ExecuTorch program
  try {
    TrainingProgram p(m);
    CHECK(false);
  } catch (const Failure& f) {
    CHECK(f.code() == ORCHARD_ERR_PROGRAM);
    CHECK(std::string(f.what()).find("client.json") != std::string::npos);
  }
  m = b.manifest;
  m.parameters_start += 1;
  try {
    TrainingProgram p(m);
    CHECK(false);
  } catch (const Failure& f) {
    CHECK(f.code() == ORCHARD_ERR_PROGRAM);
  }
}

CHECK_MAIN()
