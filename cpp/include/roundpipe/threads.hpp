// The worker pool that spreads one optimizer step over CPU cores.
//
// A step call splits the concatenated elements of all its tensors into cache-line aligned chunks
// and runs them on a persistent pool (the calling thread takes part; workers sleep between
// steps). Small steps run on the calling thread alone.
#pragma once

namespace roundpipe {

/// Threads a step uses, counting the caller. Defaults to the CPUs this process may run on.
int num_threads();

/// Sets the threads a step uses, in [1, 1024]. Throws roundpipe::Error otherwise. Not to be called while
/// a step runs.
void set_num_threads(int n);

}  // namespace roundpipe
