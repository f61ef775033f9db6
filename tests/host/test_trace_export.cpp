// trace_export: a Chrome trace from a logged run parses as JSON and holds the counter and
// out-of-memory events, with the right values.
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/trace_export.hpp>

#include "mini_json.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using namespace cudamem;
using cudamem_test::json_value;
using cudamem_test::parse_json;

namespace {

std::vector<const json_value*> events_with(const json_value& trace, const std::string& ph) {
  std::vector<const json_value*> found;
  for (const json_value& e : trace["traceEvents"].items) {
    if (e["ph"].text == ph) {
      found.push_back(&e);
    }
  }
  return found;
}

}  // namespace

TEST_CASE("a logged run becomes a trace with counters and an out-of-memory marker") {
  host_resource host;
  limiting_adaptor capped{host, 4096};
  std::ostringstream log;
  {
    logging_adaptor logged{capped, log, logging_options{.sample_reserved = true}};
    void* a = logged.allocate(1000);
    void* b = logged.allocate(2000);
    CHECK_THROWS_AS(logged.allocate(5000), out_of_memory);
    logged.deallocate(a, 1000);
    logged.deallocate(b, 2000);
  }
  std::istringstream in{log.str()};
  chrome_trace trace;
  trace.add_log("pool \"main\"", read_log(in));  // a name that needs escaping
  CHECK(trace.size() == 5);

  const json_value doc = parse_json(trace.to_json());
  const auto counters = events_with(doc, "C");
  REQUIRE(counters.size() == 4);
  const std::vector<double> in_use = {1000, 3000, 2000, 0};
  for (std::size_t i = 0; i < counters.size(); ++i) {
    const json_value& c = *counters[i];
    CHECK(c["name"].text == "pool \"main\" bytes");
    CHECK(c["args"]["in_use"].number == in_use[i]);
    CHECK(c["args"].has("reserved"));
    CHECK(c["pid"].number == 1);
    if (i > 0) {
      CHECK(c["ts"].number >= (*counters[i - 1])["ts"].number);
    }
  }
  CHECK((*counters[1])["args"]["reserved"].number == 3000);  // host leaf holds what it gave

  const auto markers = events_with(doc, "i");
  REQUIRE(markers.size() == 1);
  CHECK((*markers[0])["name"].text == "out of memory: pool \"main\"");
  CHECK((*markers[0])["args"]["requested_bytes"].number == 5000);
  CHECK((*markers[0])["s"].text == "p");
  CHECK(events_with(doc, "M").size() == 1);  // the process name
}

TEST_CASE("samples keep nanosecond precision and tracks stay apart") {
  chrome_trace trace;
  trace.add_sample("pool", 1234567, 10, 20);
  trace.add_sample("arena", 1234568, 30);
  trace.add_out_of_memory("arena", 2000000, 64, "fragmentation\nline two");
  const json_value doc = parse_json(trace.to_json());
  const auto counters = events_with(doc, "C");
  REQUIRE(counters.size() == 2);
  CHECK((*counters[0])["ts"].number == Approx(1234.567));
  CHECK((*counters[1])["name"].text == "arena bytes");
  CHECK_FALSE((*counters[1])["args"].has("reserved"));
  CHECK((*events_with(doc, "i")[0])["args"]["detail"].text == "fragmentation\nline two");
  CHECK(doc["displayTimeUnit"].text == "ns");
}

TEST_CASE("an empty trace is still valid JSON; frees of unknown pointers are ignored") {
  CHECK(parse_json(chrome_trace{}.to_json())["traceEvents"].items.size() == 1);
  std::istringstream in{"F,5,1,sync,0x40,8,8,\nA,6,1,sync,0x80,8,8,\n"};
  chrome_trace trace;
  trace.add_log("x", read_log(in));
  const json_value doc = parse_json(trace.to_json());  // kept: events_with points into it
  const auto counters = events_with(doc, "C");
  REQUIRE(counters.size() == 2);
  CHECK((*counters[0])["args"]["in_use"].number == 0);
  CHECK((*counters[1])["args"]["in_use"].number == 8);
}

TEST_CASE("write_file writes the same document, and fails loudly") {
  chrome_trace trace;
  trace.add_sample("pool", 1, 2);
  const std::string path = "test_trace_export.json";
  trace.write_file(path);
  std::ifstream in{path};
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() == trace.to_json());
  std::remove(path.c_str());
  CHECK_THROWS_AS(trace.write_file("/nonexistent-dir/trace.json"), std::runtime_error);
}

TEST_CASE("the JSON checker itself rejects broken documents") {
  CHECK_THROWS(parse_json("{\"a\":1,}"));
  CHECK_THROWS(parse_json("[1 2]"));
  CHECK_THROWS(parse_json("{\"a\":\"x\ny\"}"));
  CHECK_THROWS(parse_json("{} x"));
  CHECK(parse_json(" {\"a\":[true,false,null,-1.5e3]} ")["a"].items[3].number == -1500);
}
