// The one piece of cudamem's Python package compiled against PyTorch's headers (by
// cudamem.torch at install(), once per PyTorch version, in a second): it throws PyTorch's own
// out-of-memory exception, which PyTorch raises as torch.OutOfMemoryError, with cudamem's
// report as its message. libcudamem_c calls it (cudamem_set_torch_oom_thrower) when an
// allocation fails, so the exception leaves from inside the allocation that failed.
#include <c10/util/Exception.h>

#include <string>

extern "C" __attribute__((visibility("default"))) void cudamem_torch_throw_oom(
    const char* report) {
  throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                              std::string(report));
}
