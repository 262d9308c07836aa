// Test driver: prints the ISA the dispatcher chose before running the suite, so every log says
// which code ran. ROUNDPIPE_TEST_QUICK=1 (set for emulated runs) drops the multi-million sizes.
#include <gtest/gtest.h>

#include <cstdio>

#include "roundpipe/roundpipe.hpp"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  try {
    std::printf("RoundPipe active ISA: %s (supported:", roundpipe::isa_name(roundpipe::active_isa()));
    for (auto isa : roundpipe::supported_isas()) std::printf(" %s", roundpipe::isa_name(isa));
    std::printf(")\n");
  } catch (const roundpipe::Error& e) {
    std::printf("RoundPipe active ISA: none (%s)\n", e.what());
  }
  return RUN_ALL_TESTS();
}
