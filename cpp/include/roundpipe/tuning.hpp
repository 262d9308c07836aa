// Machine-dependent choices of the kernels that never change a result bit: how far ahead of its
// loads a kernel prefetches each array it streams through (software prefetch).
//
// The best distance depends on the CPU (its memory latency, how many misses a core keeps in
// flight, how well its hardware prefetchers follow several streams while the divider is busy),
// so it is chosen on the machine the library runs on: by default the first steps over at least
// kPrefetchCalibrationElements elements (all tensors of one call together) calibrate it, in
// rounds of blocks of chunks, each block of a round run with another candidate distance, timed,
// the candidates' order rotated from round to round (a round in which the process faulted
// pages in, as the first step over new state does, is dropped); after
// kPrefetchCalibrationRounds rounds (within one call or over several) the candidate with the
// lowest median time relative to its round's median is kept for the process. Only optimizer
// steps calibrate (whole-array conversions do not prefetch). Until then, and for smaller
// steps, kDefaultPrefetchBytes.
// The environment variable ROUNDPIPE_PREFETCH=<bytes> (a multiple of 64, at most 16384; 0: no
// software prefetch) or ROUNDPIPE_PREFETCH=auto (the default: calibrate) chooses at first use;
// set_prefetch_distance() at run time.
//
// A prefetch only moves data towards the core: every distance computes the same bits.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace roundpipe {

/// The distance used until calibration ends (and for steps too small to calibrate), in bytes
/// ahead in each float32 array (arrays of 16-bit or 8-bit values are prefetched as many
/// elements ahead, so half or a quarter of the bytes).
inline constexpr std::size_t kDefaultPrefetchBytes = 2048;
/// The distances calibration chooses from, in bytes ahead per float32 array (0: none).
inline constexpr std::size_t kPrefetchCandidates[] = {0, 1024, 2048, 4096};
/// A step calibrates only when its tensors hold at least this many elements together (smaller
/// steps run from the caches, where the distance matters little, and hold too few blocks).
inline constexpr std::size_t kPrefetchCalibrationElements = std::size_t{1} << 21;
/// Rounds measured before the choice is made (one round: one block of 16 chunks of 16384
/// elements per candidate, about 1M elements).
inline constexpr std::size_t kPrefetchCalibrationRounds = 8;

/// The prefetch distance in use and how it was chosen.
struct PrefetchChoice {
  std::size_t bytes = kDefaultPrefetchBytes;  ///< bytes ahead in each float32 array (0: none)
  /// "ROUNDPIPE_PREFETCH" (the environment), "set_prefetch_distance", "calibrated", or
  /// "default (calibrating)" while the calibration has not finished.
  std::string source;
  std::vector<std::size_t> candidates;  ///< kPrefetchCandidates, bytes
  /// Per candidate, the median over the rounds of its block's time per element / the median of
  /// its round's (lower is faster); empty until calibrated.
  std::vector<double> relative_time;
  /// Per candidate, the median of its blocks' nanoseconds per element; empty until calibrated.
  std::vector<double> ns_per_element;
  std::size_t rounds = 0;  ///< calibration rounds measured so far
};

/// The prefetch distance the kernels use now and how it was chosen. On the first call (or the
/// first step) reads ROUNDPIPE_PREFETCH; throws roundpipe::Error naming it if it is neither
/// `auto` nor a multiple of 64 in [0, 16384] (and reads it again on the next call). Every step
/// function calls it before changing anything, so a bad value fails the step cleanly.
PrefetchChoice prefetch_choice();

/// Fixes the prefetch distance at `bytes` (a multiple of 64 in [0, 16384]; 0: no software
/// prefetch) for later steps, ending any calibration. Throws roundpipe::Error otherwise.
void set_prefetch_distance(std::size_t bytes);

/// Forgets the choice (the environment's too): the next steps of at least
/// kPrefetchCalibrationElements elements calibrate again, with kDefaultPrefetchBytes until then.
void calibrate_prefetch();

}  // namespace roundpipe
