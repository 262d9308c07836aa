// The old name of roundpipe/optimizer_classes.hpp (the optimizer classes roundpipe::Adam, ...):
// this forwarding header is kept for one release.
#pragma once
#include "roundpipe/optimizer_classes.hpp"
