// A C ABI over the ExecuTorch runtime, so that a process without torch (Python through
// ctypes, or any app) can load a program and run its methods.
//
// Memory: every method gets its own planned buffers (sizes from the program's memory
// plan) and malloc-backed method and temp allocators. Inputs and outputs are
// memory-planned, so callers write inputs and read outputs in place through the data
// pointers oet_value hands out; those pointers stay valid until oet_method_free.
// Nothing here is thread-safe: one caller per method at a time.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

using executorch::extension::FileDataLoader;
using executorch::extension::MallocMemoryAllocator;
using executorch::runtime::EValue;
using executorch::runtime::Error;
using executorch::runtime::HierarchicalAllocator;
using executorch::runtime::MemoryManager;
using executorch::runtime::Method;
using executorch::runtime::Program;
using executorch::runtime::Span;

namespace {

struct OetProgram {
  std::unique_ptr<FileDataLoader> loader;
  std::unique_ptr<Program> program;
};

struct OetMethod {
  std::vector<std::vector<uint8_t>> planned;
  std::vector<Span<uint8_t>> spans;
  std::unique_ptr<HierarchicalAllocator> planned_allocator;
  MallocMemoryAllocator method_allocator;
  MallocMemoryAllocator temp_allocator;
  std::unique_ptr<MemoryManager> memory;
  std::unique_ptr<Method> method;
  uint64_t planned_bytes = 0;
};

void set_error(char* err, size_t len, const std::string& what) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, what.c_str(), len - 1);
    err[len - 1] = '\0';
  }
}

}  // namespace

extern "C" {

void* oet_program_load(const char* path, char* err, size_t errlen) {
  executorch::runtime::runtime_init();
  auto loader = FileDataLoader::from(path);
  if (!loader.ok()) {
    set_error(err, errlen, "cannot read the file");
    return nullptr;
  }
  auto p = std::make_unique<OetProgram>();
  p->loader = std::make_unique<FileDataLoader>(std::move(loader.get()));
  auto program = Program::load(p->loader.get(), Program::Verification::InternalConsistency);
  if (!program.ok()) {
    set_error(err, errlen,
              "not a valid ExecuTorch program (error " + std::to_string(static_cast<int>(program.error())) + ")");
    return nullptr;
  }
  p->program = std::make_unique<Program>(std::move(program.get()));
  return p.release();
}

void oet_program_free(void* h) { delete static_cast<OetProgram*>(h); }

size_t oet_num_methods(void* h) { return static_cast<OetProgram*>(h)->program->num_methods(); }

const char* oet_method_name(void* h, size_t i) {
  auto name = static_cast<OetProgram*>(h)->program->get_method_name(i);
  return name.ok() ? name.get() : nullptr;
}

void* oet_method_load(void* h, const char* name, char* err, size_t errlen) {
  auto* p = static_cast<OetProgram*>(h);
  auto meta = p->program->method_meta(name);
  if (!meta.ok()) {
    set_error(err, errlen, std::string("the program has no method '") + name + "'");
    return nullptr;
  }
  auto m = std::make_unique<OetMethod>();
  for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
    auto size = meta->memory_planned_buffer_size(i);
    if (!size.ok()) {
      set_error(err, errlen, "unreadable memory plan");
      return nullptr;
    }
    m->planned.emplace_back(static_cast<size_t>(size.get()));
    m->planned_bytes += static_cast<uint64_t>(size.get());
  }
  for (auto& buffer : m->planned) m->spans.emplace_back(buffer.data(), buffer.size());
  m->planned_allocator =
      std::make_unique<HierarchicalAllocator>(Span<Span<uint8_t>>(m->spans.data(), m->spans.size()));
  m->memory = std::make_unique<MemoryManager>(&m->method_allocator, m->planned_allocator.get(),
                                              &m->temp_allocator);
  auto method = p->program->load_method(name, m->memory.get());
  if (!method.ok()) {
    set_error(err, errlen,
              std::string("cannot load method '") + name + "' (error " +
                  std::to_string(static_cast<int>(method.error())) +
                  "; 20 = an operator this runtime does not link)");
    return nullptr;
  }
  m->method = std::make_unique<Method>(std::move(method.get()));
  return m.release();
}

void oet_method_free(void* h) { delete static_cast<OetMethod*>(h); }

uint64_t oet_planned_bytes(void* h) { return static_cast<OetMethod*>(h)->planned_bytes; }

size_t oet_num_inputs(void* h) { return static_cast<OetMethod*>(h)->method->inputs_size(); }

size_t oet_num_outputs(void* h) { return static_cast<OetMethod*>(h)->method->outputs_size(); }

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
  auto* m = static_cast<OetMethod*>(h);
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
  auto* m = static_cast<OetMethod*>(h);
  Error e = m->method->execute();
  m->temp_allocator.reset();
  return static_cast<int>(e);
}

}  // extern "C"
