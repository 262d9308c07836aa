// Umbrella header of the RoundPipe CPU optimizer library (target RoundPipe::optim): every
// public header. (Formerly roundpipe/optim.hpp, which still forwards here for one release.)
//   roundpipe/<name>.hpp            one algorithm: <Name>Options, <Name>State, <name>_step
//   roundpipe/algorithms.hpp        the list of algorithms (X-macro)
//   roundpipe/optimizer.hpp         the Optimizer<Options> class template (owns the state)
//   roundpipe/optimizer_classes.hpp the optimizer classes roundpipe::Adam, ..., roundpipe::SGD
//   roundpipe/state_traits.hpp      what generic code reads of a <Name>State
//   roundpipe/buffers.hpp, step_io.hpp, compact.hpp, isa.hpp, threads.hpp, tuning.hpp, stream.hpp,
//                                   error.hpp
//   roundpipe/dequant.hpp           dequantization of NF4 / int8 weight blocks (quantized bases)
#pragma once
#include "roundpipe/adadelta.hpp"
#include "roundpipe/adafactor.hpp"
#include "roundpipe/algorithms.hpp"
#include "roundpipe/adagrad.hpp"
#include "roundpipe/adam.hpp"
#include "roundpipe/adamax.hpp"
#include "roundpipe/asgd.hpp"
#include "roundpipe/buffers.hpp"
#include "roundpipe/compact.hpp"
#include "roundpipe/dequant.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/isa.hpp"
#include "roundpipe/nadam.hpp"
#include "roundpipe/optimizer.hpp"
#include "roundpipe/optimizer_classes.hpp"
#include "roundpipe/radam.hpp"
#include "roundpipe/rmsprop.hpp"
#include "roundpipe/rprop.hpp"
#include "roundpipe/sgd.hpp"
#include "roundpipe/state_traits.hpp"
#include "roundpipe/stream.hpp"
#include "roundpipe/threads.hpp"
#include "roundpipe/tuning.hpp"
