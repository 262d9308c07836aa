"""The pipeline: the schedule (each device's order of stage visits), the stage (a stage on one
microbatch), the weight fetcher and the executor of a pass (the threads they run on, and the
primitives they wait on, are :mod:`roundpipe.threads`)."""
