// Host tests that hand made-up stream handles (0x1000...) to code which may ask CUDA about
// the stream (thrust and CUB interop ask whether it is capturing into a graph). With a device
// visible, CUDA would read through the made-up handle. Including this header hides every
// device before the first CUDA call, so CUDA answers "no device" and the code under test
// takes its no-GPU path, the same on a machine with a GPU as on one without.
#pragma once

#include <cstdlib>

namespace cudamem_test {

/// True once CUDA_VISIBLE_DEVICES is empty (set while the test binary starts up).
inline const bool devices_hidden = ::setenv("CUDA_VISIBLE_DEVICES", "", 1) == 0;

}  // namespace cudamem_test
