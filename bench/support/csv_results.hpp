// bench/support/csv_results.hpp — a benchmark's results as a CSV file that a plot can read
// (bench/plots/make_figures.py), beside the table it prints.
//
//   cudamem_bench::csv_results csv{path, argc, argv};   // opens (truncates) path now
//   if (!csv) { ...csv.error()...; return 2; }          // e.g. a directory that does not exist
//   csv.describe("device", "NVIDIA H100 80GB HBM3");   // "# device: ..." lines first
//   csv.columns({"trace", "allocator", "ns_per_op"});
//   csv.row({"pair_1MiB", "pool"}, 14.9);               // text cells, then the number
//   if (!csv.finish()) { ...csv.error()...; return 1; } // a failed write is an error
//
// The file: comment lines "# key: value" first (what was measured, on what, when, and the
// command line, which the constructor writes itself as "date" and "command"), then one header
// row and the rows. Cells are written as given: the benchmarks' names of traces and
// allocators hold no commas or quotes. Numbers have one decimal, as the printed tables.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <initializer_list>
#include <string>

namespace cudamem_bench {

class csv_results {
 public:
  /// Opens `path` for writing and records the date (UTC) and the command line.
  csv_results(const std::string& path, int argc, char** argv)
      : path_(path), file_(std::fopen(path.c_str(), "w")) {
    if (file_ == nullptr) {
      error_ = "cannot write " + path + ": " + std::strerror(errno);
      return;
    }
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    gmtime_r(&now, &utc);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", &utc);
    describe("date", date);
    // The program by its name, not its path: the file names no directory of this machine.
    std::string command = argc > 0 ? std::string(argv[0]) : std::string("?");
    command.erase(0, command.find_last_of('/') + 1);
    for (int i = 1; i < argc; ++i) {
      command += " " + std::string(argv[i]);
    }
    describe("command", command);
  }
  csv_results(const csv_results&) = delete;
  csv_results& operator=(const csv_results&) = delete;
  ~csv_results() {
    if (file_ != nullptr) {
      std::fclose(file_);
    }
  }

  /// False when the file could not be opened or written; error() says why.
  explicit operator bool() const { return error_.empty(); }
  [[nodiscard]] const std::string& error() const { return error_; }

  /// A "# key: value" line; before columns().
  void describe(const char* key, const std::string& value) {
    if (file_ != nullptr) {
      std::fprintf(file_, "# %s: %s\n", key, value.c_str());
    }
  }

  /// The header row.
  void columns(std::initializer_list<const char*> names) {
    if (file_ == nullptr) {
      return;
    }
    const char* separator = "";
    for (const char* name : names) {
      std::fprintf(file_, "%s%s", separator, name);
      separator = ",";
    }
    std::fprintf(file_, "\n");
  }

  /// One row: the text cells, then the value.
  void row(std::initializer_list<std::string> cells, double value) {
    if (file_ == nullptr) {
      return;
    }
    for (const std::string& cell : cells) {
      std::fprintf(file_, "%s,", cell.c_str());
    }
    std::fprintf(file_, "%.1f\n", value);
  }

  /// Closes the file; false (and error()) when any write failed.
  bool finish() {
    if (file_ == nullptr) {
      return false;
    }
    const bool failed = std::ferror(file_) != 0;
    const bool closed = std::fclose(file_) == 0;
    file_ = nullptr;
    if (failed || !closed) {
      error_ = "writing " + path_ + " failed: " + std::strerror(errno);
      return false;
    }
    return true;
  }

 private:
  std::string path_;
  std::FILE* file_;
  std::string error_;
};

}  // namespace cudamem_bench
