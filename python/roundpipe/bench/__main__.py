"""python -m roundpipe.bench: optimizer steps against their memory-bandwidth floor and torch
(:mod:`roundpipe.bench.optim`, the default, with its options);
``python -m roundpipe.bench pipeline [options]``: RoundPipe training with and without overlap
(:mod:`roundpipe.bench.pipeline`); ``python -m roundpipe.bench overhead [options]``: the fixed
cost of one training call on a tiny model (:mod:`roundpipe.bench.overhead`);
``python -m roundpipe.bench distributed [options]``: data parallel ranks, communication and
how much of it is hidden (:mod:`roundpipe.bench.distributed`);
``python -m roundpipe.bench memory [options]``: host bytes per parameter, step speed and
convergence of each compact-storage option (:mod:`roundpipe.bench.memory`);
``python -m roundpipe.bench generate [options]``: generation through the pipeline against
plain transformers generate, tokens/s and bytes per generated token
(:mod:`roundpipe.bench.generate`);
``python -m roundpipe.bench qlora [options]``: LoRA on a quantized frozen base against a bf16
base, tokens/s and upload bytes, and (CUDA) one layer's dequantization
(:mod:`roundpipe.bench.qlora`); ``python -m roundpipe.bench long [options]``: peak host memory
of one training call at long sequences, plain, padded and packed, against plain transformers
(:mod:`roundpipe.bench.long`);
``python -m roundpipe.bench disk [options]``: the optimizer state on a disk against the disk's
bandwidth and against host memory: step bytes, exact-mode time, peak RSS
(:mod:`roundpipe.bench.disk`)."""

import sys

from .optim import main

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "pipeline":
        from .pipeline import main as pipeline_main

        pipeline_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "overhead":
        from .overhead import main as overhead_main

        overhead_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "distributed":
        from .distributed import main as distributed_main

        distributed_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "generate":
        from .generate import main as generate_main

        generate_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "qlora":
        from .qlora import main as qlora_main

        qlora_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "long":
        from .long import main as long_main

        long_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "disk":
        from .disk import main as disk_main

        disk_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "memory":
        from .memory import main as memory_main

        memory_main(sys.argv[2:])
    else:
        main()
