// The control for owners.cpp: a file that includes memory_report.hpp compiles the whole report.
#include <cudamem/memory_report.hpp>

std::string explain(const cudamem::memory_resource& mr) {
  return cudamem::make_memory_report(mr, 1 << 20).to_text();
}
