// A C ABI over the ExecuTorch runtime, so that a process without torch (Python through
// ctypes, or any app) can load a program and run its methods.
//
// Loading is et_loader.h's (shared with the device library). Inputs and outputs are
// memory-planned, so callers write inputs and read outputs in place through the data
// pointers oet_value hands out; those pointers stay valid until oet_method_free.
// Nothing here is thread-safe: one caller per method at a time.
#include <cstdint>
#include <cstring>
#include <string>

#include "et_loader.h"

using executorch::runtime::EValue;
using executorch::runtime::Error;
using orchard_et::LoadedProgram;
using orchard_et::PlannedMethod;

namespace {

void set_error(char* err, size_t len, const std::string& what) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, what.c_str(), len - 1);
    err[len - 1] = '\0';
  }
}

}  // namespace

extern "C" {

void* oet_program_load(const char* path, char* err, size_t errlen) {
  std::string error;
  auto p = orchard_et::load_program(path, &error);
  if (!p) set_error(err, errlen, error);
  return p.release();
}

void oet_program_free(void* h) { delete static_cast<LoadedProgram*>(h); }

size_t oet_num_methods(void* h) { return static_cast<LoadedProgram*>(h)->program->num_methods(); }

const char* oet_method_name(void* h, size_t i) {
  auto name = static_cast<LoadedProgram*>(h)->program->get_method_name(i);
  return name.ok() ? name.get() : nullptr;
}

void* oet_method_load(void* h, const char* name, char* err, size_t errlen) {
  std::string error;
  auto m = orchard_et::load_method(*static_cast<LoadedProgram*>(h)->program, name, &error);
  if (!m) set_error(err, errlen, error);
  return m.release();
}

void oet_method_free(void* h) { delete static_cast<PlannedMethod*>(h); }

uint64_t oet_planned_bytes(void* h) { return static_cast<PlannedMethod*>(h)->planned_bytes; }

size_t oet_num_inputs(void* h) { return static_cast<PlannedMethod*>(h)->method->inputs_size(); }

size_t oet_num_outputs(void* h) { return static_cast<PlannedMethod*>(h)->method->outputs_size(); }

// Input (which == 0) or output (which == 1) number i. Returns 0 for a tensor (dtype is
// its ScalarType code, sizes its first min(rank, 8) sizes, data its buffer), 1 for an
// int (in *ival), -1 for anything else.
// get_input/mutable_input are marked deprecated in favour of set_input, which copies
// into a tensor the caller owns; writing into the planned input in place is what this
// ABI offers instead, so the warning is silenced for this one function.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
int oet_value(void* h, int which, size_t i, int32_t* dtype, int32_t* ndim, int64_t* sizes, void** data,
              int64_t* ival) {
  auto* m = static_cast<PlannedMethod*>(h);
  const EValue& v = which == 0 ? m->method->mutable_input(i) : m->method->get_output(i);
  if (v.isInt()) {
    *ival = v.toInt();
    return 1;
  }
  if (!v.isTensor()) return -1;
  auto t = v.toTensor();
  *dtype = static_cast<int32_t>(t.scalar_type());
  *ndim = static_cast<int32_t>(t.dim());
  for (ssize_t d = 0; d < t.dim() && d < 8; ++d) sizes[d] = t.size(d);
  *data = t.mutable_data_ptr();
  return 0;
}
#pragma GCC diagnostic pop

int oet_execute(void* h) {
  auto* m = static_cast<PlannedMethod*>(h);
  Error e = m->method->execute();
  m->temp_allocator.reset();
  return static_cast<int>(e);
}

}  // extern "C"
