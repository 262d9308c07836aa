// The one exception type of the RoundPipe C++ library.
#pragma once
#include <stdexcept>

namespace roundpipe {

/// Thrown for every invalid argument (bad hyperparameter, null or missing buffer, unknown or
/// unsupported ISA, bad thread count). The message names the argument and what was expected.
/// Nothing has been modified when it is thrown. Derives from std::invalid_argument, so Python
/// bindings surface it as ValueError.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace roundpipe
