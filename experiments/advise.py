"""How large should my batch be now? python -m experiments.advise --workdir=RUN.

The command lives in `cbs.commands.advise` (installed as the `cbs-advise` console script); this
module keeps `python -m experiments.advise` working from a checkout.
"""

from cbs.commands.advise import main, run  # noqa: F401 (defines the command's flags)

if __name__ == "__main__":
    run()
