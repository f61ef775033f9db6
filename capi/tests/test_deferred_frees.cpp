// record_stream's frees: they wait for the extra streams' events, never block a stream, and
// fall back to a host wait when no event can be recorded.
#include "deferred_frees.hpp"

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <memory>
#include <stdexcept>
#include <tuple>
#include <vector>

using namespace cudamem::capi;

namespace {

/// Events the test completes by hand. Shared state, so the test can look inside.
struct fake_event_state {
  std::vector<bool> complete;       ///< by token
  std::vector<cudaStream_t> where;  ///< the stream each was recorded on
  std::vector<cudaStream_t> synchronized;
  std::size_t recycled = 0;
  std::size_t waits = 0;
  bool fail_record = false;
};

struct fake_events {
  using token = std::size_t;
  std::shared_ptr<fake_event_state> state;
  token record(cudaStream_t s) {
    if (state->fail_record) {
      throw std::runtime_error("no event");
    }
    state->complete.push_back(false);
    state->where.push_back(s);
    return state->complete.size() - 1;
  }
  bool done(token e) noexcept { return state->complete[e]; }
  void wait(token e) noexcept {
    ++state->waits;
    state->complete[e] = true;
  }
  void recycle(token) noexcept { ++state->recycled; }
  void synchronize(cudaStream_t s) noexcept { state->synchronized.push_back(s); }
};

cudaStream_t stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n); }
void* block(std::uintptr_t n) { return reinterpret_cast<void*>(n * 4096); }

using freed = std::vector<std::tuple<void*, std::size_t, cudaStream_t>>;

}  // namespace

TEST_CASE("deferred frees: a block used on another stream is freed once that stream is done") {
  auto state = std::make_shared<fake_event_state>();
  stream_uses uses;
  deferred_frees<fake_events> waiting{fake_events{state}};
  freed out;
  const auto free = [&](void* p, std::size_t n, cudaStream_t s) { out.emplace_back(p, n, s); };

  CHECK_FALSE(uses.any());
  uses.add(block(1), stream(2));
  uses.add(block(1), stream(2));  // twice: one event
  uses.add(block(1), stream(1));  // its own stream: no event needed
  CHECK(uses.any());

  CHECK(waiting.defer(block(1), 100, stream(1), uses.take(block(1))));
  CHECK_FALSE(uses.any());
  CHECK(waiting.waiting() == 1);
  REQUIRE(state->where.size() == 1);
  CHECK(state->where[0] == stream(2));

  waiting.retire_completed(free);  // stream 2 still busy
  CHECK(out.empty());
  CHECK(waiting.waiting() == 1);

  state->complete[0] = true;
  waiting.retire_completed(free);
  REQUIRE(out.size() == 1);
  CHECK(out[0] == std::make_tuple(block(1), std::size_t{100}, stream(1)));  // on its own stream
  CHECK(waiting.waiting() == 0);
  CHECK(state->recycled == 1);
}

TEST_CASE("deferred frees: blocks with no other stream are freed at once") {
  auto state = std::make_shared<fake_event_state>();
  stream_uses uses;
  deferred_frees<fake_events> waiting{fake_events{state}};
  CHECK(uses.take(block(5)).empty());
  CHECK_FALSE(waiting.defer(block(5), 10, stream(1), {}));
  uses.add(block(6), stream(1));
  CHECK_FALSE(waiting.defer(block(6), 10, stream(1), uses.take(block(6))));  // only its own
  CHECK(state->complete.empty());
  CHECK(waiting.waiting() == 0);
}

TEST_CASE("deferred frees: retire_all waits for every stream; order of completion is kept") {
  auto state = std::make_shared<fake_event_state>();
  deferred_frees<fake_events> waiting{fake_events{state}};
  freed out;
  const auto free = [&](void* p, std::size_t n, cudaStream_t s) { out.emplace_back(p, n, s); };
  CHECK(waiting.defer(block(1), 1, stream(1), {stream(2), stream(3)}));
  CHECK(waiting.defer(block(2), 2, stream(1), {stream(3)}));
  CHECK(waiting.waiting() == 2);
  state->complete[2] = true;  // block 2's event (the third recorded)
  waiting.retire_completed(free);
  REQUIRE(out.size() == 1);
  CHECK(std::get<0>(out[0]) == block(2));
  state->complete[0] = true;  // block 1: one of two streams done
  waiting.retire_completed(free);
  CHECK(out.size() == 1);
  waiting.retire_all(free);
  CHECK(out.size() == 2);
  CHECK(std::get<0>(out[1]) == block(1));
  CHECK(state->waits == 2);
  CHECK(waiting.waiting() == 0);
}

TEST_CASE("deferred frees: no event to be had -> the host waits and the free happens now") {
  auto state = std::make_shared<fake_event_state>();
  deferred_frees<fake_events> waiting{fake_events{state}};
  state->fail_record = true;
  const cudamem_test::captured_errors errors;
  CHECK_FALSE(waiting.defer(block(1), 1, stream(1), {stream(2), stream(3)}));
  CHECK(state->synchronized == std::vector<cudaStream_t>{stream(2), stream(3)});
  CHECK(waiting.waiting() == 0);
  REQUIRE(errors.messages().size() == 1);  // said, not silent
  CHECK_THAT(errors.messages()[0], Catch::Contains("could not record an event (no event)"));
}

TEST_CASE("deferred frees: simulated events are complete at once and touch no CUDA") {
  stream_uses uses;
  deferred_frees<cuda_events> waiting{0, true};
  freed out;
  uses.add(block(1), stream(9));
  CHECK(waiting.defer(block(1), 8, stream(1), uses.take(block(1))));
  waiting.retire_completed(
      [&](void* p, std::size_t n, cudaStream_t s) { out.emplace_back(p, n, s); });
  CHECK(out.size() == 1);
}
