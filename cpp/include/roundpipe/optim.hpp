// Umbrella header of the RoundPipe CPU optimizer library (target RoundPipe::optim).
#pragma once
#include "roundpipe/adagrad.hpp"
#include "roundpipe/adam.hpp"
#include "roundpipe/buffers.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/isa.hpp"
#include "roundpipe/rmsprop.hpp"
#include "roundpipe/sgd.hpp"
#include "roundpipe/threads.hpp"
