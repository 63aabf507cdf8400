// SPDX-License-Identifier: Apache-2.0
#include <cstdint>
#include <cstring>

#include "catch.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"

using namespace tierkv;

namespace {
struct missing_copy {
  static constexpr memory_space space = memory_space::host;
  static constexpr bool host_accessible = true;
  result<void*> allocate(std::size_t);
  void deallocate(void*, std::size_t);
  std::size_t bytes_allocated() const;
};
}  // namespace

TEST_CASE("allocator policies satisfy the concept; incomplete ones do not", "[memory][allocator]") {
  STATIC_REQUIRE(allocator_policy<host_allocator>);
  STATIC_REQUIRE(allocator_policy<failing_allocator>);
  STATIC_REQUIRE(host_allocator_policy<host_allocator>);
  STATIC_REQUIRE_FALSE(allocator_policy<missing_copy>);
  STATIC_REQUIRE_FALSE(allocator_policy<int>);
}

TEST_CASE("host allocator counts live bytes exactly and aligns to 256", "[memory][allocator]") {
  host_allocator a;
  auto p = a.allocate(1000);
  auto q = a.allocate(24);
  REQUIRE(p);
  REQUIRE(q);
  CHECK(a.bytes_allocated() == 1024);
  CHECK(a.live_allocations() == 2);
  CHECK(reinterpret_cast<std::uintptr_t>(*p) % allocation_alignment == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(*q) % allocation_alignment == 0);
  REQUIRE(a.fill(*p, 0xAB, 1000));
  CHECK(static_cast<std::uint8_t*>(*p)[999] == 0xAB);
  REQUIRE(a.copy(*q, *p, 24));
  CHECK(static_cast<std::uint8_t*>(*q)[23] == 0xAB);
  a.deallocate(*p, 1000);
  CHECK(a.bytes_allocated() == 24);
  a.deallocate(*q, 24);
  CHECK(a.bytes_allocated() == 0);
  CHECK(a.allocate(0).code() == errc::invalid_argument);
}

TEST_CASE("failing allocator fails exactly the chosen request", "[memory][allocator][fault]") {
  failing_allocator a;
  a.fail_on(3);
  auto r1 = a.allocate(8);
  auto r2 = a.allocate(8);
  auto r3 = a.allocate(8);
  auto r4 = a.allocate(8);
  CHECK(r1.has_value());
  CHECK(r2.has_value());
  REQUIRE_FALSE(r3.has_value());
  CHECK(r3.code() == errc::injected_fault);
  CHECK(r3.error_status().message().find("request #3") != std::string::npos);
  CHECK(r4.has_value());
  CHECK(a.faults_injected() == 1);
  CHECK(a.requests() == 4);
  CHECK(a.bytes_allocated() == 24);
  a.fail_every();
  CHECK_FALSE(a.allocate(1).has_value());
  a.reset();
  auto r5 = a.allocate(1);
  CHECK(r5.has_value());
  for (auto* r : {&r1, &r2, &r4}) a.deallocate(**r, 8);
  a.deallocate(*r5, 1);
  CHECK(a.bytes_allocated() == 0);
  CHECK(a.live_allocations() == 0);
}

TEST_CASE("counted allocator charges its line and throws a status on failure",
          "[memory][allocator]") {
  failing_allocator a;
  std::size_t line = 0;
  {
    std::vector<int, counted_allocator<int, failing_allocator>> v(
        counted_allocator<int, failing_allocator>(a, line));
    v.reserve(100);
    CHECK(line == 400);
    CHECK(a.bytes_allocated() == 400);
    a.fail_on(1);
    bool threw = false;
    try {
      v.reserve(1000);
    } catch (const allocation_failure& e) {
      threw = true;
      CHECK(e.get_status().code() == errc::injected_fault);
    }
    CHECK(threw);
    CHECK(v.capacity() == 100);  // strong guarantee of reserve
    CHECK(line == 400);
  }
  CHECK(line == 0);
  CHECK(a.bytes_allocated() == 0);
}
