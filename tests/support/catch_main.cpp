// SPDX-License-Identifier: Apache-2.0
// The Catch2 main for every test executable, built once.
#if defined(TIERKV_CATCH3)
#include <catch2/catch_session.hpp>
int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
#endif
