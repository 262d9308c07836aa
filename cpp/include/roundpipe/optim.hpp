// The umbrella header's old name (now roundpipe/roundpipe.hpp): this forwarding header is kept
// for one release.
#pragma once
#include "roundpipe/roundpipe.hpp"
