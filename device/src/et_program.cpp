#include "et_program.h"

#include <cstring>

// Shared with the edge runtime's C ABI (edge_runtime/native/, on this target's include path).
#include "et_loader.h"
#include "failure.h"

using executorch::runtime::EValue;
using executorch::runtime::Error;
using executorch::runtime::Method;
using executorch::runtime::Program;
using orchard_et::PlannedMethod;

namespace orchard {

namespace {

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw Failure(ORCHARD_ERR_PROGRAM, path + ": " + what);
}

std::unique_ptr<PlannedMethod> load_method(Program& program, const std::string& path, const char* name) {
  std::string error;
  auto m = orchard_et::load_method(program, name, &error);
  if (!m) refuse(path, error);
  return m;
}

int64_t index_of(Program& program, const std::string& path, const char* name) {
  auto m = load_method(program, path, name);
  Error e = m->method->execute();
  if (e != Error::Ok) refuse(path, std::string("method ") + name + " failed to run");
  if (m->method->outputs_size() != 1) refuse(path, std::string("method ") + name + " returns no single index");
  const EValue& v = m->method->get_output(0);
  if (v.isInt()) return v.toInt();
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().const_data_ptr<int64_t>()[0];
  refuse(path, std::string("method ") + name + " returns no index");
}

}  // namespace

struct TrainingProgram::Impl {
  std::unique_ptr<orchard_et::LoadedProgram> loaded;
  std::unique_ptr<PlannedMethod> forward;
  std::vector<float*> params;
  std::vector<const float*> grads;
  std::vector<size_t> sizes;
  int64_t* idx = nullptr;
  int64_t* targets = nullptr;
  float* weight = nullptr;
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TrainingProgram::TrainingProgram(const Manifest& manifest) : impl_(new Impl), manifest_(manifest) {
  const std::string& path = manifest_.program_path;
  std::string error;
  impl_->loaded = orchard_et::load_program(path.c_str(), &error);
  if (!impl_->loaded) refuse(path, error);
  Program& program = *impl_->loaded->program;
  const std::string g_name = "__et_training_gradients_index_" + manifest_.method;
  const std::string p_name = "__et_training_parameters_index_" + manifest_.method;
  const int64_t g0 = index_of(program, path, g_name.c_str());
  const int64_t p0 = index_of(program, path, p_name.c_str());
  if (g0 != manifest_.gradients_start || p0 != manifest_.parameters_start)
    refuse(path, "puts gradients at output " + std::to_string(g0) + " and parameters at " + std::to_string(p0) +
                     "; train_program.json says " + std::to_string(manifest_.gradients_start) + " and " +
                     std::to_string(manifest_.parameters_start) + ": the manifest is not this program's");
  impl_->forward = load_method(program, path, manifest_.method.c_str());
  Method& m = *impl_->forward->method;
  if (m.inputs_size() != 3) refuse(path, "takes " + std::to_string(m.inputs_size()) + " inputs, expected 3");
  const size_t mb = static_cast<size_t>(manifest_.micro_batch), t = static_cast<size_t>(manifest_.seq_len);
  auto input = [&](size_t i, executorch::aten::ScalarType type, size_t numel) -> void* {
    const EValue& v = m.mutable_input(i);
    if (!v.isTensor() || v.toTensor().scalar_type() != type || static_cast<size_t>(v.toTensor().numel()) != numel)
      refuse(path, "input " + std::to_string(i) + " is not the manifest's (" + std::to_string(mb) + " x " +
                       std::to_string(t) + " micro-batch)");
    return v.toTensor().mutable_data_ptr();
  };
  impl_->idx = static_cast<int64_t*>(input(0, executorch::aten::ScalarType::Long, mb * t));
  impl_->targets = static_cast<int64_t*>(input(1, executorch::aten::ScalarType::Long, mb * t));
  impl_->weight = static_cast<float*>(input(2, executorch::aten::ScalarType::Float, mb));
  const size_t np = manifest_.parameters.size();
  if (m.outputs_size() != static_cast<size_t>(manifest_.parameters_start) + np)
    refuse(path, "returns " + std::to_string(m.outputs_size()) + " outputs, train_program.json declares " +
                     std::to_string(np) + " trained tensors");
  for (size_t j = 0; j < np; ++j) {
    size_t numel = 1;
    for (uint64_t d : manifest_.parameters[j].shape) numel *= static_cast<size_t>(d);
    for (int which = 0; which < 2; ++which) {
      const size_t k = static_cast<size_t>(which == 0 ? manifest_.gradients_start : manifest_.parameters_start) + j;
      const EValue& v = m.get_output(k);
      if (!v.isTensor() || v.toTensor().scalar_type() != executorch::aten::ScalarType::Float ||
          static_cast<size_t>(v.toTensor().numel()) != numel)
        refuse(path, std::string("returns a ") + (which == 0 ? "gradient" : "parameter") + " for '" +
                         manifest_.parameters[j].name + "' that is not float32 of the manifest's shape");
      if (which == 0) impl_->grads.push_back(v.toTensor().const_data_ptr<float>());
      else impl_->params.push_back(v.toTensor().mutable_data_ptr<float>());
    }
    impl_->sizes.push_back(numel);
  }
}
#pragma GCC diagnostic pop

TrainingProgram::~TrainingProgram() = default;

uint64_t TrainingProgram::planned_bytes() const { return impl_->forward->planned_bytes; }
float* TrainingProgram::parameter(size_t j) { return impl_->params.at(j); }
size_t TrainingProgram::parameter_size(size_t j) const { return impl_->sizes.at(j); }
const float* TrainingProgram::gradient(size_t j) const { return impl_->grads.at(j); }

std::pair<double, int64_t> TrainingProgram::step(const int64_t* idx, const int64_t* targets, const float* w, size_t n) {
  const size_t mb = static_cast<size_t>(manifest_.micro_batch), t = static_cast<size_t>(manifest_.seq_len);
  if (n < 1 || n > mb) throw Failure(ORCHARD_ERR_INTERNAL, "a micro-batch holds 1 to " + std::to_string(mb) + " rows");
  std::memcpy(impl_->idx, idx, n * t * sizeof(int64_t));
  std::memcpy(impl_->targets, targets, n * t * sizeof(int64_t));
  std::memcpy(impl_->weight, w, n * sizeof(float));
  if (n < mb) {
    std::memset(impl_->idx + n * t, 0, (mb - n) * t * sizeof(int64_t));
    std::memset(impl_->targets + n * t, 0, (mb - n) * t * sizeof(int64_t));
    std::memset(impl_->weight + n, 0, (mb - n) * sizeof(float));
  }
  Method& m = *impl_->forward->method;
  Error e = m.execute();
  impl_->forward->temp_allocator.reset();
  if (e != Error::Ok)
    throw Failure(ORCHARD_ERR_PROGRAM, manifest_.program_path + ": the training program failed to run (ExecuTorch error " +
                                           std::to_string(static_cast<int>(e)) + ")");
  const EValue& loss = m.get_output(static_cast<size_t>(manifest_.loss_output));
  const EValue& correct = m.get_output(static_cast<size_t>(manifest_.correct_output));
  const double l = loss.isTensor() ? static_cast<double>(loss.toTensor().const_data_ptr<float>()[0]) : loss.toDouble();
  const int64_t c = correct.isInt() ? correct.toInt() : correct.toTensor().const_data_ptr<int64_t>()[0];
  return {l, c};
}

}  // namespace orchard
