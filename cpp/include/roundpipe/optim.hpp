// Umbrella header of the RoundPipe CPU optimizer library (target RoundPipe::optim).
#pragma once
#include "roundpipe/adadelta.hpp"
#include "roundpipe/adam.hpp"
#include "roundpipe/adamax.hpp"
#include "roundpipe/asgd.hpp"
#include "roundpipe/buffers.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/isa.hpp"
#include "roundpipe/nadam.hpp"
#include "roundpipe/radam.hpp"
#include "roundpipe/rprop.hpp"
#include "roundpipe/optimizers.hpp"
#include "roundpipe/threads.hpp"
