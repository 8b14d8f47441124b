// Loading an ExecuTorch program and one of its methods, written once for the two native
// users of the runtime: the C ABI here (orchard_et.cpp, built by edge_runtime/et_native.py)
// and the device library's training program (device/src/et_program.cpp, built by
// device/CMakeLists.txt, which puts this directory on its include path).
//
// Header-only, so each build compiles it into its own code with its own flags. Failures
// come back as a null pointer and a message; each caller reports it its own way (an
// error buffer across the C ABI, a Failure naming the file in the device library).
//
// Memory: every method gets its own planned buffers (sizes from the program's memory
// plan) and malloc-backed method and temp allocators, so its inputs and outputs can be
// written and read in place. Nothing here is thread-safe: one caller per method at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

namespace orchard_et {

// A program and the loader that owns its bytes (the program reads through it).
struct LoadedProgram {
  std::unique_ptr<executorch::extension::FileDataLoader> loader;
  std::unique_ptr<executorch::runtime::Program> program;
};

// A loaded method with its own planned buffers and allocators.
struct PlannedMethod {
  std::vector<std::vector<uint8_t>> planned;
  std::vector<executorch::runtime::Span<uint8_t>> spans;
  std::unique_ptr<executorch::runtime::HierarchicalAllocator> planned_allocator;
  executorch::extension::MallocMemoryAllocator method_allocator;
  executorch::extension::MallocMemoryAllocator temp_allocator;
  std::unique_ptr<executorch::runtime::MemoryManager> memory;
  std::unique_ptr<executorch::runtime::Method> method;
  uint64_t planned_bytes = 0;
};

// The program in the file at `path`, checked for internal consistency; null with *error
// set when the file cannot be read or is not a program.
inline std::unique_ptr<LoadedProgram> load_program(const char* path, std::string* error) {
  using executorch::extension::FileDataLoader;
  using executorch::runtime::Program;
  executorch::runtime::runtime_init();
  auto loader = FileDataLoader::from(path);
  if (!loader.ok()) {
    *error = "cannot read the file";
    return nullptr;
  }
  auto p = std::make_unique<LoadedProgram>();
  p->loader = std::make_unique<FileDataLoader>(std::move(loader.get()));
  auto program = Program::load(p->loader.get(), Program::Verification::InternalConsistency);
  if (!program.ok()) {
    *error = "not a valid ExecuTorch program (error " + std::to_string(static_cast<int>(program.error())) + ")";
    return nullptr;
  }
  p->program = std::make_unique<Program>(std::move(program.get()));
  return p;
}

// Method `name` of `program` with its planned buffers allocated; null with *error set
// when the program has no such method or cannot load it.
inline std::unique_ptr<PlannedMethod> load_method(executorch::runtime::Program& program, const char* name,
                                                  std::string* error) {
  using executorch::runtime::Span;
  auto meta = program.method_meta(name);
  if (!meta.ok()) {
    *error = std::string("the program has no method '") + name + "'";
    return nullptr;
  }
  auto m = std::make_unique<PlannedMethod>();
  for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
    auto size = meta->memory_planned_buffer_size(i);
    if (!size.ok()) {
      *error = "unreadable memory plan";
      return nullptr;
    }
    m->planned.emplace_back(static_cast<size_t>(size.get()));
    m->planned_bytes += static_cast<uint64_t>(size.get());
  }
  for (auto& buffer : m->planned) m->spans.emplace_back(buffer.data(), buffer.size());
  m->planned_allocator = std::make_unique<executorch::runtime::HierarchicalAllocator>(
      Span<Span<uint8_t>>(m->spans.data(), m->spans.size()));
  m->memory = std::make_unique<executorch::runtime::MemoryManager>(&m->method_allocator, m->planned_allocator.get(),
                                                                   &m->temp_allocator);
  auto method = program.load_method(name, m->memory.get());
  if (!method.ok()) {
    *error = std::string("cannot load method '") + name + "' (ExecuTorch error " +
             std::to_string(static_cast<int>(method.error())) + "; 20 = an operator this runtime does not link)";
    return nullptr;
  }
  m->method = std::make_unique<executorch::runtime::Method>(std::move(method.get()));
  return m;
}

}  // namespace orchard_et
