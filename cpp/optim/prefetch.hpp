// Internal: the software prefetch distance the kernels read (kernels/for_range.hpp:
// prefetch_streams), chosen by tuning.cpp (roundpipe/tuning.hpp). Plain data, shared by the ISA
// translation units and the rest alike.
#pragma once
#include <cstddef>

namespace roundpipe {
namespace detail {

// Elements ahead of the current one (0: no software prefetch). Written only under the step lock
// while no task runs (threads.cpp: run_tasks_locked), so a step's tasks all read one value.
extern std::size_t g_prefetch_elements;

}  // namespace detail
}  // namespace roundpipe
