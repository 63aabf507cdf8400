// SPDX-License-Identifier: Apache-2.0
// The GPU benchmarks' driver (bench/cuda/<name>.cu -> gpubench_<name>): Google Benchmark's main
// with the flags the scripts pass (--out FILE, --commit SHA and each program's own, kept from
// the hand-rolled parsers they replace), the run's context, and a clean skip without a device.
// Host C++ only: gbench_main.cpp is compiled by the C++ compiler, so it may use fmt (whose
// headers nvcc's front end does not parse); the benchmarks' CUDA side is bench_support.cuh.
//
// Benchmark names are "family/key:value/key:value/..." (e.g.
// "decode/shape:24x4x256/mix:tiered/path:stream/context:32768/batch:8"); bench/gpu/gbench_record.py
// parses them back into the records' fields, so a key holds no '/' or ':'.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace tierkv::bench {

// A flag of the program's own: `--name` (a switch) or `--name VALUE` / `--name=VALUE`.
struct flag {
  std::string name;        // "--mix"
  std::string value_name;  // empty: a switch
  std::string help;
  std::function<void(const std::string&)> set;  // gets the value ("" for a switch)
};

struct device_facts {
  std::string name;
  int sms = 0;
  std::size_t l2_bytes = 0;
};

struct program {
  std::string name;     // "gpubench_decode"
  std::string summary;  // --help's first lines
  std::vector<flag> flags;
  std::string positional_help;                         // empty: no positional arguments
  std::function<void(const std::string&)> positional;  // one positional argument
  // The device is there and benchmarks will run (not with --benchmark_list_tests): allocate,
  // calibrate, add_context. Runs before register_benchmarks.
  std::function<void(const device_facts&)> setup;
  // RegisterBenchmark calls; needs no device (--benchmark_list_tests works without one).
  std::function<void()> register_benchmarks;
  std::function<void()> teardown;    // after the run: free what the benchmarks cached
  std::function<int()> exit_status;  // after the run; default 0
};

// Parses argv (the program's flags, --out, --commit; the rest goes to Google Benchmark), exits 0
// with "<name>: no CUDA device: skipped" where there is no device, else runs the benchmarks.
// --out FILE = --benchmark_out=FILE --benchmark_out_format=json; --commit SHA = context "commit".
int run(int argc, char** argv, const program& p);

// A key / value pair of the run's context (Google Benchmark's JSON "context" object).
void add_context(const std::string& key, const std::string& value);
void add_context(const std::string& key, double value, int digits);

// "family/key:value/...": the name of a benchmark (Args add "/name:value" after it).
class bench_name {
 public:
  explicit bench_name(std::string_view family);
  bench_name& add(std::string_view key, std::string_view value);
  bench_name& add(std::string_view key, long long value);
  const std::string& str() const { return s_; }
  const char* c_str() const { return s_.c_str(); }

 private:
  std::string s_;
};

// "24x4x256": q_heads x kv_heads x head_dim.
std::string shape(int q_heads, int kv_heads, int head_dim);

// A flag's integer value; exits 2 naming the flag when it is not one.
int to_int(const std::string& flag_name, const std::string& value);

// One line to stdout (flushed): progress notes between Google Benchmark's rows.
void say(std::string_view line);

}  // namespace tierkv::bench
