// SPDX-License-Identifier: Apache-2.0
// The GPU benchmarks' driver: gbench_main.hpp says what it does. Formatting goes through fmt
// where CMake found it (TIERKV_BENCH_HAVE_FMT, bench/CMakeLists.txt), else through snprintf.
#include "gbench_main.hpp"

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#if TIERKV_BENCH_HAVE_FMT
#include <fmt/format.h>
#endif

namespace tierkv::bench {
namespace {

std::string fixed(double v, int digits) {
#if TIERKV_BENCH_HAVE_FMT
  return fmt::format("{:.{}f}", v, digits);
#else
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
#endif
}

void print_usage(const program& p) {
#if TIERKV_BENCH_HAVE_FMT
  fmt::print("{}\n\nusage: {} [flags] [--benchmark_* flags]{}\n\n", p.summary, p.name,
             p.positional_help.empty() ? "" : " " + p.positional_help);
  fmt::print(
      "  {:<26} {}\n", "--out FILE",
      "Google Benchmark's JSON to FILE (= --benchmark_out=FILE --benchmark_out_format=json;");
  fmt::print("  {:<26} {}\n", "", "bench/gpu/gbench_record.py FILE turns it into the old record)");
  fmt::print("  {:<26} {}\n", "--commit SHA", "the commit, in the JSON's context");
  for (const flag& f : p.flags)
    fmt::print("  {:<26} {}\n", f.value_name.empty() ? f.name : f.name + " " + f.value_name,
               f.help);
  fmt::print("\nGoogle Benchmark's flags follow.\n\n");
#else
  std::printf("%s\n\nusage: %s [flags] [--benchmark_* flags] %s\n\n", p.summary.c_str(),
              p.name.c_str(), p.positional_help.c_str());
  std::printf(
      "  %-26s %s\n", "--out FILE",
      "Google Benchmark's JSON to FILE (= --benchmark_out=FILE --benchmark_out_format=json;");
  std::printf("  %-26s %s\n", "", "bench/gpu/gbench_record.py FILE turns it into the old record)");
  std::printf("  %-26s %s\n", "--commit SHA", "the commit, in the JSON's context");
  for (const flag& f : p.flags) {
    const std::string spec = f.value_name.empty() ? f.name : f.name + " " + f.value_name;
    std::printf("  %-26s %s\n", spec.c_str(), f.help.c_str());
  }
  std::printf("\nGoogle Benchmark's flags follow.\n\n");
#endif
  std::fflush(stdout);
}

int usage_error(const program& p, const std::string& what) {
#if TIERKV_BENCH_HAVE_FMT
  fmt::print(stderr, "{}: {} (--help lists the flags)\n", p.name, what);
#else
  std::fprintf(stderr, "%s: %s (--help lists the flags)\n", p.name.c_str(), what.c_str());
#endif
  return 2;
}

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

int run_checked(int argc, char** argv, const program& p) {
  std::vector<std::string> gb{argv[0]};
  std::string commit = "unknown";
  bool listing = false, help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    std::string key = a, value;
    bool has_value = false;
    if (starts_with(a, "--")) {
      const auto eq = a.find('=');
      if (eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
        has_value = true;
      }
    }
    if (starts_with(a, "--benchmark_") || key == "--v") {  // Google Benchmark's own
      if (key == "--benchmark_list_tests")
        listing = !has_value || value == "true" || value == "1" || value == "yes";
      gb.push_back(a);
      continue;
    }
    if (key == "--help" || key == "-h") {
      help = true;
      continue;
    }
    auto take = [&](std::string& out) {
      if (has_value) {
        out = value;
        return true;
      }
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    if (key == "--out") {
      std::string file;
      if (!take(file)) return usage_error(p, "--out needs a FILE");
      gb.push_back("--benchmark_out=" + file);
      gb.push_back("--benchmark_out_format=json");
      continue;
    }
    if (key == "--commit") {
      if (!take(commit)) return usage_error(p, "--commit needs a SHA");
      continue;
    }
    const flag* match = nullptr;
    for (const flag& f : p.flags)
      if (f.name == key) match = &f;
    if (match != nullptr) {
      std::string v;
      if (match->value_name.empty()) {
        if (has_value) return usage_error(p, key + " takes no value");
      } else if (!take(v)) {
        return usage_error(p, key + " needs " + match->value_name);
      }
      match->set(v);
      continue;
    }
    if (!starts_with(a, "-") && p.positional) {
      p.positional(a);
      continue;
    }
    return usage_error(p, "unknown argument " + a);
  }
  if (help) {
    print_usage(p);
    gb.push_back("--help");  // Google Benchmark prints its flags and exits 0
  }
  std::vector<char*> gv;
  for (std::string& s : gb) gv.push_back(s.data());
  int gc = static_cast<int>(gv.size());
  gv.push_back(nullptr);
  benchmark::Initialize(&gc, gv.data());
  if (benchmark::ReportUnrecognizedArguments(gc, gv.data())) return 2;

  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  const bool have_device = e == cudaSuccess && devices > 0;
  if (!have_device) {
    (void)cudaGetLastError();
    if (!listing) {
      say(p.name + ": no CUDA device: skipped (" +
          (e == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorString(e))) + ")");
      return 0;
    }
  }
  add_context("tierkv_program", p.name);
  add_context("commit", commit);
  if (have_device) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
      std::fprintf(stderr, "%s: cudaGetDeviceProperties failed\n", p.name.c_str());
      return 1;
    }
    int runtime = 0, driver = 0;
    (void)cudaRuntimeGetVersion(&runtime);
    (void)cudaDriverGetVersion(&driver);
    device_facts dev{prop.name, prop.multiProcessorCount,
                     static_cast<std::size_t>(prop.l2CacheSize)};
    add_context("gpu", dev.name);
    add_context("sms", std::to_string(dev.sms));
    add_context("l2_bytes", std::to_string(dev.l2_bytes));
    add_context("compute_capability",
                std::to_string(prop.major) + "." + std::to_string(prop.minor));
    add_context("cuda_runtime", std::to_string(runtime));
    add_context("cuda_driver", std::to_string(driver));
    if (!listing && p.setup) p.setup(dev);
  }
  if (p.register_benchmarks) p.register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  if (p.teardown) p.teardown();
  benchmark::Shutdown();
  return p.exit_status ? p.exit_status() : 0;
}

}  // namespace

int run(int argc, char** argv, const program& p) {
  try {
    return run_checked(argc, argv, p);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "%s: %s\n", p.name.c_str(), ex.what());
    return 1;
  }
}

void add_context(const std::string& key, const std::string& value) {
  benchmark::AddCustomContext(key, value);
}

void add_context(const std::string& key, double value, int digits) {
  benchmark::AddCustomContext(key, fixed(value, digits));
}

bench_name::bench_name(std::string_view family) : s_(family) {}

bench_name& bench_name::add(std::string_view key, std::string_view value) {
#if TIERKV_BENCH_HAVE_FMT
  fmt::format_to(std::back_inserter(s_), "/{}:{}", key, value);
#else
  s_.append("/").append(key).append(":").append(value);
#endif
  return *this;
}

bench_name& bench_name::add(std::string_view key, long long value) {
  return add(key, std::to_string(value));
}

std::string shape(int q_heads, int kv_heads, int head_dim) {
#if TIERKV_BENCH_HAVE_FMT
  return fmt::format("{}x{}x{}", q_heads, kv_heads, head_dim);
#else
  return std::to_string(q_heads) + "x" + std::to_string(kv_heads) + "x" + std::to_string(head_dim);
#endif
}

int to_int(const std::string& flag_name, const std::string& value) {
  std::size_t used = 0;
  int v = 0;
  try {
    v = std::stoi(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size()) {
    std::fprintf(stderr, "%s: not an integer: '%s'\n", flag_name.c_str(), value.c_str());
    std::exit(2);
  }
  return v;
}

void say(std::string_view line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace tierkv::bench
