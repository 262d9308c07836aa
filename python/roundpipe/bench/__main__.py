"""python -m roundpipe.bench: optimizer steps against their memory-bandwidth floor and torch."""

from .optim import main

if __name__ == "__main__":
    main()
