"""The pipeline: the schedule (each device's order of stage visits), the stage (a stage on one
microbatch), the weight fetcher, the executor of a pass, and the threads they run on."""
