// The list of the library's step functions, once, for code generated per algorithm: the kernel
// table and its per-ISA instances (cpp/optim), the Python bindings. ROUNDPIPE_ALGORITHMS(X)
// expands X(name, Name) for every optimizer algorithm, ROUNDPIPE_STEP_FUNCTIONS(X) for those and
// the memory-traffic floor (roundpipe/stream.hpp). Each entry stands for:
//   roundpipe/<name>.hpp  <Name>Options (with for_each_field), <Name>State (slot names) and
//                         void <name>_step(const <Name>Options&, const ParamBuffers*,
//                                          std::size_t, StepIO*)
// (docs/design.md §3 lists the steps of adding an algorithm).
#pragma once

#define ROUNDPIPE_ALGORITHMS(X) \
  X(adadelta, Adadelta)         \
  X(adafactor, Adafactor)       \
  X(adagrad, Adagrad)           \
  X(adam, Adam)                 \
  X(adamax, Adamax)             \
  X(asgd, ASGD)                 \
  X(nadam, NAdam)               \
  X(radam, RAdam)               \
  X(rmsprop, RMSprop)           \
  X(rprop, Rprop)               \
  X(sgd, SGD)

#define ROUNDPIPE_STEP_FUNCTIONS(X) \
  ROUNDPIPE_ALGORITHMS(X)           \
  X(stream, Stream)
