import os
import sys

from dflash2.train.cli import main

if __name__ == "__main__":
    code = main()
    if "LOCAL_RANK" in os.environ:
        # a worker of a distributed run, its process group destroyed and its files written: it leaves without
        # the interpreter's teardown, where gloo's threads can abort a run that succeeded ("terminate called
        # without an active exception", pytorch/pytorch#179291)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
